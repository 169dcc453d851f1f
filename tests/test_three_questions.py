"""The three questions in one result: an audit's variation() as a result object, its execution() where the audit
measured it (execution=True), and the table that str(result), its HTML and the report open with, checked against the
result's own numbers on models written in the test."""

import html as htmllib
import json
import math
import re

import pandas as pd
import pytest
import torch
from torch import nn

import fcaudit as fca
from fcaudit.execution.decided import observe
from fcaudit.execution.flops import flops
from fcaudit.stats.results import VariationResult


class GatedLM(nn.Module):  # the README's
    def __init__(self, d=16):
        super().__init__()
        self.embed, self.head = nn.Embedding(256, d), nn.Linear(d, 256)
        self.mlps = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.gates = nn.ModuleList(nn.Sequential(nn.Linear(d, 1), nn.Sigmoid(), nn.Flatten(-2)) for _ in range(2))

    def forward(self, ids):
        h = self.embed(ids)
        for mlp, gate in zip(self.mlps, self.gates):
            h = h + gate(h).unsqueeze(-1) * mlp(h)
        return self.head(h)


class PickTokens(nn.Module):
    """Scores every token and keeps the best `k` of the window: (straight-through scores, sorted positions)."""

    def __init__(self, width, k):
        super().__init__()
        self.proj, self.k = nn.Linear(width, 1), k

    def forward(self, x):
        logit = self.proj(x)[..., 0]
        keep = torch.sort(torch.topk(logit, self.k, dim=1).indices, dim=1).values
        return logit - logit.detach() + 1.0, keep


class SkipLayer(nn.Module):
    """Only the picked tokens go through the feed-forward (gathered out, added back), the rest skip it."""

    def __init__(self, width, k):
        super().__init__()
        self.pick = PickTokens(width, k)
        self.ff = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))

    def forward(self, x):
        weight, keep = self.pick(x)
        idx = keep[..., None].repeat(1, 1, x.size(-1))
        upd = self.ff(torch.gather(x, 1, idx)) * torch.gather(weight, 1, keep)[..., None]
        return x.scatter_add(1, idx, upd)


class SkipLM(nn.Module):
    def __init__(self, k=4, width=16):
        super().__init__()
        self.tok = nn.Embedding(256, width)
        self.layers = nn.ModuleList([SkipLayer(width, k), SkipLayer(width, k)])
        self.out = nn.Linear(width, 256)

    def forward(self, ids):
        x = self.tok(ids)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def windows():
    return fca.windows("embedded", n_eval=4, n_calib=4, window=16)


def report_head(result, out):
    """The report's first section, as text: the HTML's tags stripped."""
    page = fca.build_report([result.path], out).read_text()
    return htmllib.unescape(re.sub(r"<[^>]+>", "", page.split("<h2>")[1]))


def audited(model, ctrl, out, **settings):
    ev, ca = windows()
    return fca.audit(model.eval(), ctrl, ev, ca, randomizations=1, out=out, quiet=True, **settings)


def test_variation_is_a_result_object_of_the_shares_variation_json_holds(tmp_path):
    torch.manual_seed(0)
    model = GatedLM()
    result = audited(model, fca.Controller.from_modules(model, "gates.*", layout="batch token"), tmp_path / "a")
    var = result.variation()
    written = json.loads((tmp_path / "a" / "variation.json").read_text())
    assert isinstance(var, VariationResult) and dict(var) == written["decomposition"] and var.record == {
        k: v for k, v in written.items() if k != "_sha256"}
    assert list(var)[:3] == ["layer", "input", "token"] and math.isclose(sum(var.values()), 1.0)
    assert var.to_frame()["share"].to_dict() == dict(var)
    assert var.profile()["site"].tolist() == ["gates.0", "gates.1"]
    main = var.main()
    assert math.isclose(main["interactions"], 1 - main["layer"] - main["input"] - main["token"])
    assert repr(var).startswith("VariationResult") and "<table>" in var._repr_html_()
    assert var.plot().get_xlabel() == "share of the coefficient variance"


def test_an_audit_measures_execution_when_asked_and_the_table_says_its_numbers(tmp_path):
    torch.manual_seed(0)
    model = GatedLM()
    ctrl = fca.Controller.from_modules(model, "gates.*", layout="batch token")
    plain = audited(model, ctrl, tmp_path / "plain")
    assert plain.execution() is None and "execution=True" in plain.execution_note
    assert not (tmp_path / "plain" / "execution.json").exists()
    result = audited(model, ctrl, tmp_path / "a", execution=True)
    ex = result.execution()
    ids = windows()[0].ids[:8]
    seen = observe(model, ctrl, ids)
    assert (ex.decided, ex.executed, ex.blocks) == (seen.decided, seen.executed, seen.blocks) == (
        1.0, 1.0, ("mlps.0", "mlps.1"))
    assert ex["live"].flops_per_token == flops(model, ids) > ex["replayed"].flops_per_token  # the gates' matmuls
    assert result.execution_note == "" and "nothing was decided away" in ex.verdict
    # the records are those of the audit that measured nothing
    assert plain.records.equals(result.records)

    lines = str(result).splitlines()
    var, pen, ret = result.variation().main(), result.penalties(), result.retention()
    assert lines[0] == "three questions:"
    assert lines[1] == "  variation   " + ", ".join(f"{t} {100 * v:.1f}%" for t, v in var.items())
    static = pen["StaticProfile"].statistic
    assert lines[2].split()[:4] == ["dependence", "StaticProfile", "ΔNLL", f"{static:+.4g}"]
    assert f"Cross-input ΔNLL {pen['CrossInput'].statistic:+.4g}" in lines[2] and "retention" in lines[2]
    assert ("undefined" in lines[2]) == (not ret.defined)
    assert lines[3].split()[:5] == ["execution", "decided", "100.0%,", "executed", "100.0%"]
    assert f"x{ex.controller_flops:.3f}" in lines[3]
    assert lines[4].startswith("exact replay: passed=True")
    page = result._repr_html_()
    assert page.index("The three questions") < page.index("exact replay") and f"{static:+.4g}" in page


def test_a_rerun_reuses_the_measurement_and_a_damaged_one_is_measured_again(tmp_path):
    torch.manual_seed(0)
    model = GatedLM()
    ctrl = fca.Controller.from_modules(model, "gates.*", layout="batch token")
    audited(model, ctrl, tmp_path / "a", execution=True)
    path = tmp_path / "a" / "execution.json"
    first, stamp = path.read_text(), path.stat().st_mtime_ns
    assert audited(model, ctrl, tmp_path / "a", execution=True).execution().decided == 1.0
    assert path.stat().st_mtime_ns == stamp  # not measured again
    assert audited(model, ctrl, tmp_path / "a").execution() is not None  # kept: the same audit measured it
    damaged = first.replace('"decided": 1.0', '"decided": 0.5')
    assert damaged != first
    path.write_text(damaged)  # its hash no longer matches
    assert audited(model, ctrl, tmp_path / "a", execution=True).execution().decided == 1.0
    assert path.read_text() == first  # measured again, identically


def test_a_gathering_token_router_executes_what_it_decided_in_the_audit_and_the_report(tmp_path):
    torch.manual_seed(0)
    model = SkipLM(k=4)
    ctrl = fca.Controller.from_modules(model, "layers.*.pick", kind="token_router")
    result = audited(model, ctrl, tmp_path / "a", execution=True)
    ex = result.execution()
    assert ex.decided == pytest.approx(4 / 16) and ex.executed == pytest.approx(4 / 16)
    assert ex.executed_by_block == pytest.approx((4 / 16, 4 / 16)) and "the decided saving realized" in ex.verdict
    cells = result.questions()
    assert cells["execution"]["decided"] == "25.0%" and cells["execution"]["executed"] == "25.0% (observed)"
    assert cells["dependence"]["StaticTopK ΔNLL"].startswith(f"{result.penalties()['StaticTopK'].statistic:+.4g}")

    head = report_head(result, tmp_path / "report")  # the report opens with the table
    assert head.startswith("The three questions, per model")
    family = next(iter(fca.summarize([result])))
    assert family in head and "decided 25.0%, executed 25.0% (observed)" in head
    assert cells["variation"]["token"] in head
    numbers = pd.read_csv(tmp_path / "report" / "three_questions.csv").iloc[0]
    assert (numbers["decided"], numbers["executed"]) == (ex.decided, ex.executed)
    assert numbers["flops_per_token"] == ex["live"].flops_per_token
    md = (tmp_path / "report" / "report.md").read_text()
    assert "on the audit's first evaluation batch" in md.split("## Verdicts")[1]


def test_the_report_says_why_a_model_without_execution_has_none(tmp_path):
    torch.manual_seed(0)
    model = GatedLM()
    result = audited(model, fca.Controller.from_modules(model, "gates.*", layout="batch token"), tmp_path / "a")
    head = report_head(result, tmp_path / "report")
    assert head.startswith("The three questions, per model") and "not measured: pass execution=True" in head
    assert result.questions()["dependence"]["StaticProfile ΔNLL"] in head
    numbers = pd.read_csv(tmp_path / "report" / "three_questions.csv").iloc[0]
    assert numbers["static_delta_nll"] == result.penalties()["StaticProfile"].statistic
    assert numbers["execution_note"].startswith("not measured") and numbers["token"] == result.variation().main()[
        "token"]


def test_a_hugging_face_moe_gets_its_row_with_k_of_e_experts_decided_and_executed(tmp_path):
    pytest.importorskip("transformers")
    from fcaudit.families.hf.tiny import tiny_moe

    model = tiny_moe("mixtral", experts=4, top_k=2)
    ids = torch.randint(0, model.config.vocab_size, (10, 12), generator=torch.Generator().manual_seed(0))
    result = fca.audit(model, fca.controller_for(model), ids[:6], ids[6:], randomizations=1, out=tmp_path / "a",
                       batch_size=3, quiet=True, execution=True)
    ex = result.execution()
    assert ex.decided == 0.5 and ex.executed == pytest.approx(0.5)  # 2 of 4 experts' FLOPs, observed
    head = report_head(result, tmp_path / "report")
    assert next(iter(fca.summarize([result]))) in head and "decided 50.0%, executed 50.0% (observed)" in head


class OneGateLM(nn.Module):
    """No list of blocks: fcaudit cannot tell which modules the gate governs."""

    def __init__(self, d=16):
        super().__init__()
        self.embed, self.ff, self.head = nn.Embedding(256, d), nn.Linear(d, d), nn.Linear(d, 256)
        self.gate = nn.Sequential(nn.Linear(d, 1), nn.Sigmoid())

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(h + self.gate(h) * self.ff(h))


def test_where_fcaudit_cannot_tell_what_ran_the_audit_stands_and_says_why(tmp_path):
    torch.manual_seed(0)
    model = OneGateLM()
    result = audited(model, fca.Controller.from_modules(model, "gate", layout="batch token 1"), tmp_path / "a",
                     execution=True)
    assert result.replay.passed and result.execution() is None
    assert result.execution_note.startswith("not measured: OneGateLM has no nn.ModuleList of blocks")
    assert "blocks=" in result.execution_note
    assert str(result).splitlines()[3] == f"  execution   {result.execution_note}"
