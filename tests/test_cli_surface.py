"""The command's surface: help at 80 columns, --threads on every command, defaults that fit the model, and what
`fcaudit execution` prints."""

from __future__ import annotations

import json
import re

import pytest
import torch
import typer
from typer.testing import CliRunner

from fcaudit.cli import app
from fcaudit.models.checkpoint import save_checkpoint
from fcaudit.models.featuregate import FeatureGateGPT, config_for
from fcaudit.threads import oversubscription_hint, using_threads

runner = CliRunner()
COMMANDS = ("train", "audit", "summarize", "execution", "report", "demo")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    for variant in ("dense", "featuregate"):
        torch.manual_seed(0)
        out[variant] = save_checkpoint(root / variant, FeatureGateGPT(config_for("tiny", variant)), {"variant": variant})
    return out


# ---- help ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cmd", ("",) + COMMANDS)
def test_help_fits_80_columns_without_type_tags(cmd):
    result = runner.invoke(app, [cmd, "--help"] if cmd else ["--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80, result.output
    assert "<bool>" not in result.output and "…" not in result.output, result.output  # no type tags, nothing cut
    if not cmd:  # command summaries are whole sentences, not cut with "..."
        assert "..." not in result.output.split("Commands:")[1], result.output


def test_every_option_of_every_command_has_help_text():
    group = typer.main.get_command(app)
    assert set(group.commands) == set(COMMANDS)
    for name, cmd in group.commands.items():
        assert cmd.help, name
        for param in cmd.params:
            assert getattr(param, "help", None), f"{name} {param.name} has no help text"
        assert any(p.name == "threads" for p in cmd.params), f"{name} has no --threads"


def test_train_help_lists_every_model_unabridged():
    text = " ".join(runner.invoke(app, ["train", "--help"], terminal_width=80).output.split())
    for model in ("featuregate", "dense", "uniform", "layerstatic", "uniform-fixed", "uniform-matched", "fixeddepth",
                  "mudd"):
        assert re.search(rf"\b{re.escape(model)}\b", text), model


# ---- threads ------------------------------------------------------------------------------------------------------

def test_oversubscription_hint():
    assert "--threads 1" in oversubscription_hint(2, 1.9, 2)  # the machine: 2 cores, another job running
    assert oversubscription_hint(1, 5.0, 2) is None  # one thread cannot oversubscribe
    assert oversubscription_hint(2, 0.1, 2) is None  # an idle machine
    assert "--threads 8" in oversubscription_hint(16, 8.0, 16)


def test_using_threads_sets_and_restores_and_hints_only_on_a_busy_machine(monkeypatch):
    from fcaudit import threads

    before = torch.get_num_threads()
    with using_threads(2) as n:
        assert n == torch.get_num_threads() == 2
    assert torch.get_num_threads() == before
    torch.set_num_threads(4)  # torch's default on a 4-core machine
    try:
        for load, hinted in ((0.2, False), (3.5, True)):
            monkeypatch.setattr(threads, "machine_load", lambda load=load: (load, 4))
            lines = []
            with using_threads(None, hint=lines.append) as n:
                assert n == 4
            assert bool(lines) == hinted and all("--threads" in line for line in lines), (load, lines)
        lines = []
        with using_threads(2, hint=lines.append):  # an explicit --threads is the user's choice: no hint
            pass
        assert lines == []
    finally:
        torch.set_num_threads(before)


def test_threads_option_applies_to_the_command_and_is_restored(tmp_path, monkeypatch):
    import fcaudit.train as train_mod

    seen = {}

    def fake_train(cfg):
        seen["threads"] = torch.get_num_threads()
        return train_mod.TrainResult(tmp_path, 2.0, 0.5, 1)

    monkeypatch.setattr(train_mod, "train", fake_train)
    before = torch.get_num_threads()
    result = runner.invoke(app, ["train", "--preset", "tiny", "--threads", "2", "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert seen["threads"] == 2 and torch.get_num_threads() == before


# ---- defaults and output ------------------------------------------------------------------------------------------

def test_audit_window_defaults_to_the_models_context(tmp_path, ckpts):
    """The issue: `fcaudit audit runs/fg-s0 --out x` failed for the tiny and demo presets (window 512 > 64)."""
    result = runner.invoke(app, ["audit", str(ckpts["featuregate"]), "--eval", "4", "--calib", "4",
                                 "--randomizations", "1", "--batch-size", "4", "--quiet", "--out", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["windows"]["window"] == config_for("tiny", "featuregate").block_size


def test_execution_prints_a_readable_table(tmp_path, ckpts):
    result = runner.invoke(app, ["execution", str(ckpts["dense"]), str(ckpts["featuregate"]), "--threshold", "0.5",
                                 "--threshold-windows", "2", "--min-run-time", "0.05", "--threads", "1",
                                 "--out", str(tmp_path / "e")], terminal_width=100)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "Execution (question 3)" in out and "ms/batch" in out and "IQR" in out and "Gate thresholding" in out
    assert "featuregate" in out and "1.00x" in out  # Dense against itself
    assert "Decided versus executed" in out and "nothing was decided away" in out  # FeatureGate's soft gates
    assert not re.search(r"\w+\.py:\d+", out), out  # no logger locations
    assert "execution.csv" in out
