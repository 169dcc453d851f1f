"""The report's headline (one line per question and family), the note on families missing from Figure 3, Figure 2
on an all-zero family, and the thresholding table's explanation."""

import json
import math

import pandas as pd
import pytest

from fcaudit.io import write_json
from fcaudit.report import build_report
from conftest import FG, write_audit


def with_checkpoint(audit, checkpoint):
    cfg = json.loads((audit / "config.json").read_text())
    cfg["model"]["checkpoint"] = str(checkpoint)
    write_json(audit / "config.json", cfg)
    return audit


def test_headline_answers_the_three_questions_per_family(tmp_path):
    fg = [with_checkpoint(write_audit(tmp_path / f"fg{k}", FG, seed=k), tmp_path / f"runs/fg-s{k}") for k in range(3)]
    const = write_audit(tmp_path / "const", {c: 0.0 for c in FG}, name="Constant", seed=0)
    variation = json.loads((const / "variation.json").read_text())
    variation["decomposition"] = {k: None for k in variation["decomposition"]}  # no variance at all
    write_json(const / "variation.json", variation, hashed=True)  # hashed, as the engine writes it
    rows = [{"checkpoint": str(tmp_path / "runs/dense-s0"), "model": "dense", "executed_blocks": 4, "n_blocks": 4,
             "flops_vs_dense": 1.0, "latency_vs_dense": 1.0, "latency_ms": 2.0, "latency_noisy": False},
            {"checkpoint": str(tmp_path / "runs/fg-s0"), "model": "featuregate", "executed_blocks": 4, "n_blocks": 4,
             "flops_vs_dense": 1.094, "latency_vs_dense": 1.76, "latency_ms": 3.5, "latency_noisy": True}]
    sweep = [{"model": "featuregate", "threshold": t, "plain_nll": 1.0, "nll": 1.0 + t, "byte_ppl": 2.0,
              "delta_nll": t, "frac_below": t, "skippable_blocks": 0.0, "n_layers": 4, "windows": 8, "tokens": 504}
             for t in (0.0, 0.5)]
    write_json(tmp_path / "exec" / "execution.json", {"settings": {"window": 64}, "rows": rows, "thresholding": sweep})

    out = tmp_path / "report"
    build_report([*fg, const, tmp_path / "exec"], out)
    md = (out / "report.md").read_text()
    head = md.split("## Verdicts")[1].split("\n## ")[0]
    fam = head.split("**FeatureGate tiny**")[1].split("**Constant**")[0]
    assert "**Variation**: layer identity explains 90.0%" in fam
    assert "LayerMean 0.00129" in fam and "criteria: practically small: met" in fam
    assert "**Execution**: 4/4 blocks run (no block skipped); FLOPs 1.09x, latency 1.76x Dense's" in fam
    assert "latency noisy" in fam
    const_part = head.split("**Constant**")[1]
    assert "none: the coefficients are the same" in const_part and "not measured" in const_part
    assert "Not shown: Constant (none: the coefficients are the same" in md  # why Figure 3 lacks it
    assert "threshold 0 sets no gate to 0" in md and "featuregate 2.718" in md and "8 test windows of 64" in md
    assert "| 3.5* |" in md  # the noisy latency is marked in the table
    assert (out / "fig2_penalties_constant.png").is_file()
    # the report opens with the three questions, one row per family
    table = md.split("## The three questions, per model")[1].split("\n## ")[0]
    assert md.index("## The three questions") < md.index("## Verdicts")
    const_row = next(line for line in table.splitlines() if line.startswith("| Constant"))
    assert "none (constant coefficients)" in const_row and "not measured: pass execution=True" in const_row
    numbers = pd.read_csv(out / "three_questions.csv").set_index("model")
    assert numbers.loc["FeatureGate tiny", "layer"] == pytest.approx(0.9) and math.isnan(
        numbers.loc["Constant", "interactions"])
