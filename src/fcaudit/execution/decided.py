"""Question 3 for any model fcaudit audits: what its controller decided, beside what the forward pass computed. The
two differ exactly where dynamic parameterization is taken for dynamic inference: a router that picks k of T tokens
but masks the others still computes every row; a halting layer that stops at step 1.5 on average but runs the batch
until its last token halts computes every step.

- decided: the share of the work the controller's decisions select, from its captured decisions and its kinds
  (`Description.decided`: tokens chosen, (layer, token) pairs a depth controller runs, experts per token of E); 1.0
  for soft gates and mixtures, which decide nothing away.
- executed: observed on the live forward (fcaudit.execution.blocks): the rows that entered the computing modules of
  the blocks the controller governs (a token router's blocks; every block otherwise), the controller's own modules
  left out, over one row per token and decision unit (a block, a halting step); for expert routers the FLOPs inside
  their experts over those of every token running every expert, or the rows of the experts given as `blocks`.
- FLOPs per token (torch.utils.flop_counter) of the live model, of the same decisions replayed with the controller
  disabled (what the controller itself costs), and of a reference the user gives (a Dense baseline); latency of
  each, interleaved (fcaudit.execution.latency); decoding with a KV cache where the model has one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Iterator

import pandas as pd
import torch
from torch import nn

from fcaudit import families
from fcaudit.controllers.controller import Controller
from fcaudit.controllers.rows import counting_rows
from fcaudit.errors import FcauditError
from fcaudit.execution.blocks import block_modules, block_pattern, row_fraction, uncalled
from fcaudit.execution.conditions import Replaying
from fcaudit.execution.decode import decode_latencies, decoding_columns
from fcaudit.execution.flops import flops
from fcaudit.execution.latency import Timing, timed
from fcaudit.threads import using_threads

SAVING = 0.99  # executed below this share of the governed rows: a saving was realized


def verdict(decided: float, executed: float) -> str:
    """Decided and executed side by side, and whether the model realized the saving its controller decided."""
    line = f"decided {decided:.1%} of the governed work, executed {executed:.1%} (observed)"
    if executed > 1 + 1e-3:  # rows over one row per token per block
        line += " (over 100%: a block computes a token more than once, as a looped layer runs it once per pass)"
    if decided >= SAVING:
        return line + ": nothing was decided away"
    if executed > decided + 1e-3 and executed >= SAVING:
        return line + ": no saving realized (the model computed what its controller decided away)"
    if executed > decided + 1e-3:
        return line + ": part of the decided saving realized"
    return line + ": the decided saving realized"


@dataclass(frozen=True)
class ExecutionSettings:
    """How `fca.execution` measures: checked once, before anything runs.

    Examples
    --------
    >>> fca.ExecutionSettings(batch_size=4, threads=1).batch_size
    4
    >>> fca.ExecutionSettings(batch_size=0)
    Traceback (most recent call last):
    ...
    fcaudit.errors.FcauditError: batch_size=0: pass a positive integer, e.g. batch_size=8
    """

    batch_size: int = 8  # windows per measured batch (the first ones given)
    blocks: str | None = None  # the path pattern of the model's blocks; None: its largest ModuleList's children
    min_run_time: float = 1.0  # seconds of timing per variant
    threads: int | None = 1  # torch CPU threads while measuring (restored afterwards); None: as set
    decode: bool = True  # also decode one window token by token, where the model has a KV cache

    def __post_init__(self):
        if not (isinstance(self.batch_size, int) and not isinstance(self.batch_size, bool) and self.batch_size >= 1):
            raise FcauditError(f"batch_size={self.batch_size!r}: pass a positive integer, e.g. batch_size=8")
        if self.threads is not None and not (isinstance(self.threads, int) and self.threads >= 1):
            raise FcauditError(f"threads={self.threads!r}: pass a positive integer, or None for torch's setting")
        Timing(self.min_run_time)  # its own one-line refusal


@dataclass(frozen=True)
class Variant:
    """One forward variant measured: FLOPs per token and latency per batch (median, interquartile range)."""

    label: str
    flops_per_token: float
    latency_ms: float = math.nan
    latency_iqr_ms: float = math.nan
    latency_noisy: bool = False


@dataclass(frozen=True, eq=False)
class ExecutionResult(Mapping):
    """Decided against executed work, and the variants measured ("live", "replayed": the same decisions with the
    controller disabled, "reference" where one was given), by name.

    Examples
    --------
    `fca.audit`'s example model, with its Dense twin as the reference:

    >>> ids = torch.randint(0, 256, (4, 16))
    >>> dense = GatedLM().eval()
    >>> for g in dense.gates:  # a gate fixed open: the same blocks, no controller work to speak of
    ...     _ = nn.init.zeros_(g[0].weight), nn.init.constant_(g[0].bias, 30.0)
    >>> r = fca.execution(model, ctrl, ids, blocks="mlps.*", reference=dense, min_run_time=0.02)
    >>> sorted(r), r["live"].flops_per_token >= r["replayed"].flops_per_token
    (['live', 'reference', 'replayed'], True)
    >>> list(r.to_frame().columns)[:3]
    ['variant', 'label', 'flops_per_token']
    """

    decided: float  # share of the governed work the controller's decisions select
    executed: float  # share of the governed rows the forward pass computed, observed
    blocks: tuple[str, ...]  # the blocks the controller governs
    executed_by_block: tuple[float, ...]  # rows each computed, over one row per token (a shared block: per step)
    variants: dict[str, Variant]
    decoding: dict  # decoding columns (fcaudit.execution.decode), or {"decode_note": why not}

    def __getitem__(self, name: str) -> Variant:
        if name not in self.variants:
            raise KeyError(f"{name!r}: this result holds {', '.join(self.variants)}")
        return self.variants[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.variants)

    def __len__(self) -> int:
        return len(self.variants)

    def _vs(self, name: str, column: str) -> float:
        return getattr(self["live"], column) / getattr(self[name], column) if name in self else math.nan

    @property
    def flops_vs_reference(self) -> float:
        return self._vs("reference", "flops_per_token")

    @property
    def latency_vs_reference(self) -> float:
        return self._vs("reference", "latency_ms")

    @property
    def controller_flops(self) -> float:
        """Live FLOPs over those of the same decisions replayed without the controller: what it costs itself."""
        return self._vs("replayed", "flops_per_token")

    @property
    def controller_latency(self) -> float:
        return self._vs("replayed", "latency_ms")

    @property
    def latency_note(self) -> str | None:
        """Where the replayed pass is slower than the live one beyond both spreads: the replay's own work (patched
        calls; an op site watching every torch function its method runs) then exceeds what the controller computes,
        and `controller_latency` measures fcaudit, not the controller. None elsewhere."""
        live, replayed = self["live"], self.variants.get("replayed")
        if replayed is None or math.isnan(live.latency_ms) or math.isnan(replayed.latency_ms):
            return None
        spread = lambda v: 0.0 if math.isnan(v.latency_iqr_ms) else v.latency_iqr_ms  # noqa: E731
        if live.latency_ms + spread(live) >= replayed.latency_ms - spread(replayed):
            return None
        return ("note: the replayed pass is slower than the live one: replaying (fcaudit's patched calls, an op site's "
                "watch over every torch function of its method) costs more here than the controller computes, so "
                "the latency ratio measures the replay, not the controller's cost; its FLOPs ratio does")

    @property
    def verdict(self) -> str:
        return verdict(self.decided, self.executed)

    def to_frame(self) -> pd.DataFrame:
        """One row per variant: label, FLOPs per token, latency, and each against the live model."""
        rows = [{"variant": name, **{f.name: getattr(v, f.name) for f in fields(v)}}
                for name, v in self.variants.items()]
        df = pd.DataFrame(rows)
        live = self["live"]
        df["flops_vs_live"] = df["flops_per_token"] / live.flops_per_token
        df["latency_vs_live"] = df["latency_ms"] / live.latency_ms
        return df

    def to_json(self) -> dict:
        """What an audit's execution.json holds (`from_json` reads it back)."""
        return {"decided": self.decided, "executed": self.executed, "verdict": self.verdict,
                "blocks": list(self.blocks), "executed_by_block": list(self.executed_by_block),
                "variants": {name: {f.name: getattr(v, f.name) for f in fields(v)}
                             for name, v in self.variants.items()},
                "decoding": dict(self.decoding)}

    @classmethod
    def from_json(cls, d: dict) -> ExecutionResult:
        return cls(float(d["decided"]), float(d["executed"]), tuple(d["blocks"]), tuple(d["executed_by_block"]),
                   {name: Variant(**{k: math.nan if x is None else x for k, x in v.items()})
                    for name, v in d["variants"].items()}, dict(d["decoding"]))

    def _lines(self) -> list[str]:
        lines = [self.verdict, f"blocks governed: {len(self.blocks)} ({', '.join(self.blocks[:4])}"
                 f"{', ...' if len(self.blocks) > 4 else ''})"]
        for name, v in self.variants.items():
            timed_ = "" if math.isnan(v.latency_ms) else f"  {v.latency_ms:9.3f} ms/batch"
            lines.append(f"  {name:<10} {v.flops_per_token:12.4g} FLOPs/token{timed_}"
                         + (" (noisy)" if v.latency_noisy else ""))
        latency = "" if math.isnan(self.controller_latency) else f", latency x{self.controller_latency:.3f}"
        lines.append(f"controller's own cost: FLOPs x{self.controller_flops:.3f}{latency}"
                     " (live / replayed with the controller disabled)")
        if (note := self.latency_note) is not None:
            lines.append(note)
        if "reference" in self:
            lines.append(f"vs reference: FLOPs x{self.flops_vs_reference:.3f}, "
                         f"latency x{self.latency_vs_reference:.3f}")
        note = self.decoding.get("decode_note")
        lines.append(f"decoding: {note}" if note else
                     f"decoding: {self.decoding['executed_layer_fraction']:.1%} of (block, token) pairs computed, "
                     f"{self.decoding['decode_ms_per_token']:.3f} ms per token")
        return lines

    def __repr__(self) -> str:
        return "ExecutionResult\n" + "\n".join(self._lines())

    def _repr_html_(self) -> str:
        from html import escape

        return ("<p><b>Execution</b>: " + escape(self.verdict) + "</p>"
                + self.to_frame().to_html(index=False, float_format=lambda x: f"{x:.4g}"))

    def plot(self, ax=None):
        """Decided and executed share of the governed work, side by side (a matplotlib Axes)."""
        import matplotlib.pyplot as plt

        ax = ax or plt.subplots(figsize=(4, 2.2))[1]
        ax.barh(["executed (observed)", "decided"], [self.executed, self.decided], color=["#555", "#999"])
        ax.set_xlim(0, 1)
        ax.set_xlabel("share of the governed work")
        return ax


def _ids(windows) -> torch.Tensor:
    ids = getattr(windows, "ids", windows)
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point() and ids.numel()):
        raise FcauditError("windows: pass token ids [windows, tokens] (an int64 tensor or fca.windows' WindowSet)")
    return ids


def _observed(model: nn.Module, controller: Controller, ids: torch.Tensor,
              pattern: str) -> tuple[list, tuple[str, ...], tuple[float, ...], float, set]:
    """(captured decisions, the governed blocks, the rows each computed over one row per token, the share of the
    governed rows computed, the modules the model does not call) of one live forward. Token routers govern the blocks holding them, one row per token per
    router; other controllers every block, one row per token each, and a depth controller its most units per token
    (blocks, or the steps of a shared block). The controller's own modules are left out of a block's rows."""
    info, blocks = controller.info, block_modules(model, pattern)
    with torch.inference_mode(), controller.capture(*ids.shape) as found, \
            counting_rows([m for _, m in blocks]) as counts:
        model(ids)
    sites = dict.fromkeys((n for n, _ in blocks), 0)
    for site in controller.sites:
        name = next((n for n in sites if site.path == n or site.path.startswith(n + ".")), None)
        if name is not None:
            sites[name] += 1
    own = {m for s in controller.sites if s.op is None and s.method == "forward" for m in s.module.modules()}
    counts = {n: {m: r for m, r in count.items() if m not in own} for (n, _), count in zip(blocks, counts)}
    idle = _never_called(model, controller, ids, blocks, found, list(counts.values()))
    if not any(counts.values()):
        raise FcauditError(f"the blocks of {pattern!r} hold no weights but the controller's own: pass blocks= the "
                           "path pattern of the blocks its decisions govern")
    ran = {n: row_fraction(count, ids.numel(), idle) for n, count in counts.items()}
    tokens = info.lead.execution == "tokens"  # a token router governs its own blocks, any other kind every block
    governed = tuple(n for n in ran if sites[n] or not tokens)
    if not governed:
        raise FcauditError(f"no token router of the controller lies in a block of {pattern!r} (e.g. "
                           f"{next(iter(sites))}): pass blocks= the path pattern of the blocks its routers govern")
    possible = info.top(found) if info.depth else sum(sites[n] for n in governed) if tokens else len(governed)
    return found, governed, tuple(ran[n] for n in governed), sum(ran[n] for n in governed) / possible, idle


def _never_called(model: nn.Module, controller: Controller, ids: torch.Tensor, blocks: list, found,
                  counts: list) -> set[nn.Module]:
    """The modules of `counts` (the live pass's) that take no row with nothing decided away either (the controller's
    `everything` replayed): `uncalled`. One more pass, only where some module took no row live."""
    everything = controller.info.everything(found) if any(not r for c in counts for r in c.values()) else None
    if everything is None:
        return set()
    with torch.inference_mode(), counting_rows([m for _, m in blocks]) as again:
        Replaying(model, controller, everything, found.decoding)(ids)
    return uncalled(counts, again)


def _experts_executed(model: nn.Module, controller: Controller, ids: torch.Tensor) -> float:
    """Expert routers: the FLOPs counted inside the experts over those of every token running every expert (fused
    experts take every row and index inside, so rows cannot tell); a family that knows its experts measures it."""
    family = families.for_model(model)
    if family is None or family.execution is None:
        raise FcauditError(f"{type(model).__name__}'s experts are not ones fcaudit finds (Hugging Face MoE blocks): "
                           "pass blocks= the path pattern of its experts, e.g. blocks='layers.*.experts.*'")
    return float(family.execution(model, ids, controller)["active_expert_fraction"])


@dataclass(frozen=True)
class Observed:
    """One live forward's decided and executed work (see the module's docstring), with the decisions captured."""

    decided: float
    executed: float
    blocks: tuple[str, ...]  # the blocks the controller governs
    executed_by_block: tuple[float, ...]  # rows each computed, over one row per token (a shared block: per step)
    found: list = field(repr=False)  # the captured decisions (canonical, with what a replay decodes them with)
    idle: frozenset = field(default=frozenset(), repr=False)  # modules the model does not call (blocks.uncalled)

    @property
    def verdict(self) -> str:
        return verdict(self.decided, self.executed)


def observe(model: nn.Module, controller: Controller, ids: torch.Tensor, blocks: str | None = None) -> Observed:
    """Decided and executed work of model(ids): the rows of the blocks matching `blocks` (default: the children of
    the model's largest ModuleList); for expert routers without `blocks`, the FLOPs inside their experts."""
    found, governed, fractions, executed, idle = _observed(model, controller, ids, blocks or block_pattern(model))
    info = controller.info
    if info.lead.execution == "experts" and blocks is None:
        executed = _experts_executed(model, controller, ids)
    return Observed(info.decided(found), executed, governed, fractions, found, frozenset(idle))


AUDITED = "the first evaluation batch of an audit: FLOPs counted, not timed"


def audit_execution(model: nn.Module, controller: Controller, ids: torch.Tensor) -> dict:
    """execution.json of `fca.audit(..., execution=True)`, measured on its first evaluation batch `ids`: decided and
    executed work, FLOPs per token live and with the same decisions replayed, the controller disabled
    (`ExecutionResult.to_json`); or {"reason": the one line saying why fcaudit cannot tell}, since the audit's own
    results stand either way. Nothing is timed (a latency differs between runs; these numbers do not) or decoded."""
    try:
        seen = observe(model, controller, ids)
        counted = {"live": flops(model, ids), "replayed": flops(Replaying(model, controller, seen.found), ids)}
    except FcauditError as e:  # the audit takes no block pattern: fca.execution does
        return {"reason": " ".join(str(e).split()) + " (in fca.execution(model, controller, windows, blocks=...))"}
    labels = {"live": "the model, controller live", "replayed": "the same decisions replayed, controller off"}
    return ExecutionResult(seen.decided, seen.executed, seen.blocks, seen.executed_by_block,
                           {name: Variant(labels[name], f) for name, f in counted.items()},
                           {"decode_note": f"not measured ({AUDITED})"}).to_json()


def execution(model: nn.Module, controller: Controller, windows, *, reference: nn.Module | None = None,
              config: ExecutionSettings | None = None, **settings) -> ExecutionResult:
    """What the controller decided and what the model computed, on the first `batch_size` windows.

    Parameters
    ----------
    model, controller
        As `fca.audit` takes them.
    windows
        Token ids [windows, tokens], or `fca.windows`' evaluation WindowSet.
    reference
        A model that runs everything (a Dense baseline of the same shape), for FLOPs and latency ratios; None: the
        model itself, its controller replaying decisions that decide nothing away (every token, no exit, every block;
        its own for soft kinds), where its kinds have such decisions (not for top-k experts or halting weights).
    config, **settings
        `ExecutionSettings` (batch_size, blocks, min_run_time, threads, decode); settings replace its fields.

    Examples
    --------
    With `model` and `ctrl` from `fca.audit`'s example: its soft gates scale each block's update and skip nothing, so
    they decide nothing away and pay for themselves:

    >>> ids = torch.randint(0, 256, (4, 16))
    >>> r = fca.execution(model, ctrl, ids, blocks="mlps.*", min_run_time=0.02)
    >>> r.decided, r.executed, r.controller_flops > 1
    (1.0, 1.0, True)
    >>> r.verdict
    'decided 100.0% of the governed work, executed 100.0% (observed): nothing was decided away'
    """
    cfg = ExecutionSettings(**{**({f.name: getattr(config, f.name) for f in fields(config)} if config else {}),
                               **settings})
    ids = _ids(windows)[:cfg.batch_size]
    with using_threads(cfg.threads):
        seen = observe(model, controller, ids, cfg.blocks)
        runs = {"live": model, "replayed": Replaying(model, controller, seen.found)}
        everything = controller.info.everything(seen.found) if reference is None else None
        if reference is not None or everything is not None:
            runs["reference"] = reference or Replaying(model, controller, everything, seen.found.decoding)
        labels = {"live": "the model, controller live", "replayed": "the same decisions replayed, controller off",
                  "reference": ("the reference given" if reference is not None else
                                "everything run: its decisions replayed with nothing decided away")}
        counted = {name: flops(run, ids) for name, run in runs.items()}
        lats = timed([(run, ids) for run in runs.values()], Timing(cfg.min_run_time))
        variants = {name: Variant(labels[name], counted[name], lat.ms_per_batch, lat.iqr_ms, lat.noisy)
                    for name, lat in zip(runs, lats)}
        decoding = decoding_columns(model, ids[:1]) if cfg.decode else {"decode_note": "not asked (decode=False)"}
        if not decoding["decode_note"]:  # it decodes: its time per token too, as `fcaudit execution` measures it
            decoding.update(decode_latencies([model], ids[:1], Timing(cfg.min_run_time))[0])
    return ExecutionResult(seen.decided, seen.executed, seen.blocks, seen.executed_by_block, variants, decoding)
