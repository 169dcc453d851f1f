"""An audit directory read back: records, replay report, penalties, factor effects, retention, variation."""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from fcaudit.audit.interventions import CONDITIONS, RANDOMIZED
from fcaudit.errors import FcauditError
from fcaudit.io import atomic_write, read_json

RECORD_COLUMNS = ("example", "condition", "randomization", "nll", "tokens")
DECOMPOSITION_BUDGET = 256 * 2**20  # bytes of float64 coefficients loaded for the variance decomposition


def records_frame(examples: np.ndarray, condition: str, randomization: int, nll: torch.Tensor, tokens: int) -> pd.DataFrame:
    return pd.DataFrame({"example": np.asarray(examples, dtype=np.int64), "condition": condition,
                         "randomization": np.int64(randomization), "nll": nll.numpy().astype(np.float64),
                         "tokens": np.int64(tokens)})


def write_records(path: str | os.PathLike, frame: pd.DataFrame) -> Path:
    return atomic_write(path, lambda p: frame.to_parquet(p, index=False))


def load_records(path: str | os.PathLike) -> pd.DataFrame:
    """All finished records of an audit directory, sorted by condition (paper order), randomization, example."""
    root = Path(path) / "records"
    files = sorted(p for p in root.rglob("*.parquet") if not p.name.startswith("."))
    if not files:
        raise FcauditError(f"{path} has no records; run `fcaudit audit ... --out {path}` first")
    df = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
    order = {c: i for i, c in enumerate(CONDITIONS)}
    df = df.sort_values(["condition", "randomization", "example"], key=lambda s: s.map(order) if s.name == "condition" else s)
    return df.reset_index(drop=True)[list(RECORD_COLUMNS)]


def _clean(d: dict) -> dict:
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


def variation(store, starts: np.ndarray) -> dict:
    """Per-layer mean/sd of the evaluation coefficients and the balanced variance decomposition."""
    from fcaudit.stats.variance import variance_decomposition

    sums = sq = None
    count = 0
    for b0 in starts:
        chunk = [c.double() for c in store.read_chunk(int(b0))]
        s = [c.sum(dim=(0, 1)) for c in chunk]  # [stream, source]
        q = [(c * c).sum(dim=(0, 1)) for c in chunk]
        sums = s if sums is None else [a + b for a, b in zip(sums, s)]
        sq = q if sq is None else [a + b for a, b in zip(sq, q)]
        count += chunk[0].shape[0] * chunk[0].shape[1]
    layers = []
    for l, (s, q) in enumerate(zip(sums, sq)):
        n = count * s.numel()
        mean = float(s.sum()) / n
        layers.append({"layer": l, "shape": [int(x) for x in s.shape], "mean": mean,
                       "sd": math.sqrt(max(float(q.sum()) / n - mean * mean, 0.0)),
                       "stream_source_mean": (s / count).tolist()})
    shapes = [tuple(s.shape) for s in sums]
    scalar = all(sh == (1, 1) for sh in shapes)
    s_max, k_max = max(sh[0] for sh in shapes), max(sh[1] for sh in shapes)
    token = store.read_chunk(int(starts[0]))[0].shape[1]
    per_window = len(shapes) * token * s_max * k_max * 8
    n_total = int(starts[-1]) + store.read_chunk(int(starts[-1]))[0].shape[0]
    n_used = max(2, min(n_total, DECOMPOSITION_BUDGET // per_window))
    arr = np.full((n_used, len(shapes), token, s_max, k_max), np.nan)
    for b0 in starts:
        if b0 >= n_used:
            break
        for l, c in enumerate(store.read_chunk(int(b0))):
            c = c[: n_used - b0].double().numpy()
            arr[b0:b0 + c.shape[0], l, :, : c.shape[2], : c.shape[3]] = c
    if scalar:
        what = "the scalar coefficient per (input, layer, token)"
        arr = arr[..., 0, 0]
    else:
        what = ("each (stream, source) slice over (input, layer, token), sums of squares pooled over slices; "
                "layers lacking a slice are left out of it")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        fractions = variance_decomposition(arr)
    return {"layers": layers, "decomposition": _clean(fractions), "decomposed": what,
            "windows_decomposed": int(n_used), "windows": n_total}


@dataclass(repr=False)
class AuditResult:
    """The results directory of one audit: config, replay report and records, with the paper's summaries."""

    path: Path
    config: dict
    replay: dict
    records: pd.DataFrame

    def __repr__(self) -> str:
        r = self.replay
        return (f"AuditResult({str(self.path)!r}, {self.records['example'].nunique()} windows, "
                f"R={self.config.get('randomizations')}, replay passed={r.get('passed')} "
                f"max|Δlogit|={r.get('max_abs_dlogit')})")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "AuditResult":
        path = Path(path)
        if not (path / "config.json").is_file() or not (path / "replay.json").is_file():
            raise FcauditError(f"{path} is not a finished audit directory; run `fcaudit audit ... --out {path}`")
        return cls(path, read_json(path / "config.json"), read_json(path / "replay.json"), load_records(path))

    @property
    def labels(self) -> dict[str, str]:
        return {c: c for c in CONDITIONS} | dict(self.config.get("labels") or {})

    @property
    def variation(self) -> dict | None:
        p = self.path / "variation.json"
        return read_json(p) if p.is_file() else None

    @property
    def penalties_confidence(self) -> float:
        return self._confidence(None)

    def _confidence(self, confidence: float | None) -> float:
        return confidence or float((self.config.get("criteria") or {}).get("confidence", 0.95))

    def penalties(self, confidence: float | None = None, n_resamples: int = 10000) -> pd.DataFrame:
        """Per condition: mean ΔNLL, paired-window bootstrap interval and MC SE across randomizations."""
        from fcaudit.stats.effects import per_example_deltas, randomization_means
        from fcaudit.stats.inference import mc_se, paired_bootstrap

        conf = self._confidence(confidence)
        per_window, rand = per_example_deltas(self.records), randomization_means(self.records)
        rows = []
        for c in [c for c in CONDITIONS if c in per_window.columns]:
            est = paired_bootstrap(per_window[c].to_numpy(), confidence=conf, n_resamples=n_resamples, seed=0)
            r = rand[c].dropna().to_numpy()
            rows.append({"condition": c, "label": self.labels[c], "n": int(est.n), "mean": float(est.statistic),
                         "ci_low": est.confidence_interval.low, "ci_high": est.confidence_interval.high,
                         "mc_se": mc_se(r) if c in RANDOMIZED else math.nan, "randomizations": len(r)})
        return pd.DataFrame(rows)

    def factor_effects(self, confidence: float | None = None, n_resamples: int = 10000) -> pd.DataFrame:
        """E_input, E_token, E_interaction (Eq. 5-7), paired CC/DC/CS/DS per example and randomization."""
        from fcaudit.stats.effects import factorial_cells
        from fcaudit.stats.inference import mc_se, paired_bootstrap

        conf = self._confidence(confidence)
        cells = factorial_cells(self.records)
        per_pair = cells.effects().as_dict()  # each [example, randomization]
        rows = []
        for name, x in per_pair.items():
            est = paired_bootstrap(x.mean(axis=1), confidence=conf, n_resamples=n_resamples, seed=0)
            rows.append({"effect": name, "mean": float(est.statistic), "ci_low": est.confidence_interval.low,
                         "ci_high": est.confidence_interval.high, "mc_se": mc_se(x.mean(axis=0)), "n": int(est.n)})
        return pd.DataFrame(rows).set_index("effect")

    def retention(self, name: str = "StaticProfile", confidence: float | None = None,
                  n_resamples: int = 10000) -> pd.Series:
        """Retention(S) = 1 - ΔNLL(S)/ΔNLL(StructureRemoved) (Eq. 8) with its paired-window interval, reported
        with both absolute ΔNLLs. `name`: StaticProfile or LayerPositionMean, or a display label (e.g. LayerMean)."""
        from fcaudit.stats.effects import per_example_deltas
        from fcaudit.stats.inference import retention_bootstrap

        by_label = {v: k for k, v in self.labels.items()}
        cond = by_label.get(name, name)
        if cond not in ("StaticProfile", "LayerPositionMean"):
            raise FcauditError(f"retention is defined for StaticProfile or LayerPositionMean "
                               f"({self.labels['StaticProfile']}), not {name!r}")
        per_window = per_example_deltas(self.records)
        s, r = per_window[cond].to_numpy(), per_window["StructureRemoved"].to_numpy()
        est = retention_bootstrap(s, r, confidence=self._confidence(confidence), n_resamples=n_resamples, seed=0,
                                  unit="window")
        return pd.Series({"condition": cond, "label": self.labels[cond], "retention": est.statistic,
                          "ci_low": est.confidence_interval.low, "ci_high": est.confidence_interval.high,
                          "delta_static": float(s.mean()), "delta_reference": float(r.mean()),
                          "reference": self.labels["StructureRemoved"], "n": int(est.n)})
