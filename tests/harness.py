"""What the bad-input, safety, leads-out and fuzzing tests share: a command or an API call played in a directory of
the test's own, judged as a success or a refusal in one line (no traceback, no warning before it), and the tree of
files it must leave as it was. fcaudit (and so torch) is imported on first use: the fuzzing campaign's parent
process imports this module without them."""

from __future__ import annotations

import json
import os
import stat
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

FAILURES = ("traceback", "noisy", "silent", "foreign-write", "hang", "rss")
NOISE = ("Warning:", "warnings.warn", "Traceback (most recent call last)", "warn(")


# ---- outcomes ------------------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    kind: str  # "ok", "refused" or one of FAILURES
    detail: str = ""  # the refusal's line, or what failed

    @property
    def failed(self) -> bool:
        return self.kind in FAILURES


def printed(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.strip()]


def cli_outcome(result) -> Outcome:
    """Exit 0, or exit 2 with `error: ...` (fcaudit's) or Click's usage error, and nothing noisy before a refusal."""
    out = result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return Outcome("traceback", last_frames(result.exception))
    if result.exit_code == 0:
        return Outcome("ok")
    lines = printed(out)
    if result.exit_code == 2 and lines and (lines[-1].startswith("error: ") or "Error: " in out):
        noisy = [line for line in lines if any(n in line for n in NOISE)]
        return Outcome("noisy", " | ".join(noisy[:2])[:300]) if noisy else Outcome("refused", lines[-1])
    return Outcome("traceback", f"exit {result.exit_code}: {out[-300:]}")


def last_frames(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)[-2:]
    where = "; ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames)
    return f"{type(e).__name__}: {' '.join(str(e).split())[:200]} [{where}]"


def api_outcome(call: Callable[[], Any]) -> tuple[Outcome, Any]:
    """A call's outcome and its value: refused is one FcauditError line; any other exception is a traceback."""
    from fcaudit.errors import FcauditError

    try:
        return Outcome("ok"), call()
    except FcauditError as e:
        text = str(e)
        return (Outcome("refused", text) if "\n" not in text.strip() else Outcome("traceback", "multi-line: "
                                                                                   + text[:300])), None
    except Exception as e:  # noqa: BLE001 (every other exception is the finding)
        return Outcome("traceback", last_frames(e)), None


# ---- playing and asserting -----------------------------------------------------------------------------------------

def cli(*args, input: str | None = None):
    """The `fcaudit` command with `args` (paths and numbers as their text), in this process."""
    from typer.testing import CliRunner

    from fcaudit.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], input=input)


def refusal(result) -> str:
    """The one line of a command fcaudit refused: exit code 2, `error: ...` and nothing else printed."""
    outcome = cli_outcome(result)
    assert outcome.kind == "refused" and result.exit_code == 2, (outcome, result.output)
    lines = printed(result.output)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def api_refusal(call: Callable[[], Any]) -> str:
    """The one FcauditError line with which `call` was refused."""
    outcome, _ = api_outcome(call)
    assert outcome.kind == "refused" and "\n" not in outcome.detail, outcome
    return outcome.detail


def ok(result) -> None:
    assert result.exit_code == 0, result.output


def tree(*roots: Path, skip: frozenset[str] = frozenset()) -> dict[str, tuple]:
    """Every entry below `roots` as lstat sees it (a link as its target, never followed; a file by its size, mtime and
    inode, so any write or replacement shows), `skip` names neither recorded nor entered. A directory by its entries
    alone: a probe made and removed inside it leaves none."""
    out = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in skip]
            for name in dirnames + filenames:
                if name in skip:
                    continue
                p = os.path.join(dirpath, name)
                s = os.lstat(p)
                if stat.S_ISLNK(s.st_mode):
                    out[p] = ("link", os.readlink(p))
                elif stat.S_ISDIR(s.st_mode):
                    out[p] = ("dir",)
                else:
                    out[p] = (stat.S_IFMT(s.st_mode), s.st_size, s.st_mtime_ns, s.st_ino)
    return out


# ---- inputs: tiny checkpoints and audits, the user's files -----------------------------------------------------------

def edit_config(d: Path, **config) -> Path:
    """`d`'s config.json with the fields of `config` set."""
    if config:
        (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), **config}))
    return d


def fg_ckpt(t: Path, **config) -> Path:
    """A tiny FeatureGate checkpoint in t/fg; `config` overrides fields of its config.json."""
    import torch

    from fcaudit.models.checkpoint import save_checkpoint
    from fcaudit.models.featuregate import FeatureGateGPT, config_for

    torch.manual_seed(0)
    d = save_checkpoint(t / "fg", FeatureGateGPT(config_for("tiny", "featuregate")), {"variant": "featuregate"})
    return edit_config(d, **config)


def mudd_ckpt(t: Path, name: str = "mudd", **config) -> Path:
    """A tiny MUDDPythia checkpoint in t/`name`."""
    import torch

    from fcaudit.models.muddpythia import BYTE_PRESETS, MUDDPythia

    torch.manual_seed(0)
    return edit_config(MUDDPythia(BYTE_PRESETS["tiny"]).save_pretrained(t / name), **config)


def moe_ckpt(t: Path, name: str = "moe", **config) -> Path:
    """A tiny Hugging Face Mixtral checkpoint (2 layers) in t/`name`."""
    from fcaudit.families.hf.tiny import tiny_moe

    tiny_moe("mixtral").save_pretrained(t / name)
    return edit_config(t / name, **config)


def an_audit(t: Path) -> Path:
    """A finished audit directory of a tiny FeatureGate, t/audit."""
    import torch

    import fcaudit as fca
    from fcaudit.models.featuregate import FeatureGateGPT, config_for

    torch.manual_seed(0)
    model = FeatureGateGPT(config_for("tiny", "featuregate"))
    ids = torch.randint(0, 256, (6, 16), generator=torch.Generator().manual_seed(0))
    fca.audit(model, fca.controller_for(model), ids[:4], ids[4:], randomizations=1, out=t / "audit", quiet=True)
    return t / "audit"


def user_file(t: Path, name: str = "precious.txt", text: str = "the user's own file\n") -> Path:
    """A file of the user's, t/`name`, that fcaudit must never change."""
    f = t / name
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(text)
    return f
