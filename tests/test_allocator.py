"""fcaudit.allocator: freed tensor memory stays in the heap, so repeated forward-sized allocations stop faulting."""

import json
import os
import platform
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from fcaudit import allocator
from fcaudit.cli import app

# Six 8 MiB tensors at a time, freed together, ten rounds: with glibc's defaults the freed 48 MiB at the top of the
# heap exceeds the trim threshold (twice the 8 MiB mmap threshold that the first free raises it to) and goes back to
# the OS, so every round faults all its pages in again. Kept, the heap settles within a few rounds (the freed
# blocks and Python's own small allocations interleave at first), then reuses its blocks: the last rounds count.
ROUNDS = """
import json, resource, torch
from fcaudit.allocator import keep_freed_memory
kept = keep_freed_memory()
torch.ones(2 << 20)  # raises glibc's dynamic mmap threshold to 8 MiB, as a first forward pass would
faults = []
for _ in range(10):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [torch.ones(2 << 20) for _ in range(6)]
    del blocks
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps({"kept": kept, "faults": max(faults[-3:])}))
"""


def rounds(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in allocator.USER_SETTINGS and k != "FCAUDIT_MALLOC"}
    out = subprocess.run([sys.executable, "-c", ROUNDS], env={**clean, **env}, capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_kept_memory_stops_the_page_faults_of_repeated_allocations():
    kept = rounds()
    assert kept["kept"] is True
    # with the defaults 12,256 faults a round in most runs here (0 in some: where the heap lands matters)
    default = rounds(FCAUDIT_MALLOC="default")
    assert default["kept"] is False
    assert kept["faults"] < 200, (default, kept)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_a_users_own_malloc_setting_wins():
    mine = rounds(MALLOC_TRIM_THRESHOLD_="0")
    assert mine["kept"] is False


def test_every_command_keeps_freed_memory(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: calls.append(1) or True)
    result = CliRunner().invoke(app, ["summarize", str(tmp_path / "missing"), "--out", str(tmp_path / "s")])
    assert result.exit_code == 2 and calls == [1]
