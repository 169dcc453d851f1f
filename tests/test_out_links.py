"""Nothing is written through a symbolic link: an --out that is a link, or lies below one, is refused in one line by
every command (fcaudit.io.OutDir.check), and the directory it points to is left as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fcaudit as fca
from fcaudit.errors import FcauditError
from harness import an_audit, cli, fg_ckpt, refusal, tree, user_file

SMALL = ["--device", "cpu"]
COMMANDS = {
    "audit": lambda t: ["audit", fg_ckpt(t), "--eval", 2, "--calib", 2, "--window", 8, "--randomizations", 1],
    "summarize": lambda t: ["summarize", an_audit(t)],
    "train": lambda t: ["train", "--preset", "tiny", "--steps", 1, "--batch-size", 2],
    "execution": lambda t: ["execution", fg_ckpt(t), "--window", 8, "--min-run-time", 0.01],
    "report": lambda t: ["report", an_audit(t)],
    "demo": lambda t: ["demo", "--quick"],
}


@pytest.fixture
def elsewhere(tmp_path) -> Path:
    """A directory of the user's, empty but for one file, which a link points to."""
    d = tmp_path / "elsewhere"
    user_file(d, "keep.txt")
    return d


@pytest.mark.parametrize("below", [False, True], ids=["out-is-a-link", "out-below-a-link"])
@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_refuses_an_out_through_a_link(tmp_path, elsewhere, command, below):
    args = COMMANDS[command](tmp_path)
    link = tmp_path / "link"
    link.symlink_to(elsewhere)
    out = link / "out" if below else link
    before = tree(elsewhere)
    line = refusal(cli(*args, "--out", out))
    where = f"lies below the symbolic link {link}" if below else "is a symbolic link"
    assert f"--out {out} {where}" in line and f"pass the real path, {elsewhere.resolve()}" in line
    assert tree(elsewhere) == before and link.is_symlink()


def test_the_python_api_refuses_an_out_through_a_link(tmp_path, elsewhere):
    (tmp_path / "link").symlink_to(elsewhere)
    torch.manual_seed(0)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.gate, self.head = torch.nn.Embedding(256, 8), torch.nn.Linear(8, 1), torch.nn.Linear(8, 256)

        def forward(self, ids):
            h = self.emb(ids)
            return self.head(h * torch.sigmoid(self.gate(h)))

    model = Tiny().eval()
    ctrl = fca.Controller.from_modules(model, "gate", layout="batch token 1")
    ids = torch.randint(0, 256, (6, 8), generator=torch.Generator().manual_seed(0))
    before = tree(elsewhere)
    with pytest.raises(FcauditError, match="is a symbolic link: fcaudit never writes through links"):
        fca.audit(model, ctrl, ids[:4], ids[4:], randomizations=1, out=tmp_path / "link", quiet=True)
    assert tree(elsewhere) == before


def test_the_real_path_the_refusal_names_is_taken(tmp_path, elsewhere):
    (tmp_path / "link").symlink_to(elsewhere)
    line = refusal(cli(*COMMANDS["train"](tmp_path), "--out", tmp_path / "link" / "run"))
    real = line.rsplit("pass the real path, ", 1)[1]
    r = cli(*COMMANDS["train"](tmp_path), *SMALL, "--out", real)
    assert r.exit_code == 0, r.output
    assert (elsewhere / "run" / "metrics.json").is_file()
