"""fcaudit.stats against independent computations on the same data (scipy, statsmodels, hand formulas) and the
paper's published numbers."""

import json
import math
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats
from statsmodels.stats.multitest import multipletests

from fcaudit.errors import FcauditError
from fcaudit.protocol import Criteria
from fcaudit.stats.effects import delta_nll, factor_effects, factorial_cells, mean_deltas, retention
from fcaudit.stats.inference import (checkpoint_bootstrap, holm, mc_se, paired_bootstrap, retention_bootstrap,
                                     sign_flip_test)
from fcaudit.stats.levels import CheckpointStatistics, WindowStatistics
from fcaudit.stats.variance import variance_decomposition, variation


def mean_stat(x, axis=-1):
    return np.mean(x, axis=axis)


# ---------------------------------------------------------------- records and effects


def make_records(n_examples=5, R=3, seed=0):
    """Synthetic audit records with known structure; example ids deliberately not 0..n-1."""
    rng = np.random.default_rng(seed)
    examples = np.arange(n_examples) * 7 + 3
    base = rng.uniform(1.0, 2.0, n_examples)
    rows = [(e, "Correct", 0, b) for e, b in zip(examples, base)]
    shift = {"CrossInput": 0.10, "TokenShuffle": 0.20, "CrossShuffle": 0.25}
    for cond, s in shift.items():
        for e, b in zip(examples, base):
            for r in range(R):
                rows.append((e, cond, r, b + s + 0.01 * rng.normal()))
    for cond, s in {"LayerPositionMean": 0.05, "StaticProfile": 0.08, "StructureRemoved": 1.0}.items():
        for e, b in zip(examples, base):
            rows.append((e, cond, 0, b + s + 0.01 * rng.normal()))
    df = pd.DataFrame(rows, columns=["example", "condition", "randomization", "nll"])
    df["tokens"], df["active"] = 63, 1.0
    return df.sample(frac=1.0, random_state=1).reset_index(drop=True)  # order must not matter


def test_delta_nll_pairs_each_row_with_its_examples_correct_row():
    rec = pd.DataFrame(
        {
            "example": [10, 10, 10, 20, 20, 20],
            "condition": ["Correct", "CrossInput", "CrossInput", "CrossInput", "Correct", "StaticProfile"],
            "randomization": [0, 0, 1, 0, 0, 0],
            "nll": [1.0, 1.5, 1.25, 3.5, 3.0, 2.75],
            "tokens": [7] * 6,
        }
    )
    d = delta_nll(rec)
    assert "Correct" not in set(d["condition"])
    got = {(e, c, r): v for e, c, r, v in d[["example", "condition", "randomization", "delta"]].itertuples(index=False)}
    assert got == {(10, "CrossInput", 0): 0.5, (10, "CrossInput", 1): 0.25, (20, "CrossInput", 0): 0.5,
                   (20, "StaticProfile", 0): -0.25}
    assert list(d.columns[:5]) == ["example", "condition", "randomization", "nll", "tokens"]


def test_delta_nll_rejects_bad_records():
    rec = make_records()
    with pytest.raises(FcauditError):
        delta_nll(rec[~((rec["condition"] == "Correct") & (rec["example"] == 3))])  # an example without Correct
    with pytest.raises(FcauditError):
        delta_nll(pd.concat([rec, rec.iloc[:1]]))  # duplicate row
    with pytest.raises(FcauditError):
        delta_nll(rec.drop(columns=["nll"]))


def condition_means(records: pd.DataFrame) -> pd.Series:
    """Mean ΔNLL per condition, as the penalties report it."""
    pen = WindowStatistics(records, n_resamples=100).penalties()
    return pd.Series(pen.statistic, index=pen.names)


def test_penalties_are_the_mean_over_examples_of_the_mean_over_randomizations():
    rec = make_records()
    # drop one randomization of one example: unbalanced, so the definition matters
    rec = rec[~((rec["condition"] == "TokenShuffle") & (rec["example"] == 3) & (rec["randomization"] == 2))]
    means = condition_means(rec)
    correct = rec[rec["condition"] == "Correct"].set_index("example")["nll"]
    for cond in ["CrossInput", "TokenShuffle", "StaticProfile"]:
        sub = rec[rec["condition"] == cond]
        per_ex = [np.mean(g["nll"].to_numpy() - correct[e]) for e, g in sub.groupby("example")]
        assert means[cond] == pytest.approx(np.mean(per_ex), abs=1e-14)
    assert "Correct" not in means.index
    wide = mean_deltas(rec, "example")
    assert wide.shape == (5, 6)
    rm = mean_deltas(rec, "randomization")
    assert rm.loc[0, "StaticProfile"] == pytest.approx(means["StaticProfile"])
    assert rm["CrossInput"].isna().sum() == 0 and len(rm) == 3


def test_factorial_cells_are_paired_by_example_and_randomization():
    rec = make_records(n_examples=4, R=3)
    dc, cs, ds = factorial_cells(rec)
    d = delta_nll(rec).set_index(["condition", "example", "randomization"])["delta"]
    i, r = 2, 1
    e = sorted(rec["example"].unique())[i]  # rows in example order
    assert dc[i, r] == d[("CrossInput", e, r)]
    assert cs[i, r] == d[("TokenShuffle", e, r)]
    assert ds[i, r] == d[("CrossShuffle", e, r)]
    assert dc.shape == cs.shape == ds.shape == (4, 3)
    # by linearity, the mean of the per-pair effects equals the effects of the condition means
    m = condition_means(rec)
    whole = factor_effects(0.0, m["CrossInput"], m["TokenShuffle"], m["CrossShuffle"])
    per_pair = factor_effects(0.0, dc, cs, ds)
    assert per_pair.input.shape == (4, 3)
    for k in ("input", "token", "interaction"):
        assert getattr(per_pair, k).mean() == pytest.approx(getattr(whole, k))
    with pytest.raises(FcauditError):  # incomplete design
        factorial_cells(rec[~((rec["condition"] == "CrossShuffle") & (rec["randomization"] == 2))])


def test_factor_effects_reproduce_the_paper_featuregate_76m():
    e = factor_effects(0.0, 0.000951, 0.001905, 0.001888)
    # The paper prints E_input = 0.000466 from unrounded means; from the rounded 6-decimal means the exact
    # arithmetic is 0.5 * (0.000951 - 0.000017) = 0.000467. Rounding each of 4 inputs by <= 5e-7 moves E by <= 1e-6.
    assert e.input == pytest.approx(0.000467, abs=1e-12)
    assert e.input == pytest.approx(0.000466, abs=1e-6)
    assert e.token == pytest.approx(0.001421, abs=1e-12)
    assert e.interaction == pytest.approx(-0.000968, abs=1e-12)
    assert isinstance(e.input, float)


def test_factor_effects_elementwise_on_arrays():
    cc, dc, cs, ds = (np.array(v) for v in ([0.0, 1.0], [2.0, 3.0], [5.0, 4.0], [6.0, 9.0]))
    e = factor_effects(cc, dc, cs, ds)
    np.testing.assert_allclose(e.input, [0.5 * (2 + 1), 0.5 * (2 + 5)])
    np.testing.assert_allclose(e.token, [0.5 * (5 + 4), 0.5 * (3 + 6)])
    np.testing.assert_allclose(e.interaction, [6 - 2 - 5 + 0, 9 - 3 - 4 + 1])


def test_retention_reproduces_the_paper_muddpythia():
    assert round(100 * retention(1.9798, 7.4237), 2) == 73.33
    assert round(100 * retention(1.0190, 7.4237), 2) == 86.27
    np.testing.assert_allclose(retention(np.array([1.9798, 1.0190]), 7.4237), [1 - 1.9798 / 7.4237, 1 - 1.0190 / 7.4237])


def test_retention_nonpositive_reference_is_nan_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no raw RuntimeWarning may reach a user's terminal
        assert math.isnan(retention(0.1, 0.0))
        out = retention(np.array([0.1, 0.1]), np.array([-0.2, 0.4]))
    assert math.isnan(out[0]) and out[1] == pytest.approx(0.75)


def test_retention_is_undefined_unless_the_reference_interval_lies_above_the_practically_small_bound():
    rng = np.random.default_rng(4)
    s = rng.normal(1e-8, 1e-8, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        noise = rng.normal(0, 1e-7, 64)
        zero_gap = retention_bootstrap(s, noise - noise.mean() + 6e-9, unit="window", n_resamples=2000)
        # a real but negligible gap: the interval lies above 0 but not above the default bound 0.002
        small = rng.normal(0.0015, 0.0002, 64)
        negligible = retention_bootstrap(small * 0.2, small, unit="window", n_resamples=2000)
        clear = retention_bootstrap(s, rng.normal(0.5, 0.1, 64), unit="window", n_resamples=2000)
    assert math.isnan(zero_gap.statistic) and not zero_gap.has_interval
    assert "not above the practically-small bound 0.002" in zero_gap.method
    ref = paired_bootstrap(small, n_resamples=2000)  # the same interval the reference's penalty has
    assert 0 < ref.confidence_interval.low < ref.confidence_interval.high < 0.002
    assert math.isnan(negligible.statistic) and f"[{ref.confidence_interval.low:.3g}, " in negligible.method
    # the bound is the audit's: with a lower one the same gap has a retention
    lowered = retention_bootstrap(small * 0.2, small, Criteria(small_upper=0.001), n_resamples=2000, unit="window")
    assert lowered.statistic == pytest.approx(0.8) and lowered.has_interval
    assert clear.has_interval and clear.confidence_interval.low <= clear.statistic <= clear.confidence_interval.high
    assert 0.99 < clear.statistic <= 1.0


def test_window_statistics_match_scipy_and_hand_formulas():
    """The one window-level path (AuditResult and summarize both read it) against scipy's bootstrap on the same
    per-window values, and the MC SE and factor effects by hand."""
    rec = make_records(n_examples=30, R=4)
    ws = WindowStatistics(rec, n_resamples=2000)
    correct = rec[rec["condition"] == "Correct"].set_index("example")["nll"]
    d = rec[rec["condition"] != "Correct"].assign(delta=lambda f: f["nll"] - correct.loc[f["example"]].to_numpy())
    per_window = d.groupby(["example", "condition"])["delta"].mean().unstack()

    def scipy_ci(*data, stat=mean_stat):
        ci = stats.bootstrap(data, stat, n_resamples=2000, vectorized=True, paired=len(data) > 1,
                             method="percentile", rng=np.random.default_rng(0)).confidence_interval
        return ci.low, ci.high

    pen = ws.penalties()
    assert list(pen) == list(pen.names) == ["CrossInput", "TokenShuffle", "CrossShuffle", "LayerPositionMean",
                                            "StaticProfile", "StructureRemoved"]
    for i, c in enumerate(pen.names):
        assert pen.statistic[i] == pytest.approx(per_window[c].mean(), abs=1e-14)
        assert (pen.confidence_interval.low[i], pen.confidence_interval.high[i]) == pytest.approx(
            scipy_ci(per_window[c].to_numpy()), rel=1e-12)
    rmeans = d[d["condition"] == "TokenShuffle"].groupby("randomization")["delta"].mean()
    assert pen["Token-shuffle"].statistic == pen["TokenShuffle"].statistic  # by label or by name
    assert pen.mc_se[1] == pytest.approx(rmeans.std(ddof=1) / 2, rel=1e-12) and np.isnan(pen.mc_se[4])
    assert np.isnan(pen.pvalue).all() and (pen.n == 30).all() and pen.confidence_level == 0.95
    frame = pen.to_frame()
    assert frame.index.name == "condition" and frame.index.tolist() == list(pen.names)
    assert list(frame.columns) == ["label", "statistic", "ci_low", "ci_high", "pvalue", "n", "mc_se", "n_positive",
                                   "active"]
    assert frame["pvalue"].isna().all() and frame["n_positive"].isna().all()  # windows are no units for a test

    fe = ws.factor_effects()
    dc, cs, ds = (per_window[c] for c in ("CrossInput", "TokenShuffle", "CrossShuffle"))
    hand = {"input": 0.5 * (dc + ds - cs), "token": 0.5 * (cs + ds - dc), "interaction": ds - dc - cs}
    for i, k in enumerate(fe.names):
        assert fe.statistic[i] == pytest.approx(hand[k].mean(), abs=1e-14)
        assert (fe.confidence_interval.low[i], fe.confidence_interval.high[i]) == pytest.approx(
            scipy_ci(hand[k].to_numpy()), rel=1e-9)
    assert list(fe.to_frame().index) == ["input", "token", "interaction"] and fe["E_token"] is fe["token"]
    assert list(fe.to_frame().columns[:7]) == ["label", "statistic", "ci_low", "ci_high", "pvalue", "n", "mc_se"]
    pairs = {k: v.mean(axis=0) for k, v in ws.factor_pairs.items()}  # per randomization: the MC SE's input
    assert fe.mc_se[0] == pytest.approx(np.std(pairs["input"], ddof=1) / 2, rel=1e-12)

    ret = ws.retention("StaticProfile")
    s, r = per_window["StaticProfile"].to_numpy(), per_window["StructureRemoved"].to_numpy()
    assert ret.defined and ret.statistic == pytest.approx(1 - s.mean() / r.mean(), rel=1e-12)
    assert tuple(ret.confidence_interval) == pytest.approx(
        scipy_ci(s, r, stat=lambda a, b, axis=-1: 1 - a.mean(axis=axis) / b.mean(axis=axis)), rel=1e-12)
    assert math.isnan(ret.pvalue) and ret.reason == "" and ret.bound == 0.002
    assert [x.condition for x in ws.retentions()] == ["LayerPositionMean", "StaticProfile"]
    with pytest.raises(FcauditError, match="retention is defined for the static conditions"):
        ws.retention("CrossInput")
    assert "Token-shuffle" in repr(pen) and "E_interaction" in repr(fe) and "StaticProfile vs StructureRemoved" in repr(ret)


def test_results_are_mappings_from_name_to_estimate_with_one_vocabulary():
    ws = WindowStatistics(make_records(n_examples=6, R=2), labels={"StaticProfile": "LayerMean"}, n_resamples=200)
    pen, fx, ret = ws.penalties(), ws.factor_effects(), ws.retention("LayerMean")
    assert "StaticProfile" in pen and "LayerMean" in pen and "Nowhere" not in pen and len(pen) == 6
    assert list(pen) == list(pen.names) and dict(pen)["StaticProfile"] is pen["LayerMean"]
    assert dict(fx).keys() == {"input", "token", "interaction"} and len(fx) == 3
    with pytest.raises(KeyError, match="'Nowhere' is not one of"):
        pen["Nowhere"]
    # identity, not value: no elementwise comparison of arrays, nothing raises
    assert pen == pen and pen != fx and ret == ret and len({pen, fx, ret}) == 3
    assert ws.penalties() is pen and ws.retention("StaticProfile") is ret  # computed once
    vocabulary = ["label", "statistic", "ci_low", "ci_high", "pvalue", "n"]
    for frame in (pen.to_frame(), fx.to_frame(), ret.to_frame()):
        assert list(frame.columns[:6]) == vocabulary and frame["pvalue"].isna().all()
    assert ret.to_frame().index.tolist() == ["StaticProfile"]
    assert ret.to_frame()["reference"].iloc[0] == "StructureRemoved"
    back = type(pen).from_frame(pen.to_frame(), pen.level, pen.confidence_level)  # a summary's JSON read back
    pd.testing.assert_frame_equal(back.to_frame(), pen.to_frame())
    assert "LayerMean" in repr(pen) and "p" not in repr(pen).splitlines()[1].split()  # no test, no p column


def test_checkpoint_statistics_match_scipy_statsmodels_and_hand_formulas():
    """Seven checkpoints (window-level members): each checkpoint's mean ΔNLL is one unit of a percentile bootstrap
    (scipy), an exact sign-flip test (scipy's permutation test) and, for the factor effects, Holm (statsmodels)."""
    members = tuple(WindowStatistics(make_records(n_examples=5, R=3, seed=k), n_resamples=100) for k in range(7))
    cs = CheckpointStatistics(members, Criteria(), n_resamples=3000)
    means = pd.DataFrame([m.per_window.mean() for m in members])
    pen = cs.penalties()
    assert pen.level == "checkpoint" and (pen.n == 7).all() and (pen.n_positive == 7).all()
    x = means["TokenShuffle"].to_numpy()
    ref = stats.bootstrap((x,), mean_stat, n_resamples=3000, vectorized=True, method="percentile",
                          rng=np.random.default_rng(0)).confidence_interval
    assert tuple(pen["TokenShuffle"].confidence_interval) == pytest.approx((ref.low, ref.high), rel=1e-12)
    assert pen["TokenShuffle"].pvalue == pytest.approx(_scipy_sign_flip(x, 10**6)) == 2 / 128
    assert pen.mc_se[1] == pytest.approx(np.mean([mc_se(m.randomization_means["TokenShuffle"]) for m in members]))
    fx = cs.factor_effects()
    dc, ts, ds = (means[c].to_numpy() for c in ("CrossInput", "TokenShuffle", "CrossShuffle"))
    assert fx["interaction"].statistic == pytest.approx(np.mean(ds - dc - ts), abs=1e-14)
    np.testing.assert_allclose(fx.pvalue_holm, multipletests(fx.pvalue, method="holm")[1])
    np.testing.assert_allclose(fx.mc_se, np.mean([m.factor_mc_se() for m in members], axis=0))
    ret = cs.retention("StaticProfile")
    s_, r_ = means["StaticProfile"].to_numpy(), means["StructureRemoved"].to_numpy()
    assert ret.level == "checkpoint" and ret.statistic == pytest.approx(1 - s_.mean() / r_.mean())
    assert [r.condition for r in cs.retentions()] == ["LayerPositionMean", "StaticProfile"]


# ---------------------------------------------------------------- inference


def test_paired_bootstrap_matches_scipy_bootstrap():
    x = np.random.default_rng(3).gamma(2.0, 0.001, size=200)
    est = paired_bootstrap(x, confidence=0.9, n_resamples=2000, seed=7)
    ref = stats.bootstrap((x,), mean_stat, n_resamples=2000, vectorized=True, confidence_level=0.9,
                          method="percentile", rng=np.random.default_rng(7))
    assert est.statistic == pytest.approx(x.mean())
    assert est.confidence_interval.low == pytest.approx(ref.confidence_interval.low, rel=1e-12)
    assert est.confidence_interval.high == pytest.approx(ref.confidence_interval.high, rel=1e-12)
    assert est.n == 200 and math.isnan(est.pvalue) and est.confidence_level == 0.9
    # and it is a sensible interval: it brackets the mean, its width ~ 2 * 1.645 * SE of the mean
    se = x.std(ddof=1) / math.sqrt(x.size)
    assert est.confidence_interval.low < x.mean() < est.confidence_interval.high
    assert (est.confidence_interval.high - est.confidence_interval.low) == pytest.approx(2 * 1.645 * se, rel=0.15)


def test_checkpoint_bootstrap_matches_scipy_and_carries_sign_flip_p():
    x = np.array([0.00101, 0.00088, 0.00097, 0.00092, 0.00110, 0.00085, 0.00093])
    est = checkpoint_bootstrap(x, n_resamples=5000, seed=1)
    ref = stats.bootstrap((x,), mean_stat, n_resamples=5000, vectorized=True, method="percentile",
                          rng=np.random.default_rng(1))
    assert tuple(est.confidence_interval) == pytest.approx(tuple(ref.confidence_interval), rel=1e-12)
    assert est.pvalue == 2 / 128
    one = checkpoint_bootstrap([0.5])
    assert one.statistic == 0.5 and one.n == 1 and math.isnan(one.pvalue)
    assert math.isnan(one.confidence_interval.low) and math.isnan(one.confidence_interval.high)
    assert "no interval" in str(one)


def test_estimate_prints_and_serialises():
    est = checkpoint_bootstrap([1.0, 2.0, 3.0], n_resamples=500)
    s = str(est)
    assert "95% CI" in s and "n=3" in s and "p=" in s
    assert repr(est).startswith("Estimate(statistic=2.0")
    low, high = est.confidence_interval
    assert low <= 2.0 <= high
    d = json.loads(json.dumps(checkpoint_bootstrap([1.0]).to_dict(), allow_nan=False))
    assert d["ci_low"] is None and d["pvalue"] is None and d["statistic"] == 1.0 and d["n"] == 1
    assert "p=" not in str(checkpoint_bootstrap([1.0]))  # no test: no p-value printed


def test_mc_se():
    r = np.array([0.0010, 0.0012, 0.0009, 0.0011])
    assert mc_se(r) == pytest.approx(np.std(r, ddof=1) / 2)
    assert math.isnan(mc_se([0.3]))
    assert math.isnan(mc_se([0.3, np.nan, np.nan]))  # a deterministic condition's column
    rm = mean_deltas(make_records(R=4), "randomization")
    assert mc_se(rm["TokenShuffle"]) == pytest.approx(rm["TokenShuffle"].std(ddof=1) / 2)


def test_sign_flip_seven_positive_checkpoints_is_two_over_128():
    assert sign_flip_test([0.0009, 0.0011, 0.0010, 0.0008, 0.0012, 0.0013, 0.0010]) == 2 / 128


def _scipy_sign_flip(x, n_resamples):
    return stats.permutation_test((np.asarray(x, float),), mean_stat, permutation_type="samples",
                                  n_resamples=n_resamples, vectorized=True, rng=np.random.default_rng(0)).pvalue


@pytest.mark.parametrize("x", [
    np.random.default_rng(5).normal(0.3, 1.0, size=11),
    np.random.default_rng(6).normal(-0.1, 1.0, size=9),
    [1.0, 2.0, 3.0, -2.0, 1.0, -1.0],  # integer values: many ties at the observed |mean|
    [0.0, 0.0, 0.0],
])
def test_sign_flip_exact_matches_scipy_permutation_test(x):
    # n_resamples >= 2^n makes scipy enumerate all sign patterns exactly
    assert sign_flip_test(x) == pytest.approx(_scipy_sign_flip(x, 10**6), abs=1e-12)


def test_sign_flip_monte_carlo_above_twenty():
    x = np.random.default_rng(8).normal(0.35, 1.0, size=30)
    p_mc = sign_flip_test(x, n_resamples=40000, seed=2)
    p_ref = _scipy_sign_flip(x, 40000)
    assert p_mc == pytest.approx(p_ref, abs=0.02)  # two independent MC estimates, SE ~ 0.002 each
    x_all_pos = np.abs(x) + 0.1
    assert sign_flip_test(x_all_pos, n_resamples=1000) == 1 / 1001  # valid MC p-value never reaches 0


def test_holm_matches_statsmodels_and_hand_formula():
    p = np.array([0.015625, 0.04, 0.01, 0.3])
    adj = holm(p)
    np.testing.assert_allclose(adj, multipletests(p, method="holm")[1])
    order = np.argsort(p)
    m = len(p)
    hand = np.empty(m)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        hand[i] = running
    np.testing.assert_allclose(adj, hand)
    out = holm([0.01, np.nan, 0.02])
    assert math.isnan(out[1]) and out[0] == pytest.approx(0.02) and out[2] == pytest.approx(0.02)
    with pytest.raises(FcauditError):
        holm([1.5])


def test_retention_bootstrap_over_checkpoints_and_windows_matches_scipy():
    rng = np.random.default_rng(4)
    s = rng.normal(0.0013, 0.0002, size=7)
    r = rng.normal(0.098, 0.004, size=7)
    est = retention_bootstrap(s, r, n_resamples=3000, seed=9)
    assert est.statistic == pytest.approx(1 - s.mean() / r.mean())

    def ratio(a, b, axis=-1):
        return 1 - np.mean(a, axis=axis) / np.mean(b, axis=axis)

    ref = stats.bootstrap((s, r), ratio, n_resamples=3000, vectorized=True, paired=True, method="percentile",
                          rng=np.random.default_rng(9))
    assert tuple(est.confidence_interval) == pytest.approx(tuple(ref.confidence_interval), rel=1e-12)
    assert est.confidence_interval.low < est.statistic < est.confidence_interval.high < 1
    w = retention_bootstrap(rng.normal(2.0, 0.5, 300), rng.normal(7.4, 1.0, 300), n_resamples=1000, unit="window")
    assert "windows" in w.method and w.n == 300 and w.has_interval
    single = retention_bootstrap([1.9798], [7.4237])  # one checkpoint: no interval for the reference gap
    assert math.isnan(single.statistic) and not single.has_interval and "single checkpoint" in single.method
    assert round(100 * retention(1.9798, 7.4237), 2) == 73.33  # the formula itself (paper's MUDDPythia)


def test_inference_rejects_bad_input():
    for bad in ([], [1.0, np.nan], np.ones((2, 2))):
        with pytest.raises(FcauditError):
            paired_bootstrap(bad)
    with pytest.raises(FcauditError):
        sign_flip_test([np.inf])
    with pytest.raises(FcauditError):
        retention_bootstrap([1.0, 2.0], [3.0])


# ---------------------------------------------------------------- variance decomposition


def _centered(shape, axes_of_effect, rng):
    """A random effect over `axes_of_effect`, centered along each of its axes (orthogonal to all other terms)."""
    full = [n if a in axes_of_effect else 1 for a, n in enumerate(shape)]
    e = rng.normal(size=full)
    for a in axes_of_effect:
        e = e - e.mean(axis=a, keepdims=True)
    return np.broadcast_to(e, shape)


PLANTED = {"input": 0.02, "layer": 0.80, "token": 0.05, "input:layer": 0.03, "input:token": 0.04,
           "layer:token": 0.01, "input:layer:token": 0.05}


def planted_tensor(shape=(6, 5, 8), seed=0, grand=0.6):
    rng = np.random.default_rng(seed)
    axes = {"input": 0, "layer": 1, "token": 2}
    x = np.full(shape, grand)
    for name, frac in PLANTED.items():
        e = _centered(shape, [axes[a] for a in name.split(":")], rng)
        x = x + e * math.sqrt(frac / (e**2).sum())  # each term's sum of squares = its planted fraction
    return x


def test_variance_decomposition_recovers_planted_fractions_and_sums_to_one():
    x = planted_tensor()
    got = variance_decomposition(x)
    assert list(got) == list(PLANTED)
    for name, frac in PLANTED.items():
        assert got[name] == pytest.approx(frac, abs=1e-12), name
    assert sum(got.values()) == pytest.approx(1.0, abs=1e-12)
    noisy = x + np.random.default_rng(1).normal(size=x.shape)  # arbitrary data: still sums to one
    assert sum(variance_decomposition(noisy).values()) == pytest.approx(1.0, abs=1e-12)


def test_variance_decomposition_two_factor_case_matches_hand_anova():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(4, 3, 1))  # one token: the token terms vanish, a two-way ANOVA remains
    y = x[:, :, 0]
    total = ((y - y.mean()) ** 2).sum()
    ss_input = 3 * ((y.mean(axis=1) - y.mean()) ** 2).sum()
    ss_layer = 4 * ((y.mean(axis=0) - y.mean()) ** 2).sum()
    got = variance_decomposition(x)
    assert got["input"] == pytest.approx(ss_input / total)
    assert got["layer"] == pytest.approx(ss_layer / total)
    assert got["token"] == 0 and got["layer:token"] == 0
    assert got["input:layer"] == pytest.approx(1 - (ss_input + ss_layer) / total)


def test_variance_trailing_axes_pool_within_slice_sums_of_squares():
    a, b = planted_tensor(seed=0), planted_tensor(seed=1, grand=5.0) * 3.0  # different level and scale
    x = np.stack([a, b], axis=-1)
    got = variance_decomposition(x)
    ta, tb = ((a - a.mean()) ** 2).sum(), ((b - b.mean()) ** 2).sum()
    fa, fb = variance_decomposition(a), variance_decomposition(b)
    for name in PLANTED:
        assert got[name] == pytest.approx((fa[name] * ta + fb[name] * tb) / (ta + tb))
    # MUDD-like nan padding: a source that exists only from layer 2 on uses those layers only
    c = np.stack([a, np.concatenate([np.full((6, 2, 8), np.nan), b[:, 2:, :]], axis=1)], axis=-1)
    assert variance_decomposition(c[..., 1:]) == pytest.approx(variance_decomposition(b[:, 2:, :]))
    empty = np.concatenate([c, np.full(c.shape[:3] + (1,), np.nan)], axis=-1)  # a slice no layer has is skipped
    assert variance_decomposition(empty) == pytest.approx(variance_decomposition(c))
    c[0, 3, 0, 1] = np.nan
    with pytest.raises(FcauditError):
        variance_decomposition(c)


def test_variance_constant_coefficients_give_nan_with_warning():
    with pytest.warns(RuntimeWarning, match="constant"):
        got = variance_decomposition(np.full((3, 4, 5), 0.6))
    assert all(math.isnan(v) for v in got.values())
    with pytest.raises(FcauditError):
        variance_decomposition(np.zeros((3, 4)))


class ChunkStore:
    """A coefficient store in memory: read_chunk(start) gives one [batch, token, stream, source] tensor per site."""

    def __init__(self, chunks: dict[int, list[torch.Tensor]]):
        self.chunks = chunks

    def read_chunk(self, start: int) -> list[torch.Tensor]:
        return self.chunks[start]


def test_variation_per_layer_profiles_and_decomposition_of_a_store():
    x = planted_tensor()  # [input 6, layer 5, token 8]: two batches of 4 and 2 windows, a scalar site per layer
    t = torch.from_numpy(x)
    store = ChunkStore({b: [t[b:b + 4, layer, :, None, None] for layer in range(5)] for b in (0, 4)})
    var = variation(store, np.array([0, 4]), sites=[f"blocks.{layer}.gate" for layer in range(5)])
    assert [l["site"] for l in var["layers"]] == [f"blocks.{layer}.gate" for layer in range(5)]
    np.testing.assert_allclose([l["mean"] for l in var["layers"]], x.mean(axis=(0, 2)), rtol=1e-12)
    np.testing.assert_allclose([l["sd"] for l in var["layers"]], x.std(axis=(0, 2)), rtol=1e-9)
    assert var["decomposition"] == pytest.approx(variance_decomposition(x), abs=1e-12)
    assert (var["windows"], var["windows_decomposed"]) == (6, 6) and "scalar" in var["decomposed"]
    # two streams, the second twice the first: a [stream, source] mean per layer, slices pooled
    two = ChunkStore({b: [torch.stack([c[..., 0, 0], 2 * c[..., 0, 0]], dim=-1)[..., None] for c in chunk]
                      for b, chunk in store.chunks.items()})
    var2 = variation(two, np.array([0, 4]))
    assert var2["layers"][0]["shape"] == [2, 1] and "site" not in var2["layers"][0]
    np.testing.assert_allclose(var2["layers"][3]["stream_source_mean"], [[x[:, 3].mean()], [2 * x[:, 3].mean()]])
    assert var2["decomposition"] == pytest.approx(variance_decomposition(np.stack([x, 2 * x], -1)), abs=1e-12)
    assert "slice" in var2["decomposed"]
