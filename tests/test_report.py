"""Checkpoint-level summaries, prespecified criteria, tables, figures and the rendered report, on synthetic
records with planted penalties (the statistics are checked against independent computations)."""

import csv
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from statsmodels.stats.multitest import multipletests

from fcaudit.errors import FcauditError
from fcaudit.io import write_json
from fcaudit.report import build_report, training_table
from fcaudit.report.tables import fca_display
from fcaudit.summary import Summary, summarize
from conftest import FG, MUDD, MUDD_LABELS, make_records, write_audit


def _seed_penalties(base: dict, k: int, n: int) -> dict:
    """Checkpoint k of n: penalties scattered around `base` with a per-checkpoint multiplier averaging exactly 1."""
    mult = np.linspace(0.8, 1.2, n)[k]
    return {c: v * mult for c, v in base.items()}


@pytest.fixture
def fg7(tmp_path):
    return [write_audit(tmp_path / f"fg{k}", _seed_penalties(FG, k, 7), seed=k) for k in range(7)]


def test_one_checkpoint_recovers_planted_values_at_window_level(tmp_path):
    audit = write_audit(tmp_path / "mudd", MUDD, name="MUDDPythia", labels=MUDD_LABELS, n_windows=30, R=5)
    g = summarize([audit])["MUDDPythia"]
    conds, rets = g.penalties().to_frame(), g.frames()["retention"].set_index("condition")
    for c, v in MUDD.items():
        assert conds.loc[c, "statistic"] == pytest.approx(v, abs=1e-12)
        assert conds.loc[c, "ci_low"] <= v <= conds.loc[c, "ci_high"]
    assert conds.loc["StaticProfile", "label"] == "StaticMixMean" and g.level == g.penalties().level == "window"
    # paper: MUDDPythia retentions 73.33% and 86.27% against SourceUniformMean
    assert rets.loc["StaticProfile", "statistic"] == pytest.approx(0.7333, abs=5e-5)
    assert g.retention("LayerPositionMean").statistic == pytest.approx(0.8627, abs=5e-5)
    assert g.penalties() is g.audits[0].penalties()  # one checkpoint: its audit's statistics, computed once
    # MC SE: sd of the randomization means / sqrt(R), computed independently from the records written
    rec = make_records(MUDD, n_windows=30, R=5)
    ci = rec[rec["condition"] == "CrossInput"].merge(rec[rec["condition"] == "Correct"][["example", "nll"]],
                                                     on="example", suffixes=("", "_c"))
    rmeans = (ci["nll"] - ci["nll_c"]).groupby(ci["randomization"]).mean()
    assert conds.loc["CrossInput", "mc_se"] == pytest.approx(rmeans.std(ddof=1) / np.sqrt(5), rel=1e-9)
    assert np.isnan(conds.loc["StaticProfile", "mc_se"])  # deterministic: no MC error
    f = g.factor_effects()
    assert f["input"].statistic == pytest.approx(0.5 * (MUDD["CrossInput"] + MUDD["CrossShuffle"]
                                                        - MUDD["TokenShuffle"]))
    assert f["interaction"].statistic == pytest.approx(MUDD["CrossShuffle"] - MUDD["CrossInput"] - MUDD["TokenShuffle"])
    assert conds["pvalue"].isna().all()  # the windows of one checkpoint are no units for a test
    assert "windows" in g.note


def test_summarize_seven_checkpoints(fg7, tmp_path):
    s = summarize(fg7, tmp_path / "summary")
    c = s.conditions.set_index("condition")
    for cond, v in FG.items():  # per-checkpoint multipliers average to 1: the planted means come back
        assert c.loc[cond, "statistic"] == pytest.approx(v, rel=1e-9)
    assert (c["pvalue"] == 2 / 128).all()  # all 7 checkpoints positive: exact two-sided sign flip
    assert (c["n_positive"] == 7).all() and (c["level"] == "checkpoint").all()
    assert c.loc["StaticProfile", "label"] == "LayerMean"
    f = s["FeatureGate tiny"].factor_effects()
    assert f["input"].statistic == pytest.approx(0.000466, abs=2e-6)
    assert f["token"].statistic == pytest.approx(0.001421, abs=1e-6)
    assert f["interaction"].statistic == pytest.approx(-0.000968, abs=1e-6)
    # checkpoint bootstrap = scipy's percentile bootstrap of the checkpoint means
    x = np.array([_seed_penalties(FG, k, 7)["TokenShuffle"] for k in range(7)])
    ref = stats.bootstrap((x,), np.mean, n_resamples=10000, method="percentile", rng=np.random.default_rng(0))
    assert (c.loc["TokenShuffle", "ci_low"], c.loc["TokenShuffle", "ci_high"]) == pytest.approx(
        tuple(ref.confidence_interval), rel=1e-9)
    expected = multipletests(s.factors["pvalue"].to_numpy(), method="holm")[1]
    np.testing.assert_allclose(s.factors["pvalue_holm"].to_numpy(), expected)
    r = s.retention.set_index("condition")
    assert r.loc["StaticProfile", "statistic"] == pytest.approx(0.9870, abs=1e-6)
    assert r.loc["StaticProfile", "ci_low"] <= 0.9870 <= r.loc["StaticProfile", "ci_high"]
    verdicts = {v["name"]: v for v in s.verdicts}
    assert verdicts["practically small"]["met"] and verdicts["high retention"]["met"]
    assert verdicts["high retention"]["fixed_in_advance"] and verdicts["high retention"]["fixed_at"].startswith("2026")
    for name in ("summary.json", "conditions.csv", "factors.csv", "retention.csv", "criteria.json"):
        assert (tmp_path / "summary" / name).is_file()
    with open(tmp_path / "summary" / "conditions.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["n_positive"] for r in rows} == {"7"} and {r["n"] for r in rows} == {"7"}  # counts: 7, not 7.0
    back = Summary.load(tmp_path / "summary")  # the same result objects, read back
    for kind in ("conditions", "factors", "retention"):
        pd.testing.assert_frame_equal(getattr(back, kind), getattr(s, kind))
    assert back.verdicts == s.verdicts and str(back) == str(s)
    fam = back["FeatureGate tiny"]
    assert fam.retention().statistic == s["FeatureGate tiny"].retention().statistic and fam.static == "StaticProfile"
    with pytest.raises(FcauditError, match="read from summary.json"):
        fam.penalties(confidence=0.9)
    assert s["FeatureGate tiny"].penalties(confidence=0.9)["CrossInput"].confidence_level == 0.9
    assert not list((tmp_path / "summary").glob(".*.tmp"))


@pytest.mark.parametrize("n", [3, 5])
def test_summarize_small_n_and_mixed_signs(tmp_path, n):
    pen = [dict(FG, CrossInput=v) for v in np.r_[[-1e-4], np.full(n - 1, 2e-3)]]
    dirs = [write_audit(tmp_path / f"a{k}", pen[k], seed=k) for k in range(n)]
    c = summarize(dirs).conditions.set_index("condition")
    assert c.loc["CrossInput", "statistic"] == pytest.approx(np.mean([p["CrossInput"] for p in pen]), rel=1e-9)
    assert c.loc["CrossInput", "n_positive"] == n - 1
    assert c.loc["CrossInput", "pvalue"] > 2 / 2**n  # one negative checkpoint: not the most extreme pattern


def test_criteria_verdicts_flip_when_thresholds_move(tmp_path):
    def verdicts(**crit):
        dirs = [write_audit(tmp_path / f"{len(crit)}{sorted(crit.items())}{k}".replace(" ", ""),
                            _seed_penalties(FG, k, 4), seed=k, criteria=crit) for k in range(4)]
        return {v["name"]: v["met"] for v in summarize(dirs).verdicts}

    assert verdicts() == {"practically small": True, "high retention": True}
    assert verdicts(small_upper=0.001) == {"practically small": False, "high retention": True}
    assert verdicts(retention_lower=0.995) == {"practically small": True, "high retention": False}


def test_families_grouped_and_single_checkpoint_falls_back(fg7, tmp_path):
    mudd = write_audit(tmp_path / "mudd", MUDD, name="MUDDPythia", labels=MUDD_LABELS)
    s = summarize([*fg7, mudd])
    assert list(s) == ["FeatureGate tiny", "MUDDPythia"] and s["FeatureGate tiny"].n_checkpoints == 7
    g = s["MUDDPythia"]
    assert g.level == "window" and "windows" in g.note
    assert (g.frames()["conditions"]["level"] == "window").all() and np.isnan(g.penalties().pvalue).all()
    assert g.retention().statistic == pytest.approx(0.7333, abs=5e-5)
    assert {v["met"] for v in g.verdicts()} == {False}  # 1.98 nats is not small; 73% retention is not high


def test_summarize_rejects_bad_input(fg7, tmp_path):
    with pytest.raises(FcauditError):
        summarize([tmp_path / "nowhere"])
    with pytest.raises(FcauditError):
        summarize([fg7[0], fg7[0]])
    odd = write_audit(tmp_path / "odd", FG, seed=9, criteria={"small_upper": 0.01})
    with pytest.raises(FcauditError, match="different criteria"):
        summarize([*fg7, odd])


def _metrics(tmp_path):
    rng = np.random.default_rng(1)
    runs = []
    for method, ppl in (("featuregate", 3.0862), ("layerstatic", 3.0842), ("dense", 3.10)):
        for seed in range(3):
            m = {"variant": method, "seed": seed, "byte_ppl": ppl + rng.normal(0, 0.006), "corpus": "embedded",
                 "preset": "tiny", "gate_mass": None if method == "dense" else 0.6 + rng.normal(0, 0.001)}
            write_json(tmp_path / "runs" / f"{method}-{seed}" / "metrics.json", m)
            runs.append(m)
    return runs


def test_training_table_matches_pandas(tmp_path):
    runs = _metrics(tmp_path)
    t = training_table(runs).set_index("method")
    df = pd.DataFrame(runs)
    for variant, name in (("featuregate", "FeatureGate"), ("layerstatic", "LayerStatic"), ("dense", "Dense")):
        sub = df[df["variant"] == variant]
        assert t.loc[name, "n"] == 3
        assert t.loc[name, "byte_ppl_mean"] == pytest.approx(sub["byte_ppl"].mean(), rel=1e-12)
        assert t.loc[name, "byte_ppl_sd"] == pytest.approx(sub["byte_ppl"].std(), rel=1e-12)
    assert np.isnan(t.loc["Dense", "gate_mass"])
    assert list(t.index) == ["LayerStatic", "FeatureGate", "Dense"]  # lowest Byte-PPL first
    with pytest.raises(FcauditError):
        training_table([*runs, runs[0]])


def test_report_renders(fg7, tmp_path):
    _metrics(tmp_path)
    mudd = write_audit(tmp_path / "mudd", MUDD, name="MUDDPythia", labels=MUDD_LABELS)
    summarize(fg7, tmp_path / "summary")
    out = tmp_path / "report"
    page = build_report([tmp_path / "summary", mudd, tmp_path / "runs"], out)
    assert page == out / "report.html"
    md, htm = (out / "report.md").read_text(), page.read_text()
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["fig2_penalties_featuregate-tiny.png", "fig2_penalties_muddpythia.png", "fig3_variance.png",
                    "fig4_retention.png", "fig5_log_penalties.png"]
    for p in out.glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({p.name})" in md
    assert htm.count("src='data:image/png;base64,") == len(pngs) and "<img src='fig" not in htm
    # every table of the Markdown has its CSV
    for table in re.findall(r"\(numbers: \[(.+?\.csv)\]", md):
        assert (out / table).is_file()
    assert {"table1.csv", "fca_featuregate-tiny.csv", "factors_featuregate-tiny.csv", "criteria_featuregate-tiny.csv",
            "fca_muddpythia.csv", "variance_decomposition.csv"} <= {p.name for p in out.glob("*.csv")}
    fca = pd.read_csv(out / "fca_featuregate-tiny.csv").set_index("condition")
    assert fca.loc["StaticProfile", "statistic"] == pytest.approx(FG["StaticProfile"], rel=1e-9)
    assert "fixed in advance" in md and "## Execution" not in md  # no execution data given: no section
    assert "LayerMean" in md and "StaticMixMean" in md and "0.001287" in md
    numbers = json.loads((out / "report.json").read_text())
    assert len(numbers["table1"]) == 3 and numbers["variance_decomposition"]["MUDDPythia"]["layer"] == 0.9


def test_report_rejects_empty_input(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FcauditError):
        build_report([tmp_path / "empty"], tmp_path / "out")


def test_fca_display_marks_missing_values():
    conds = pd.DataFrame([{"family": "m", "condition": "StaticProfile", "label": "LayerMean", "level": "window",
                           "n": 10, "statistic": 0.1, "ci_low": np.nan, "ci_high": np.nan, "pvalue": np.nan,
                           "n_positive": np.nan, "mc_se": np.nan}])
    row = fca_display(conds, conds.iloc[:0].assign(retention=[], reference_label=[])).iloc[0]
    assert row["95% interval"] == "—" and row["MC SE"] == "—" and row["Retention"] == "—"


def test_report_execution_and_non_positive_penalties(tmp_path):
    # a family whose penalties are <= 0 still renders on the log axis (marked, not dropped)
    flat = write_audit(tmp_path / "flat", {c: -1e-6 for c in FG}, name="Flat")
    write_json(tmp_path / "exec" / "execution.json", {"settings": {"batch_size": 8}, "rows": [
        {"model": "Dense", "executed_blocks": 2, "latency_ms": 1.5}, {"model": "FeatureGate", "executed_blocks": 2,
                                                                      "latency_ms": 1.9}]})
    pd.DataFrame([{"model": "Dense"}]).to_csv(tmp_path / "exec" / "execution.csv", index=False)  # same data: read once
    out = tmp_path / "report"
    build_report([flat, tmp_path / "exec"], out)
    md = (out / "report.md").read_text()
    assert md.count("## Execution") == 1 and (out / "execution.csv").is_file()
    assert pd.read_csv(out / "execution.csv")["latency_ms"].tolist() == [1.5, 1.9]
    assert (out / "fig5_log_penalties.png").is_file()
    assert "undefined" not in md or "—" in md


def test_summary_json_keeps_full_precision_absolute_audit_paths_and_no_nan(fg7, tmp_path, monkeypatch):
    """summary.json holds the CSVs' numbers to the last bit (pandas' to_json would round to 10 digits), its audits
    as absolute paths (a report run from elsewhere finds them), and null where a number is undefined."""
    monkeypatch.chdir(tmp_path)
    s = summarize([Path(p.name) for p in fg7], tmp_path / "summary")
    text = (tmp_path / "summary" / "summary.json").read_text()
    saved = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in summary.json"))
    csv = pd.read_csv(tmp_path / "summary" / "conditions.csv")
    assert ([r["statistic"] for r in saved["conditions"]] == csv["statistic"].tolist()
            == s.conditions["statistic"].tolist())
    assert saved["groups"]["FeatureGate tiny"]["audits"] == [str(p.resolve()) for p in fg7]
    assert any(r["mc_se"] is None for r in saved["conditions"])  # static conditions: no Monte Carlo error
    monkeypatch.chdir("/")  # the audits are covered by the summary however the report is run
    build_report([tmp_path / "summary", fg7[0]], tmp_path / "report")


def test_report_refuses_one_family_from_two_sources_and_writes_nothing(fg7, tmp_path):
    summarize(fg7[:3], tmp_path / "summary")
    with pytest.raises(FcauditError, match="'FeatureGate tiny' is in .*summary and in the audit directories given"):
        build_report([tmp_path / "summary", fg7[3]], tmp_path / "report")
    summarize(fg7[3:], tmp_path / "summary2")
    with pytest.raises(FcauditError, match="summarize all of its audits together"):
        build_report([tmp_path / "summary", tmp_path / "summary2"], tmp_path / "report")
    assert not (tmp_path / "report").exists()


def test_records_rewritten_without_their_hash_are_damaged(fg7, tmp_path):
    """A records file edited with pandas (its bytes no longer those its sidecar sha256 records) is not trusted."""
    f = fg7[0] / "records" / "StaticProfile" / "r0000.parquet"
    frame = pd.read_parquet(f)
    frame.loc[0, "nll"] = 10.0
    frame.to_parquet(f, index=False)
    with pytest.raises(FcauditError, match="r0000.parquet is damaged .*sha256 does not match"):
        summarize(fg7, tmp_path / "summary")


def test_write_json_writes_null_for_non_finite_numbers(tmp_path):
    from fcaudit.io import read_json

    write_json(tmp_path / "x.json", {"a": float("nan"), "b": [np.float64("inf"), np.float32(1.5)], "c": np.int64(3)})
    text = (tmp_path / "x.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert read_json(tmp_path / "x.json") == {"a": None, "b": [None, 1.5], "c": 3}


def test_a_report_rewritten_into_its_directory_leaves_none_of_the_earlier_reports_files(fg7, tmp_path):
    mudd = write_audit(tmp_path / "mudd", MUDD, name="MUDDPythia", labels=MUDD_LABELS)
    out = tmp_path / "report"
    build_report([*fg7, mudd], out)
    assert (out / "fca_muddpythia.csv").is_file() and (out / "fig2_penalties_muddpythia.png").is_file()
    (out / "notes.txt").write_text("the user's own file")
    build_report(fg7, out)
    names = {p.name for p in out.iterdir()}
    assert "fca_muddpythia.csv" not in names and "fig2_penalties_muddpythia.png" not in names
    assert {"fca_featuregate-tiny.csv", "notes.txt", "report.html"} <= names
    markers = {".fcaudit-report", "summary/.fcaudit-summary"}  # fcaudit.io's, which record what each wrote
    assert set(json.loads((out / "report.json").read_text())["files"]) | {"report.json", "notes.txt", "summary"} \
        == (names | {f"summary/{f.name}" for f in (out / "summary").iterdir()}) - markers


def test_a_family_of_few_checkpoints_says_how_coarse_its_intervals_are(fg7, tmp_path):
    few, many = summarize(fg7[:2]), summarize(fg7[2:])
    assert "With 2 checkpoints the intervals are coarse" in few["FeatureGate tiny"].note
    assert "below 0.5" in few["FeatureGate tiny"].note
    assert "coarse" not in many["FeatureGate tiny"].note


def test_retention_is_undefined_on_a_negligible_reference_gap_everywhere_it_appears(tmp_path, monkeypatch):
    """A reference gap above 0 but below the practically-small bound (0.0015 nats in one checkpoint; 2.2e-6 nats
    in two) gives no retention, with its reason, in the API, the summary, the tables, Figure 4, the terminal and
    the report; a large gap (MUDD's 7.42 nats) gives one."""
    from fcaudit.auditor.results import AuditResult
    from fcaudit.report import figures

    small = write_audit(tmp_path / "small", dict(FG, StructureRemoved=0.0015, StaticProfile=0.0003), name="Small")
    tiny = [write_audit(tmp_path / f"tiny{k}", {c: v * 1e-3 * (0.9 + 0.2 * k) for c, v in
                                                dict(FG, StructureRemoved=0.0022).items()}, name="Tiny", seed=k,
                        noise=1e-9) for k in range(2)]
    mudd = write_audit(tmp_path / "mudd", MUDD, name="MUDDPythia", labels=MUDD_LABELS)

    res = AuditResult.load(small)
    pen = res.penalties()
    assert 0 < pen["GlobalMean"].confidence_interval.low < pen["GlobalMean"].confidence_interval.high < 0.002
    ret = res.retention("LayerMean")
    assert not ret.defined and np.isnan(ret.statistic) and ret.delta_reference == pytest.approx(0.0015)
    assert "not above the practically-small bound 0.002" in ret.reason and ret.reason in repr(ret)
    assert "retention LayerMean vs GlobalMean: undefined (the reference ΔNLL 0.0015" in res.retention_lines()[1]
    assert AuditResult.load(mudd).retention().statistic == pytest.approx(0.7333, abs=5e-5)

    s = summarize([small, *tiny, mudd])
    r = s.retention.set_index(["family", "condition"])
    for fam in ("Small", "Tiny"):
        assert np.isnan(r.loc[(fam, "StaticProfile"), "statistic"]) and r.loc[(fam, "StaticProfile"), "bound"] == 0.002
        assert "not above the practically-small bound" in r.loc[(fam, "StaticProfile"), "note"]
    assert r.loc[("Tiny", "StaticProfile"), "level"] == "checkpoint"
    assert s.conditions.set_index(["family", "condition"]).loc[("Tiny", "StructureRemoved"), "ci_low"] > 0
    assert r.loc[("MUDDPythia", "StaticProfile"), "statistic"] == pytest.approx(0.7333, abs=5e-5)
    high = {v["family"]: v["met"] for v in s.verdicts if v["name"] == "high retention"}
    assert high == {"Small": None, "Tiny": None, "MUDDPythia": False}  # not evaluable, not met
    assert "retention LayerMean vs GlobalMean: undefined (the reference ΔNLL" in str(s)

    small_frames = s["Small"].frames()
    cell = fca_display(small_frames["conditions"], small_frames["retention"]).set_index("Condition")
    assert cell.loc["LayerMean", "Retention"] == "undefined (ΔNLL(R) interval not above 0.002)"

    import matplotlib.figure

    texts, savefig = [], matplotlib.figure.Figure.savefig

    def saved(fig, *args, **kwargs):  # the texts of the figure as it is written
        texts.extend(t.get_text() for a in fig.axes for t in a.texts)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", saved)
    figures.retention_figure(s.retention, tmp_path / "fig4.png")
    assert (tmp_path / "fig4.png").is_file()
    assert sum("undefined (ΔNLL(R) interval not above 0.002)" in t for t in texts) == 4  # two per family
    assert any(t.startswith("73.33% [") for t in texts)
    monkeypatch.undo()

    build_report([small, *tiny, mudd], tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    assert md.count("undefined (ΔNLL(R) interval not above 0.002)") == 4  # the FCA tables of Small and Tiny
    head = md.split("## Verdicts")[1].split("\n## ")[0]
    assert head.count("retention undefined (the reference ΔNLL") == 2 and "retention 73.3%" in head


def test_result_objects_print_without_the_audit_directory(fg7, tmp_path):
    """The result objects carry their numbers: their repr reads nothing from disk (the audit may be gone)."""
    import shutil

    from fcaudit.auditor.results import AuditResult

    res, fresh = AuditResult.load(fg7[0]), AuditResult.load(fg7[1])
    pen, fe, ret = res.penalties(), res.factor_effects(), res.retention()
    for d in fg7[:2]:
        shutil.rmtree(d)
    assert "LayerMean" in repr(pen) and "E_input" in repr(fe) and "retention LayerMean vs GlobalMean: " in repr(ret)
    assert "24 windows" in repr(fresh)  # its records were never read, and cannot be now
    assert pen.to_frame().loc["StaticProfile", "statistic"] == pytest.approx(FG["StaticProfile"] * 0.8)
    assert ret.to_frame()["statistic"].iloc[0] == pytest.approx(0.9870, abs=1e-6)
