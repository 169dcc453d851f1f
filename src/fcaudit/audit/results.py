"""An audit directory read back (the one reader): records, replay report, penalties, factor effects, retention,
variation. `fcaudit summarize`, `fcaudit report` and the Python API all read audits through `AuditResult`."""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from fcaudit import protocol
from fcaudit.audit import files
from fcaudit.audit.directory import MARKER, AuditDir
from fcaudit.errors import FcauditError

DECOMPOSITION_BUDGET = 256 * 2**20  # bytes of float64 coefficients loaded for the variance decomposition
DECOMPOSITION_WINDOWS = 256  # at most this many windows (the first ones): memory flat in the number of windows
V1_CONDITIONS = ("Correct", "CrossInput", "TokenShuffle", "CrossShuffle", "LayerPositionMean", "StaticProfile",
                 "StructureRemoved")  # audits written before the protocol registry (no "conditions" in config.json)


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    df = df.sort_values(["condition", "randomization", "example"],
                        key=lambda s: s.map(protocol.order) if s.name == "condition" else s)
    df = df.reset_index(drop=True)
    if "active" not in df.columns:  # audits of fcaudit before records carried it
        df["active"] = np.nan
    return df[list(protocol.RECORD_COLUMNS)]


def _damaged(e: files.Damaged, root: Path) -> FcauditError:
    return FcauditError(f"{e.path} is damaged ({e.why}); rerun the audit command on {root} to recompute it")


def _read_json(path: Path, root: Path) -> dict | None:
    """replay.json or variation.json (the engine's, hashed), None when it is missing; a damaged one is an error that
    says so."""
    try:
        return files.read_json(path, require_hash=True)
    except FileNotFoundError:
        return None
    except files.Damaged as e:
        raise _damaged(e, root) from None


def load_records(path: str | os.PathLike, partial: bool = False) -> pd.DataFrame:
    """The records of an audit directory, sorted by condition (registry order), randomization, example. With
    `partial`, also the finished units of (condition, randomization) pairs that are not complete yet."""
    adir = AuditDir(path)
    frames = []
    try:
        for f in sorted(p for p in (adir.root / "records").rglob("*.parquet") if not p.name.startswith(".")):
            frames.append(files.read_frame(f))  # the engine's own check: what it would recompute, this refuses
        for f in sorted(adir.root.glob("parts/*/r*/b*.safetensors")) if partial else ():
            tensors, _ = files.read_tensors(f)
            condition, r = f.parent.parent.name, int(f.parent.name[1:])
            frames.append(pd.DataFrame({"example": tensors["example"].numpy(), "condition": condition,
                                        "randomization": np.int64(r), "nll": tensors["nll"].numpy(),
                                        "tokens": np.int64(-1), "active": tensors["active"].numpy()}))
    except files.Damaged as e:
        raise _damaged(e, adir.root) from None
    if not frames:
        raise FcauditError(f"{path} has no records; run `fcaudit audit ... --out {path}` first")
    return _sorted(pd.concat(frames, ignore_index=True))


def expected_records(config: dict) -> list[tuple[str, int]]:
    """The (condition, randomization) pairs a finished audit with this configuration holds."""
    conditions = config.get("conditions") or V1_CONDITIONS
    return [(c, r) for c in conditions if c in protocol.REGISTRY
            for r in range(config["randomizations"] if protocol.REGISTRY[c].randomized else 1)]


def missing_files(root: Path, config: dict) -> list[str]:
    """The expected (condition, randomization) records files that are absent or short, read from their Parquet
    metadata only (the records themselves are read, and their hashes checked, when first used)."""
    import pyarrow.parquet as pq

    adir, n, missing = AuditDir(root), config["windows"]["n_eval"], []
    for c, r in expected_records(config):
        path = adir.records(c, r)
        if not path.is_file():
            missing.append(f"{c} r{r}")
            continue
        try:
            rows = pq.read_metadata(path).num_rows
        except Exception as e:
            raise _damaged(files.Damaged(path, f"unreadable ({type(e).__name__})"), adir.root) from None
        if rows != n:
            missing.append(f"{c} r{r}")
    return missing


def variation(store, starts: np.ndarray, sites: list[str] | None = None) -> dict:
    """Per-layer mean/sd of the evaluation coefficients and the balanced variance decomposition. `sites`: each
    layer's module path (a layer is a site: an MoE whose first block is dense has its layer 0 in model.layers.1)."""
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
        layers.append({"layer": l, **({"site": sites[l]} if sites else {}), "shape": [int(x) for x in s.shape],
                       "mean": mean,
                       "sd": math.sqrt(max(float(q.sum()) / n - mean * mean, 0.0)),
                       "stream_source_mean": (s / count).tolist()})
    shapes = [tuple(s.shape) for s in sums]
    scalar = all(sh == (1, 1) for sh in shapes)
    s_max, k_max = max(sh[0] for sh in shapes), max(sh[1] for sh in shapes)
    token = store.read_chunk(int(starts[0]))[0].shape[1]
    per_window = len(shapes) * token * s_max * k_max * 8
    n_total = int(starts[-1]) + store.read_chunk(int(starts[-1]))[0].shape[0]
    n_used = max(2, min(n_total, DECOMPOSITION_WINDOWS, DECOMPOSITION_BUDGET // per_window))
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
    return {"layers": layers, "decomposition": fractions, "decomposed": what,
            "windows_decomposed": int(n_used), "windows": n_total}


@dataclass(repr=False)
class AuditResult:
    """The results directory of one audit: config, replay report and records, with the paper's summaries.

    `partial` is True for an unfinished audit loaded with `allow_partial=True`; every summary says so. The records
    are read from disk (and their content hashes checked) when first used, so loading an audit costs no memory
    that grows with its number of windows until its records are needed."""

    path: Path
    config: dict
    replay: dict
    partial: bool = False
    _records: pd.DataFrame | None = None

    @property
    def records(self) -> pd.DataFrame:
        if self._records is None:
            self._records = load_records(self.path, partial=self.partial)
        return self._records

    def __repr__(self) -> str:
        r = self.replay
        part = ", PARTIAL" if self.partial else ""
        return (f"AuditResult({str(self.path)!r}, {self.records['example'].nunique()} windows, "
                f"R={self.config.get('randomizations')}, replay passed={r.get('passed')} "
                f"max|Δlogit|={r.get('max_abs_dlogit')}{part})")

    @classmethod
    def load(cls, path: str | os.PathLike, allow_partial: bool = False) -> "AuditResult":
        """Read an audit directory; an unfinished one is refused unless `allow_partial` (then marked partial)."""
        adir = AuditDir(path)
        rerun = f"rerun the audit command with --out {adir.root} to finish it"
        if not adir.config_path.is_file():
            raise FcauditError(f"{adir.root} is not an audit directory (no config.json); pass a directory written by "
                               "`fcaudit audit`")
        if not any((adir.root / n).exists() for n in (MARKER, "records", "records.parquet")):  # 2.x, or the first
            raise FcauditError(f"{adir.root} is not an audit directory (a checkpoint?): audit it first with "
                               f"`fcaudit audit {adir.root} --out DIR` and pass DIR")
        try:
            config = adir.config()
        except files.Damaged as e:
            raise _damaged(e, adir.root) from None
        replay = _read_json(adir.replay, adir.root) or {}
        if replay.get("passed") is False:
            raise FcauditError(f"{adir.root}: the exact replay check failed ({replay.get('max_abs_dlogit')} max "
                               "|Δlogit|); its interventions are not valid, see replay.json")
        missing = missing_files(adir.root, config)
        # written last, after replay.json: without it the audit was stopped before its end
        missing += [p.name for p in (adir.replay, adir.variation) if _read_json(p, adir.root) is None]
        if missing and not allow_partial:
            what = f"lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
            raise FcauditError(f"{adir.root} is an unfinished audit ({what}); {rerun} (or pass --allow-partial)")
        if not missing:
            return cls(adir.root, config, replay)
        records = load_records(adir.root, partial=True)  # an unfinished audit, asked for: read what is there
        return cls(adir.root, config, replay, partial=True, _records=records)

    @property
    def labels(self) -> dict[str, str]:
        """Display label per condition: the registry's defaults, renamed by the controller (e.g. LayerMean)."""
        return protocol.default_labels() | dict(self.config.get("labels") or {})

    @property
    def variation(self) -> dict | None:
        return _read_json(self.path / "variation.json", self.path)

    @property
    def penalties_confidence(self) -> float:
        return self._confidence(None)

    def _confidence(self, confidence: float | None) -> float:
        return confidence or float((self.config.get("criteria") or {}).get("confidence", 0.95))

    def penalties(self, confidence: float | None = None, n_resamples: int = 10000) -> pd.DataFrame:
        """Per condition: mean ΔNLL, paired-window bootstrap interval, MC SE across randomizations and the mean
        number of active sources (experts) per token."""
        from fcaudit.stats.effects import per_example_deltas, randomization_means
        from fcaudit.stats.inference import mc_se, paired_bootstrap

        conf = self._confidence(confidence)
        per_window, rand = per_example_deltas(self.records), randomization_means(self.records)
        active = self.records.groupby("condition")["active"].mean()
        rows = []
        for c in sorted(per_window.columns, key=protocol.order):
            est = paired_bootstrap(per_window[c].dropna().to_numpy(), confidence=conf, n_resamples=n_resamples, seed=0)
            r = rand[c].dropna().to_numpy()
            randomized = c in protocol.REGISTRY and protocol.REGISTRY[c].randomized
            rows.append({"condition": c, "label": self.labels.get(c, c), "n": int(est.n),
                         "mean": float(est.statistic), "ci_low": est.confidence_interval.low,
                         "ci_high": est.confidence_interval.high, "mc_se": mc_se(r) if randomized else math.nan,
                         "randomizations": len(r), "active": float(active.get(c, math.nan))})
        return pd.DataFrame(rows)

    def factor_effects(self, confidence: float | None = None, n_resamples: int = 10000) -> pd.DataFrame:
        """E_input, E_token, E_interaction (Eq. 5-7), paired CC/DC/CS/DS per example and randomization."""
        from fcaudit.stats.effects import factorial_cells
        from fcaudit.stats.inference import mc_se, paired_bootstrap

        conf = self._confidence(confidence)
        per_pair = factorial_cells(self.records, complete=not self.partial).effects().as_dict()  # [example, r]
        rows = []
        for name, x in per_pair.items():
            est = paired_bootstrap(x.mean(axis=1), confidence=conf, n_resamples=n_resamples, seed=0)
            rows.append({"effect": name, "mean": float(est.statistic), "ci_low": est.confidence_interval.low,
                         "ci_high": est.confidence_interval.high, "mc_se": mc_se(x.mean(axis=0)), "n": int(est.n)})
        return pd.DataFrame(rows).set_index("effect")

    def retention(self, name: str = "StaticProfile", confidence: float | None = None,
                  n_resamples: int = 10000) -> pd.Series:
        """Retention(S) = 1 - ΔNLL(S)/ΔNLL(StructureRemoved) (Eq. 8) with its paired-window interval, reported
        with both absolute ΔNLLs. Undefined (nan, with the reason in `note`) unless the reference ΔNLL's interval
        lies above 0. `name`: a retained static condition (StaticProfile, LayerPositionMean, StaticTopK) or its
        display label (e.g. LayerMean)."""
        from fcaudit.stats.effects import per_example_deltas
        from fcaudit.stats.inference import retention_bootstrap

        by_label = {v: k for k, v in self.labels.items()}
        cond = by_label.get(name, name)
        reference = protocol.structure_removed()
        per_window = per_example_deltas(self.records)
        if cond not in protocol.retained() or cond not in per_window.columns:
            have = [c for c in protocol.retained() if c in per_window.columns]
            named = ", ".join(f"{c} ({self.labels.get(c, c)})" for c in have)
            raise FcauditError(f"retention is defined for the static conditions {named}, not {name!r}")
        s, r = per_window[cond].to_numpy(), per_window[reference].to_numpy()
        est = retention_bootstrap(s, r, confidence=self._confidence(confidence), n_resamples=n_resamples, seed=0,
                                  unit="window")
        return pd.Series({"condition": cond, "label": self.labels[cond], "retention": est.statistic,
                          "ci_low": est.confidence_interval.low, "ci_high": est.confidence_interval.high,
                          "delta_static": float(s.mean()), "delta_reference": float(r.mean()),
                          "reference": self.labels[reference], "n": int(est.n),
                          "note": "" if est.has_interval else est.method})

    def retention_lines(self) -> list[str]:
        """One line per retained condition: retention, its interval and the two absolute ΔNLLs (or why undefined)."""
        lines = []
        for c in protocol.retained():
            if c not in set(self.records["condition"]):
                continue
            r = self.retention(c)
            if math.isfinite(r["ci_low"]):
                value = f"{100 * r['retention']:.2f}% [{100 * r['ci_low']:.2f}%, {100 * r['ci_high']:.2f}%]"
            elif math.isfinite(r["retention"]):
                value = f"{100 * r['retention']:.2f}% ({r['note'].split('; ')[-1]})"
            else:
                value = f"undefined ({r['note']})"
            lines.append(f"retention {r['label']} vs {r['reference']}: {value}; "
                         f"ΔNLL {r['delta_static']:.6g} vs {r['delta_reference']:.6g}")
        return lines
