"""Question 3 of the paper (section 4.5): does the mechanism actually skip work? Variation and functional dependence
say nothing about execution, so this measures what really runs (block forwards, FLOPs, latency) for a list of
checkpoints, with ratios to a Dense model of the same architecture. A soft gate (FeatureGate, Uniform, LayerStatic)
scales a block's update but never removes the block: such models run every block and pay for their controller. Each
model is measured scoring windows and, where it can, decoding a text window token by token with a KV cache (decode.py),
where per-token early exit saves work."""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from rich.console import Console
from torch import nn

from fcaudit import data, families
from fcaudit.config import MAX_BATCH_SIZE, MAX_MIN_RUN_TIME, MAX_WINDOW, MAX_WINDOWS, check_count
from fcaudit.controllers.controller import Controller
from fcaudit.controllers.rows import counting_rows
from fcaudit.device import resolve_device
from fcaudit.errors import FcauditError, one_line
from fcaudit.execution.blocks import block_modules, block_pattern, row_fraction
from fcaudit.execution.conditions import captured, condition_execution, token_columns, token_conditions, token_sites
from fcaudit.execution.decided import observe
from fcaudit.execution.decode import DECODE_BATCH, decode_latencies, decoding_columns
from fcaudit.execution.flops import flops
from fcaudit.execution.latency import Timing, latencies, random_ids
from fcaudit.execution.threshold import thresholding, vector_site
from fcaudit.held_warnings import warnings_held
from fcaudit.hub import resolve
from fcaudit.io import OutDir, read_object, valid_path
from fcaudit.provenance import provenance
from fcaudit.threads import using_threads


@dataclass(frozen=True)
class BlockCount:
    """Blocks of a model and what each computed in one forward pass, observed (fcaudit.execution.rows)."""

    pattern: str
    n_blocks: int  # modules matching the pattern
    executed: int  # blocks that computed rows (any of their computing modules ran)
    skipped: tuple[str, ...]  # blocks that computed no row at all
    counts: tuple[Counter, ...] = field(default=(), repr=False)  # per block: the rows each computing module took
    tokens: int = 0

    @property
    def row_fractions(self) -> tuple[float, ...]:
        """Per block: the rows it computed over the forward's tokens (1.0: every one)."""
        return tuple(row_fraction(c, self.tokens) for c in self.counts)

    def row_fraction(self, idle: Collection[nn.Module] = ()) -> float:
        """The mean over blocks of the rows each computed: the (block, token) pairs that ran, observed; `idle`: the
        modules the model does not call (blocks.uncalled)."""
        return sum(row_fraction(c, self.tokens, idle) for c in self.counts) / len(self.counts) if self.counts \
            else math.nan


@torch.inference_mode()
def executed_blocks(model: nn.Module, ids: torch.Tensor, pattern: str | None = None) -> BlockCount:
    """What each block computed in one model(ids), observed at the modules inside it that hold weights (a block's
    own forward may never be called while its MLP runs on a gathered subset): a block whose output is scaled by 0
    still ran every row; only one none of whose modules ran is skipped."""
    pattern = pattern or block_pattern(model)
    blocks = block_modules(model, pattern)  # named_modules() lists each module once
    with counting_rows([m for _, m in blocks]) as counts:
        model(ids)
    ran = [any(c.values()) for c in counts]
    return BlockCount(pattern, len(blocks), sum(ran), tuple(n for (n, _), r in zip(blocks, ran) if not r),
                      tuple(counts), ids.numel())


@dataclass(frozen=True)
class Source:
    """One model to measure: a checkpoint as given, or the checkpoint an audit directory recorded (`audit`), loaded in
    the audit's dtype and `check`ed against what the audit recorded before anything is measured."""

    given: str  # the checkpoint's path or hub id, as the row names it
    path: Path  # its local directory
    dtype: torch.dtype | None = None  # None: the checkpoint's own
    audit: str | None = None  # the audit directory it was given as
    check: Callable[[nn.Module], None] | None = None  # refuses a loaded model that is not the audit's


def sources(checkpoints: Sequence[str]) -> list[Source]:
    """Each checkpoint as given, loaded as it is."""
    return [Source(c, resolve(c)) for c in checkpoints]


@dataclass(frozen=True)
class ExecutionConfig:
    """What `fcaudit execution` measures and how: checked once, here, before anything is loaded or written."""

    checkpoints: tuple[str, ...]  # directories or hub ids; include a Dense one for the ratios
    out: str
    batch_size: int = 8
    window: int | None = None  # None: the smallest context among the models, at most DEFAULT_WINDOW_CAP
    device: str = "auto"
    min_run_time: float = 1.0  # seconds of timing per model
    thresholds: tuple[float, ...] = ()  # post-training gate thresholds (scalar-gated models)
    corpus: str = "embedded"  # test windows for thresholding, validation windows for static profiles
    threshold_windows: int = 32
    threads: int | None = None  # torch CPU threads while measuring (restored afterwards)
    progress: bool = True

    def __post_init__(self):
        object.__setattr__(self, "checkpoints", tuple(str(c) for c in self.checkpoints))
        object.__setattr__(self, "out", str(valid_path(self.out, "--out")))
        object.__setattr__(self, "thresholds", tuple(float(t) for t in self.thresholds))
        for name, flag, low, high in (("batch_size", "--batch-size", 1, MAX_BATCH_SIZE),
                                      ("threshold_windows", "--threshold-windows", 1, MAX_WINDOWS)):
            object.__setattr__(self, name, check_count(getattr(self, name), flag, low, high))
        if self.window is not None:  # None: the smallest block_size
            object.__setattr__(self, "window", check_count(self.window, "--window", 2, MAX_WINDOW))
        for bad, message in (
            (not self.checkpoints, "no checkpoints to measure: pass one or more checkpoint directories"),
            (self.threads is not None and self.threads < 1, f"threads {self.threads}: pass --threads 1 or more"),
            (not (isinstance(self.min_run_time, (int, float)) and math.isfinite(self.min_run_time)
                  and 0 < self.min_run_time <= MAX_MIN_RUN_TIME),
             f"--min-run-time {self.min_run_time}: pass a positive number of seconds, at most {MAX_MIN_RUN_TIME:g} "
             "(fcaudit's limit)"),
            (not all(math.isfinite(t) for t in self.thresholds),
             f"--threshold {list(self.thresholds)}: pass finite thresholds, e.g. 0.3")):
            if bad:
                raise FcauditError(message)

    @property
    def timing(self) -> Timing:
        return Timing(self.min_run_time)


def _architecture(model: nn.Module) -> str:
    """Models comparable to one Dense reference: same class, width, heads, context and vocabulary (depth and gate
    may differ, so FixedDepth-k is compared with the full-depth Dense)."""
    c = getattr(model, "config", None)
    keys = ("d_model", "dim", "n_head", "block_size", "vocab_size")
    family = families.for_model(model)  # a family may name another's Dense as its baseline (MoD: FeatureGate's)
    name = (family.architecture if family is not None else None) or type(model).__name__
    return name + ":" + ",".join(f"{k}={getattr(c, k)}" for k in keys if hasattr(c, k))


def default_window(block_sizes) -> int:
    """One window for every model measured: the smallest context, at most DEFAULT_WINDOW_CAP tokens."""
    return min([*(s for s in block_sizes if s is not None), families.DEFAULT_WINDOW_CAP])


def _block_size(checkpoint: Path) -> int | None:
    """The checkpoint's context, or None for a model that states none (a recurrent or state-space model)."""
    path = checkpoint / "config.json"
    if not path.is_file():
        raise FcauditError(f"{checkpoint} has no config.json: pass a checkpoint directory written by `fcaudit train`")
    config = read_object(path, "use the config.json written with the checkpoint")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}  # a multimodal checkpoint
    keys = [k for k in ("block_size", "max_position_embeddings", "n_positions") if k in config or k in text]
    if not keys:
        return None
    size = next(c[k] for c in (config, text) for k in keys if k in c)
    if not isinstance(size, int) or isinstance(size, bool) or size < 2:
        raise FcauditError(f"{path} has no valid block_size: use the config.json written with the checkpoint")
    return size


DENSE_RATIOS = {"latency_vs_dense": "latency_ms", "throughput_vs_dense": "tokens_per_s",
                "flops_vs_dense": "flops_per_token", "executed_vs_dense": "executed_blocks",
                "decode_flops_vs_dense": "decode_flops_per_token", "decode_latency_vs_dense": "decode_ms_per_token"}


def add_dense_ratios(df: pd.DataFrame) -> pd.DataFrame:
    """Ratios to the mean Dense model of the same architecture (NaN where there is none)."""
    df = df.assign(**dict.fromkeys(DENSE_RATIOS, math.nan))
    for _, group in df.groupby("architecture"):
        dense = group[group["model"] == "dense"]
        for ratio, col in DENSE_RATIOS.items() if not dense.empty else ():
            df.loc[group.index, ratio] = group[col] / dense[col].mean()
    return df


def measure_execution(cfg: ExecutionConfig, given: Sequence[Source] | None = None) -> pd.DataFrame:
    """Executed blocks, parameters, FLOPs/token, latency (ms per batch) and throughput of each checkpoint, written to
    `out/execution.csv` and `out/execution.json`; all models run with one window so that their rows compare. With
    `thresholds`, scalar-gated models are thresholded on test windows (`out/thresholding.csv`); routed models get a
    row per condition in `out/conditions.csv`. Latencies are timed round-robin over all models, so all stay loaded.
    `given`: what to load for each of cfg.checkpoints (default: each as a checkpoint; `fcaudit execution` reads
    audit directories into theirs, fcaudit.checkpoint_audit.execution_sources)."""
    out = OutDir(cfg.out, "execution results").check(avoid=cfg.checkpoints)
    dev = resolve_device(cfg.device)
    # Read every config first (models are loaded one at a time below): one common window, bad paths fail early.
    inputs = list(given) if given is not None else sources(cfg.checkpoints)
    out.check(avoid=[str(s.path) for s in inputs])
    paths = [s.path for s in inputs]
    if len({p.resolve() for p in paths}) != len(paths):
        raise FcauditError("the same checkpoint was given twice (itself, or as an audit's): pass each checkpoint once")
    contexts = {p: _block_size(p) for p in paths}
    window = cfg.window or default_window(contexts.values())
    too_short = [str(p) for p, size in contexts.items() if size is not None and size < window]
    if too_short:
        raise FcauditError(f"window {window} exceeds the block_size of {too_short[0]}: pass a shorter --window")

    # transformers' warnings of the loads shown once all is measured: a model refused (its controller not found, after
    # its load) says that line alone
    with using_threads(cfg.threads) as n_threads, warnings_held():
        rows, sweeps, conditions = _measure_all(cfg, inputs, dev, window)
    df = add_dense_ratios(pd.DataFrame(rows))
    out.claim()
    settings = {"batch_size": cfg.batch_size, "window": window, "device": str(dev), "min_run_time": cfg.min_run_time,
                "latency": "round-robin over models, median of repetitions", "threads": n_threads,
                "decoding": f"{DECODE_BATCH} test window(s) of the corpus, token by token with a KV cache",
                "thresholds": list(cfg.thresholds), "corpus": cfg.corpus,
                # the test windows thresholding used: --threshold-windows, or all the split holds when it holds fewer
                "threshold_windows": int(sweeps[0]["windows"].iloc[0]) if sweeps else None}
    payload = {"settings": settings, "rows": df.to_dict(orient="records"), **provenance()}
    for name, parts in (("thresholding", sweeps), ("conditions", conditions)):
        if parts:
            table = pd.concat(parts, ignore_index=True)
            out.atomic_write(out.root / f"{name}.csv", lambda p, t=table: t.to_csv(p, index=False))
            payload[name] = table.to_dict(orient="records")
        else:  # a table left by an earlier run with other settings must not sit next to these results
            out.remove_file(out.root / f"{name}.csv")
    out.atomic_write(out.root / "execution.csv", lambda p: df.to_csv(p, index=False))
    out.write_json(out.root / "execution.json", payload)
    return df


def _load(source: Source, dev: torch.device) -> tuple[nn.Module, dict]:
    """(model, meta), or a refusal of a model that is not the audit's it was given as."""
    model, meta = families.load_model(source.path, device=dev, dtype=source.dtype)
    if source.check is not None:
        source.check(model)
    return model, meta


def _measure_all(cfg: ExecutionConfig, inputs: list[Source], dev: torch.device,
                 window: int) -> tuple[list[dict], list[pd.DataFrame], list[pd.DataFrame]]:
    """Load every model (a bad checkpoint fails before anything is measured), measure what does not depend on the
    machine's load model by model, then time all models round-robin."""
    loaded = [_load(source, dev) for source in inputs]
    rows, sweeps, conditions = [], [], []

    @functools.cache  # loaded once, when needed: "test" to threshold, "validation" for static profiles (as audits)
    def windows(split: str) -> torch.Tensor:
        return data.all_windows(getattr(data.load_corpus(cfg.corpus), split), window, limit=cfg.threshold_windows)

    def text() -> torch.Tensor:  # what decoding reads: text, where exits decide as they would in use
        return windows("test")[:DECODE_BATCH].to(dev)

    console = Console(stderr=True, quiet=not cfg.progress)
    labels = [families.label(model) for model, _ in loaded]
    # checkpoints of one label (seeds, a model and its copy) are told apart by their directory names
    labels = [f"{l} ({Path(s.given).name})" if labels.count(l) > 1 else l for l, s in zip(labels, inputs)]
    for source, (model, meta), label in zip(inputs, loaded, labels):
        path, given = source.path, source.given
        ids = random_ids(model, cfg.batch_size, window, dev)
        try:  # what does not depend on the machine's load, then what does; first, whether the model runs at all
            count = executed_blocks(model, ids)
        except (RuntimeError, IndexError, ValueError) as e:
            raise FcauditError(f"{given}: the model fails a forward pass on {cfg.batch_size} windows of {window} "
                               f"tokens ({type(e).__name__}: {one_line(e)}); check its config.json, and that a batch "
                               "fits in memory (--batch-size)") from e
        family, controller = families.for_model(model), _controller(model, given)  # a refusal before any line
        console.print(f"execution: {source.audit or given}", highlight=False)
        metrics = (read_object(path / "metrics.json", "restore it from the training run, or delete it")
                   if (path / "metrics.json").is_file() else {})
        row = {"checkpoint": given, **({"audit": source.audit} if source.audit is not None else {}),
               "model": label, "architecture": _architecture(model),
               **{k: metrics.get(k, meta.get(k)) for k in ("seed", "byte_ppl", "gate_mass")},
               "batch_size": cfg.batch_size, "window": window, "device": str(dev), "threads": torch.get_num_threads()}
        seen = observe(model, controller, ids) if controller is not None else None
        idle = seen.idle if seen else ()  # modules the model does not call (none known without a controller)
        row.update(block_pattern=count.pattern, n_blocks=count.n_blocks, executed_blocks=count.executed,
                   executed_row_fraction=count.row_fraction(idle),
                   n_params=sum(p.numel() for p in model.parameters()), flops_per_token=flops(model, ids[:1]))
        row.update(decoding_columns(model, text()))
        row.update(decided=seen.decided if seen else math.nan, executed=seen.executed if seen else math.nan,
                   execution_verdict=seen.verdict if seen else "no controller: everything it has runs")
        if family is not None and family.execution is not None:
            row.update(family.execution(model, ids))
            conditions.append(condition_execution(model, family, windows("validation"), ids, cfg.timing)
                              .assign(checkpoint=given, model=label))
        if controller is not None and token_sites(controller):  # token routers: token x block pairs, conditions
            blocks = [name for name, _ in block_modules(model, count.pattern)]
            row.update(token_columns(captured(model, ids, controller), controller, blocks))  # the live router's
            conditions.append(token_conditions(model, controller, windows("validation"), ids, blocks, cfg.timing)
                              .assign(checkpoint=given, model=label))
        rows.append(row)
        if cfg.thresholds and controller is not None and vector_site(controller) is None:
            sweeps.append(thresholding(model, controller, windows("test"), cfg.thresholds, batch_size=cfg.batch_size)
                          .assign(checkpoint=given, model=label))
        elif cfg.thresholds:
            console.print(f"thresholding: {label} has no scalar gates to threshold; skipped", highlight=False)
    _time(cfg, rows, [m for m, _ in loaded], window, text(), console)
    return rows, sweeps, conditions


def _time(cfg: ExecutionConfig, rows: list[dict], models: list[nn.Module], window: int, text: torch.Tensor,
          console: Console) -> None:
    """Into the rows: every model's latency scoring batches of `window` tokens, then that of the models that decode,
    decoding `text` (on its device); each round-robin over the models."""
    console.print(f"latency: {len(rows)} model(s) round-robin, about {cfg.min_run_time:g} s each", highlight=False)
    for row, lat in zip(rows, latencies(models, cfg.batch_size, window, text.device, cfg.timing)):
        row.update(lat.columns())
    decoders = [(row, model) for row, model in zip(rows, models) if not row["decode_note"]]
    if decoders:
        console.print(f"decoding: {len(decoders)} model(s) round-robin, about {cfg.min_run_time:g} s each",
                      highlight=False)
    for (row, _), lat in zip(decoders, decode_latencies([m for _, m in decoders], text, cfg.timing)):
        row.update(lat)


def _controller(model: nn.Module, given: str) -> Controller | None:
    """The model's controller; None for a model without one by design (Dense, FixedDepth: its family says so), a
    refusal for one whose controller fcaudit does not find (it would read as a model with nothing to decide)."""
    family = families.for_model(model)
    if family is not None and family.ungated(model):
        return None
    try:
        return families.controller_for(model)
    except FcauditError as e:
        reason = str(e).split(";")[0]  # what is missing; the route of the audit's message is not this command's
        raise FcauditError(f"{given} loads, but fcaudit finds no controller in it ({reason}): describe it with "
                           "fca.Controller.from_modules(model, 'path.*', ...) and measure it in Python with "
                           "fca.execution(model, controller, windows)") from None
