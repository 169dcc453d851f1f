"""The result objects from the reader's side: the replay check and the pre-write checks' findings (replay.json; an
earlier fcaudit's is refused), the controller's own static condition that retention and the criteria follow, summaries
read back (an earlier fcaudit's refused, and recreated as the refusal says), the notebook display and the plots."""

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
from harness import api_refusal  # noqa: E402

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


def test_findings_are_read_from_replay_json_and_an_earlier_replay_json_is_refused(tmp_path):
    findings = [{"check": "causality", "refusal": False, "line": LATER, "data": {"later_token_flips": 5, "windows": 8}},
                {"check": "hidden state", "refusal": False, "line": "note: blocks.0 looks like a hidden state",
                 "data": {"site": "blocks.0"}}]
    new = fca.AuditResult.load(with_replay(write_audit(tmp_path / "new", ROUTED, labels=ROUTED_LABELS, name="New", R=1),
                                           {**EXACT, "findings": findings}))
    assert new.replay.passed and new.replay.route_flips == 0 and new.replay.windows == 24
    assert new.replay.later_token_flips == 5 and new.replay.finding("hidden state").data == {"site": "blocks.0"}
    assert new.notices == (LATER, "note: blocks.0 looks like a hidden state")  # the router's line is a notice too
    # replay.json of an earlier fcaudit, without findings (its notices under other keys): refused, never guessed at
    old = write_audit(tmp_path / "old", ROUTED, labels=ROUTED_LABELS, name="Old", R=1)
    with_replay(old, {**EXACT, "notices": ["note: a notice"], "later_token_flips": 7, "causality_windows": 8,
                      "routing_note": TOKEN_NOTE})
    line = api_refusal(lambda: fca.AuditResult.load(old))
    assert "replay.json is damaged (it lacks the pre-write checks' findings (an earlier fcaudit's)); rerun the audit " \
           "command on" in line
    # as this fcaudit writes it: a causality check that found no flip has nothing to say
    quiet = {"check": "causality", "refusal": False, "line": "", "data": {"later_token_flips": 0, "windows": 8}}
    old = fca.AuditResult.load(with_replay(old, {**EXACT, "findings": [quiet]}))
    assert old.replay.later_token_flips == 0 and old.notices == ()
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
    assert one.static == "StaticTopK" and one.retention().condition == "StaticTopK"  # config.json's controller.static
    assert one.retention().reference == "RandomRoute" and one.retention("StaticTopK") is one.retention()
    assert [v["quantity"] for v in one.verdicts()] == ["StaticTopK ΔNLL", "StaticTopK retention"]
    assert all(v["met"] is not None for v in one.verdicts())  # evaluable: not StaticProfile's "not evaluable"
    fam = summarize(routed)["Routed"]
    assert fam.static == "StaticTopK" and fam.retention().level == "checkpoint"
    assert [(v["label"], v["level"]) for v in fam.verdicts()] == [("StaticTopK", "checkpoint")] * 2
    assert "upper 95% bound of the StaticTopK ΔNLL < 0.002" in str(fam)
    # whatever the audit declares (config.json's controller.static)
    gate = write_audit(tmp_path / "gate", FG, name="Gate")
    cfg = json.loads((gate / "config.json").read_text())
    write_json(gate / "config.json", {**cfg, "controller": {"static": "LayerPositionMean"}})
    declared = fca.AuditResult.load(gate)
    assert declared.static == "LayerPositionMean" and declared.retention().condition == "LayerPositionMean"
    assert declared.verdicts()[0]["rule"] == "upper 95% bound of the LayerPositionMean ΔNLL < 0.002"
    summarize([declared], tmp_path / "summary")
    back = Summary.load(tmp_path / "summary")["Gate"]  # summary.json keeps it: no guess when read back
    assert back.static == "LayerPositionMean" and back.verdicts() == summarize([declared])["Gate"].verdicts()


def test_a_summary_of_an_earlier_fcaudit_is_refused_in_one_line_and_recreated_as_it_says(tmp_path):
    dirs = [write_audit(tmp_path / f"fg{k}", {c: v * (0.9 + 0.1 * k) for c, v in FG.items()}, seed=k) for k in range(2)]
    s = summarize(dirs, tmp_path / "summary")
    d = json.loads((tmp_path / "summary" / "summary.json").read_text())
    # the columns an earlier fcaudit wrote ("mean", not "statistic"), and no static condition in its groups
    d["conditions"] = [{("mean" if k == "statistic" else k): v for k, v in row.items()} for row in d["conditions"]]
    write_json(tmp_path / "summary" / "summary.json", d)
    assert "summary.json is not a summary written by fcaudit (or by another version of it: KeyError); recreate it " \
           "with" in api_refusal(lambda: Summary.load(tmp_path / "summary"))
    d = json.loads((tmp_path / "summary" / "summary.json").read_text())
    write_json(tmp_path / "summary" / "summary.json", {**d, "conditions": s.conditions.to_dict(orient="records"),
                                                       "groups": {k: {kk: vv for kk, vv in g.items() if kk != "static"}
                                                                  for k, g in d["groups"].items()}})
    assert "recreate it with" in api_refusal(lambda: Summary.load(tmp_path / "summary"))
    summarize(dirs, tmp_path / "summary")  # what the line says, into the same directory
    back = Summary.load(tmp_path / "summary")
    pd.testing.assert_frame_equal(back.conditions, s.conditions)
    pd.testing.assert_frame_equal(back.factors, s.factors)
    pd.testing.assert_frame_equal(back.retention, s.retention)


def test_results_show_themselves_in_a_notebook_and_plot_figure_2(tmp_path):
    audit = fca.AuditResult.load(write_audit(tmp_path / "a", FG, name="Gate"))
    pen, fx, ret = audit.penalties(), audit.factor_effects(), audit.retention()
    page = audit._repr_html_()
    assert page.count("<table") == 2 and page.index("The three questions") < page.index("PenaltiesResult")
    assert "LayerMean" in page and "criterion &#x27;practically small&#x27;" in page
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
