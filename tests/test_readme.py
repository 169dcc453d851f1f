"""The README's Python example runs verbatim, on a checkpoint like the one its `fcaudit train` line writes."""

import re
from pathlib import Path

import torch

from fcaudit.models.checkpoint import save_checkpoint
from fcaudit.models.featuregate import FeatureGateGPT, config_for

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_python_example_runs_verbatim(tmp_path, monkeypatch):
    blocks = python_blocks()
    assert len(blocks) == 1, "one Python example in the README, tested here"
    torch.manual_seed(0)  # untrained weights: the example is about the calls, not the numbers
    save_checkpoint(tmp_path / "runs" / "fg-s0", FeatureGateGPT(config_for("demo", "featuregate")),
                    {"variant": "featuregate", "preset": "demo", "seed": 0})
    from transformers import AutoModelForCausalLM

    from fcaudit import families
    from fcaudit.families.hf_moe.tiny import byte_mixtral_config

    moe = AutoModelForCausalLM.from_config(byte_mixtral_config("demo"))  # what `fcaudit train --model moe` builds
    families.for_model(moe).save(moe, tmp_path / "runs" / "moe-s0", {})
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(blocks[0], str(README), "exec"), scope)
    assert scope["result"].replay["passed"]
    assert scope["model"].fcaudit_meta["variant"] == "featuregate"
    assert (tmp_path / "audits" / "fg-s0-py" / "replay.json").is_file()
    assert scope["moe_result"].replay["route_flips"] == 0


def test_public_names_are_listed_and_importable():
    import fcaudit as fca

    public = [n for n in dir(fca) if not n.startswith("_")]
    assert {"load", "windows", "audit", "controller_for", "Controller", "summarize", "FcauditError"} <= set(public)
    assert set(public) == set(fca.__all__) - {"__version__"}
    for name in fca.__all__:
        assert getattr(fca, name) is not None
