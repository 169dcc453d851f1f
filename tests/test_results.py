"""The result objects from the reader's side: the replay check and the pre-write checks' findings (replay.json, and
the keys audits wrote before findings), the controller's own static condition that retention and the criteria
follow, summaries read back (also with the column names written before one vocabulary), the notebook display and
the plots."""

import json

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

import fcaudit as fca  # noqa: E402
from fcaudit.kinds import TOKEN_NOTE  # noqa: E402
from fcaudit.auditor.directory import AuditDir  # noqa: E402
from fcaudit.io import write_json  # noqa: E402
from fcaudit.report import build_report  # noqa: E402
from fcaudit.summary import Summary, summarize  # noqa: E402
from conftest import FG, write_audit  # noqa: E402

EXACT = {"max_abs_dlogit": 0.0, "delta_nll": 0.0, "bit_equal": True, "passed": True, "tolerance": 0.0, "windows": 24,
         "route_flips": 0}
LATER = "routing depends on later tokens: changing only the last quarter of 8 windows changed 5 routing decisions"
# a token router's conditions (protocol.for_controller; R=1, as RandomRoute's records are written here): its static
# condition is StaticTopK, its reference RandomRoute
ROUTED = {"CrossInput": 0.02, "TokenShuffle": 0.03, "CrossShuffle": 0.035, "StaticTopK": 0.001, "RandomRoute": 0.05}
ROUTED_LABELS = {"StaticProfile": "StaticTopK", "StructureRemoved": "RandomRoute"}


def with_replay(audit, replay: dict):
    write_json(audit / "replay.json", AuditDir(audit).bound(replay), hashed=True)  # hashed and bound, as the engine writes it
    return audit


def test_findings_are_read_from_replay_json_and_from_the_keys_written_before_them(tmp_path):
    findings = [{"check": "causality", "refusal": False, "line": LATER, "data": {"later_token_flips": 5, "windows": 8}},
                {"check": "hidden state", "refusal": False, "line": "note: blocks.0 looks like a hidden state",
                 "data": {"site": "blocks.0"}}]
    new = fca.AuditResult.load(with_replay(write_audit(tmp_path / "new", ROUTED, labels=ROUTED_LABELS, name="New", R=1),
                                           {**EXACT, "findings": findings}))
    assert new.replay.passed and new.replay.route_flips == 0 and new.replay.windows == 24
    assert new.replay.later_token_flips == 5 and new.replay.finding("hidden state").data == {"site": "blocks.0"}
    assert new.notices == (LATER, "note: blocks.0 looks like a hidden state")  # the router's line is a notice too
    old = write_audit(tmp_path / "old", ROUTED, labels=ROUTED_LABELS, name="Old", R=1)
    old = fca.AuditResult.load(with_replay(old, {**EXACT, "notices": ["note: a notice"], "later_token_flips": 7,
                                                 "causality_windows": 8, "routing_note": TOKEN_NOTE}))
    assert [f.check for f in old.replay.findings] == ["", "causality", "token routing"]
    assert old.replay.later_token_flips == 7 and old.notices[0] == "note: a notice"
    assert old.notices[1].startswith("routing depends on later tokens: changing only the last quarter of 8 windows "
                                     "changed 7") and old.notices[2] == TOKEN_NOTE
    assert old.replay.to_dict()["routing_note"] == TOKEN_NOTE  # written back as it was read
    # older still: the causality check in config.json's "routing", none of it in replay.json; no flips: no notice
    older = write_audit(tmp_path / "older", ROUTED, labels=ROUTED_LABELS, name="Older", R=1)
    cfg = json.loads((older / "config.json").read_text())
    write_json(older / "config.json", {**cfg, "routing": {"later_token_flips": 0, "causality_windows": 8}})
    older = fca.AuditResult.load(with_replay(older, EXACT))
    assert older.replay.later_token_flips == 0 and older.notices == ()
    # the summary and the report say each once, the router's lines with the replay check
    s = summarize([tmp_path / "new", tmp_path / "old"])
    assert s["New"].notices == new.notices and str(s).count(LATER) == 1
    build_report([tmp_path / "new"], tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text().split("\n\n")
    replay = next(i for i, p in enumerate(md) if p.startswith("Exact replay"))
    assert "Routing depends on later tokens" in md[replay]
    assert md[replay + 1] == "note: blocks.0 looks like a hidden state"


def test_retention_and_the_criteria_follow_the_controllers_own_static_condition(tmp_path):
    routed = [write_audit(tmp_path / f"r{k}", {c: v * (0.9 + 0.1 * k) for c, v in ROUTED.items()},
                          labels=ROUTED_LABELS, name="Routed", seed=k, R=1) for k in range(3)]
    one = fca.AuditResult.load(routed[0])
    assert one.static == "StaticTopK" and one.retention().condition == "StaticTopK"  # an audit before controller.static
    assert one.retention().reference == "RandomRoute" and one.retention("StaticTopK") is one.retention()
    assert [v["quantity"] for v in one.verdicts()] == ["StaticTopK ΔNLL", "StaticTopK retention"]
    assert all(v["met"] is not None for v in one.verdicts())  # evaluable: not StaticProfile's "not evaluable"
    fam = summarize(routed)["Routed"]
    assert fam.static == "StaticTopK" and fam.retention().level == "checkpoint"
    assert [(v["label"], v["level"]) for v in fam.verdicts()] == [("StaticTopK", "checkpoint")] * 2
    assert "upper 95% bound of the StaticTopK ΔNLL < 0.002" in str(fam)
    # declared by the audit (config.json's controller.static) wins over the fallback
    gate = write_audit(tmp_path / "gate", FG, name="Gate")
    cfg = json.loads((gate / "config.json").read_text())
    write_json(gate / "config.json", {**cfg, "controller": {"static": "LayerPositionMean"}})
    declared = fca.AuditResult.load(gate)
    assert declared.static == "LayerPositionMean" and declared.retention().condition == "LayerPositionMean"
    assert declared.verdicts()[0]["rule"] == "upper 95% bound of the LayerPositionMean ΔNLL < 0.002"
    summarize([declared], tmp_path / "summary")
    back = Summary.load(tmp_path / "summary")["Gate"]  # summary.json keeps it: no guess when read back
    assert back.static == "LayerPositionMean" and back.verdicts() == summarize([declared])["Gate"].verdicts()


def test_a_summary_written_before_one_vocabulary_is_read_with_todays_names(tmp_path):
    dirs = [write_audit(tmp_path / f"fg{k}", {c: v * (0.9 + 0.1 * k) for c, v in FG.items()}, seed=k) for k in range(2)]
    s = summarize(dirs, tmp_path / "summary")
    d = json.loads((tmp_path / "summary" / "summary.json").read_text())
    old = {"mean": "statistic"}, {"mean": "statistic"}, {"retention": "statistic", "delta_nll": "delta_static",
                                                         "reference_delta_nll": "delta_reference"}
    for kind, names in zip(("conditions", "factors", "retention"), old):
        d[kind] = [{new_ if new_ not in names.values() else next(k for k, v in names.items() if v == new_): x
                    for new_, x in row.items() if (kind, new_) not in {("factors", "mc_se"), ("retention", "pvalue")}}
                   for row in d[kind]]
    assert "mean" in d["conditions"][0] and "mc_se" not in d["factors"][0]
    write_json(tmp_path / "summary" / "summary.json", d)
    back = Summary.load(tmp_path / "summary")
    pd.testing.assert_frame_equal(back.conditions, s.conditions)
    pd.testing.assert_frame_equal(back.retention, s.retention)
    assert back.factors["mc_se"].isna().all()  # not written then
    pd.testing.assert_frame_equal(back.factors.drop(columns="mc_se"), s.factors.drop(columns="mc_se"))


def test_results_show_themselves_in_a_notebook_and_plot_figure_2(tmp_path):
    audit = fca.AuditResult.load(write_audit(tmp_path / "a", FG, name="Gate"))
    pen, fx, ret = audit.penalties(), audit.factor_effects(), audit.retention()
    page = audit._repr_html_()
    assert page.count("<table") == 1 and "LayerMean" in page and "criterion &#x27;practically small&#x27;" in page
    assert "exact replay: passed=True" in page and ret.line().split(":")[0] in page
    for shown in (pen, fx, summarize([audit]), summarize([audit])["Gate"]):
        assert "<table" in shown._repr_html_()
    assert "RetentionResult(retention LayerMean vs GlobalMean" in ret._repr_html_()
    ax = pen.plot()  # the conditions on one panel, the structure-removed reference on its own
    main, ref = ax.figure.axes
    assert [t.get_text() for t in main.get_yticklabels()] == [pen.labels[i] for i in range(5)][::-1]
    assert [t.get_text() for t in ref.get_yticklabels()] == ["GlobalMean"] and ref.get_xlim() != main.get_xlim()
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2)
    assert pen.plot(a, reference_ax=b) is a and fx.plot(ax=b) is b and len(fig.axes) == 2
    assert [t.get_text() for t in b.get_yticklabels()] == ["E_interaction", "E_token", "E_input"]
    fig2, lone = plt.subplots()
    assert pen.plot(lone) is lone and len(fig2.axes) == 2  # the reference's panel appended beside it
    plt.close("all")
    assert np.isfinite(pen.statistic).all() and len(pen) == 6
