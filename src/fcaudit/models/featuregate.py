"""The FeatureGate model family: a byte-level pre-LN decoder whose residual updates are scaled by a gate.

    h[l+1, t] = h[l, t] + g[l, t](x) * F_l(h_l)[t],     F_l(h) = a + m,  a = attn(ln1(h)),  m = mlp(ln2(h + a))

F_l is the whole block update (attention and MLP together), so one scalar per token and layer scales it.
Variants (GPTConfig.variant), all executing every block:

    dense            g = 1: no gate module and no multiplication (`block.gate is None`)
    fixeddepth       dense with n_layer = k blocks
    uniform          one learned coefficient sigmoid(w) shared by every layer (one tied parameter)
    uniform-fixed    a constant g = gate_value (default 0.60)
    uniform-matched  the same constant module, with gate_value set to a FeatureGate model's measured gate mass
    layerstatic      one learned coefficient sigmoid(w_l) per layer
    featuregate      a per-token controller (FeatureGate below) maps features of block l to g in (0, 1)

Every gated variant's gate is the module `model.blocks[l].gate`; its forward returns g of shape [B, T] (constants
are expanded), so an audit treats all variants alike: replacing that forward disables the controller, feature
computation included, and leaves the output path (the residual stream and the attention, computed by the same
operations whether or not the gate runs) untouched. Learned gates start at sigmoid(w) = 0.6.

The controller's features need statistics of the attention of this block and of the previous one, in float32, from
the q, k that the model loop passes to it explicitly; no pass holds a [T, T] map. Where they come from:

- In inference on the CPU in float32 (no gradient, no autocast), a FeatureGate block computes its attention output
  itself, in one pass over tiles of scores (`attend`) that also gives the lse (logsumexp of the scores) and, when
  the block's gate is going to run, the gate's statistics: the output P V and the statistics' P K' come from the
  same P. The output equals F.scaled_dot_product_attention's within float32 rounding (tests/test_featuregate.py);
  capture and replay compute it by the same operations, so the exact replay check holds bit for bit. That pass is
  the C++ kernel of models/kernel.py (one loop per map, built on first use) where it takes the tensors, else torch
  ops over tiles of scores (`_tile_pass`): the same formulas, the same values within float32 rounding.
- With gradients (training) on the CPU in float32, the attention calls torch's fused kernel itself, which returns the
  lse with the output (the same kernel and the same output bits as F.scaled_dot_product_attention), and the gate's
  own pass knows the lse (log P = S - lse straight from the scores; attention_stats).
- Elsewhere (CUDA, autocast) the output path is F.scaled_dot_product_attention and the gate's pass computes the lse.

The model loop creates a fresh GateCarry in every FeatureGateGPT.forward and passes it to every gate as its last
argument: each block leaves its lse (and statistics) there, the gate of block l reads block l-1's lse and flattened
q, k from it (nothing is stored on modules, so nothing outlives the pass). The carry is keyed by the (q, k) tensors:
where it does not hold what a gate needs (the gate is called on its own), the gate recomputes it from q, k, so a
gate's features never depend on which other gates ran. The controller's extra cost is O(B H T^2 Dh) work per block:
in inference on a CPU the product P K' and a sum over the scores beside the output's own, in the kernel's one loop
(benchmarks/forward_speed.py measures the whole forward; reference_gate_features keeps the first, map-based version).

The LM head is tied to the token embedding (as in GPT-2/nanoGPT); with bias-free linear layers and block_size 512
this gives the paper's parameter counts (paper-76m: 75.94M, paper-504m: 504.3M; `model.n_params()`).
"""

import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Iterator, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.utils._python_dispatch import _get_current_dispatch_mode

from fcaudit.errors import FcauditError
from fcaudit.models import kernel

VARIANTS = ("dense", "uniform", "uniform-fixed", "uniform-matched", "layerstatic", "fixeddepth", "featuregate")
GATE_INIT = 0.6  # learned gates start here (the paper's gate masses sit near 0.6)
N_FEATURES = 4


@dataclass
class GPTConfig:
    variant: str = "featuregate"
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    block_size: int = 128
    vocab_size: int = 256
    gate_value: float = 0.6  # the constant of uniform-fixed / uniform-matched
    gate_hidden: int = 16  # hidden width of the FeatureGate controller MLP
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise FcauditError(f"unknown model variant {self.variant!r}: use one of {', '.join(VARIANTS)}")
        # config.json is user-editable: check types and ranges here rather than fail deep inside a forward pass
        for name, low in (("n_layer", 1), ("n_head", 1), ("d_model", 1), ("block_size", 2), ("vocab_size", 1),
                          ("gate_hidden", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise FcauditError(f"GPTConfig {name}={v!r} is invalid: set {name} to an integer >= {low} in "
                                   "config.json")
        for name in ("gate_value", "norm_eps"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise FcauditError(f"GPTConfig {name}={v!r} is invalid: set {name} to a finite number in config.json")
        if not self.norm_eps > 0:
            raise FcauditError(f"GPTConfig norm_eps={self.norm_eps!r} is invalid: set norm_eps > 0 (e.g. 1e-5) "
                               "in config.json")
        if self.d_model % self.n_head:
            raise FcauditError(f"d_model {self.d_model} is not divisible by n_head {self.n_head}: change one of them")
        if not 0.0 < self.gate_value < 1.0:
            raise FcauditError(f"gate_value {self.gate_value} is outside (0, 1): pass a gate value between 0 and 1")

    @property
    def gated(self) -> bool:
        return self.variant not in ("dense", "fixeddepth")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, n_head=2, d_model=32, block_size=64, gate_hidden=8),
    "demo": GPTConfig(n_layer=4, n_head=4, d_model=96, block_size=128, gate_hidden=16),
    "paper-76m": GPTConfig(n_layer=24, n_head=8, d_model=512, block_size=512, gate_hidden=32),
    "paper-504m": GPTConfig(n_layer=40, n_head=16, d_model=1024, block_size=512, gate_hidden=32),
}


def config_for(preset: str, variant: str, *, gate_value: float = 0.6, fixed_depth: int | None = None) -> GPTConfig:
    """The preset's architecture with the given variant; fixeddepth keeps the first `fixed_depth` blocks."""
    if preset not in PRESETS:
        raise FcauditError(f"unknown preset {preset!r}: use one of {', '.join(PRESETS)}")
    cfg = replace(PRESETS[preset], variant=variant, gate_value=gate_value)
    if variant == "fixeddepth":
        if fixed_depth is None or fixed_depth < 1:
            raise FcauditError("fixeddepth needs its number of blocks: pass --depth K (fixed_depth, K >= 1)")
        cfg = replace(cfg, n_layer=fixed_depth)
    return cfg


def fused_lse_applies(q: torch.Tensor) -> bool:
    """Whether the output path's attention runs torch's fused CPU kernel directly and gets its lse with it: float32
    CPU tensors outside autocast (there F.scaled_dot_product_attention dispatches to that same kernel, so the output
    is the same bit for bit; tests/test_featuregate.py checks it)."""
    return q.device.type == "cpu" and q.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")


def _fused_attention(q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention and its lse [B, H, T] from torch's fused CPU kernel (flash attention for the CPU)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)


_ATTEND = [True]  # cleared by fused_output()


def attend_applies(q: torch.Tensor) -> bool:
    """Whether a FeatureGate block computes its attention output with its gate's statistics (`attend`): inference
    (no gradient: the tiled pass keeps no activations for a backward) on the CPU in float32 outside autocast."""
    return _ATTEND[0] and fused_lse_applies(q) and not torch.is_grad_enabled()


@contextmanager
def fused_output() -> Iterator[None]:
    """Within it FeatureGate blocks take their output from the fused kernel in inference too. For FLOP counting
    (execution.measure.flops): the counter counts a fused attention kernel over the full T x T square, but `attend`'s
    matrix products over the causal tiles only, so Dense's and FeatureGate's counts would not compare."""
    saved, _ATTEND[0] = _ATTEND[0], False
    try:
        yield
    finally:
        _ATTEND[0] = saved


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, carry: "GateCarry | None" = None, prev: tuple | None = None,
                stats: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The attention output [B, T, D], the per-head queries and keys [B, H, T, Dh] (for the gate) and, where the
        fused CPU kernel or `attend` runs, the lse of its scores [B, H, T] (else None).

        With a carry (a FeatureGate block) where `attend_applies`, the output comes from `attend`, which leaves the
        lse and, with `stats`, the gate's statistics against the previous block's (q, k) `prev` in the carry."""
        q, k, v = rearrange(self.qkv(x), "b t (three h d) -> three b h t d", three=3, h=self.n_head)
        if carry is not None and attend_applies(q):
            cross = None if prev is None or prev[0] is None else carry.attention(*prev)
            att = carry.attention(q, k)
            y, lse = attend(att, v, cross, stats), att.lse
        elif fused_lse_applies(q):
            y, lse = _fused_attention(q, k, v)
        else:
            y, lse = F.scaled_dot_product_attention(q, k, v, is_causal=True), None
        return self.proj(rearrange(y, "b h t d -> b t (h d)")), q, k, lse


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


@dataclass(eq=False)
class Attention:
    """What the features need of one block's causal attention: its lse [B, H, T] and its float32 queries (times
    1/sqrt(Dh)) and keys, flattened to [B*H, T, Dh] for the tiled products; each filled when first needed. `stats`:
    the gate's AttentionStats from the block's own pass (`attend`), with the Attention they were crossed with."""

    q: torch.Tensor
    k: torch.Tensor
    lse: torch.Tensor | None = None
    flat: tuple[torch.Tensor, torch.Tensor] | None = None
    stats: "tuple[Attention | None, AttentionStats] | None" = None

    def lse_(self) -> torch.Tensor:
        """The lse as a block's gate gets it: from the output path, else as attention_stats makes it."""
        if self.lse is None:
            attention_stats(self)
        return self.lse

    def flat_(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.flat is None:
            B, H, T, Dh = self.q.shape
            flat = lambda x, s=None: (x.float() if s is None else x.float() * s).reshape(B * H, T, Dh)  # noqa: E731
            self.flat = flat(self.q, Dh ** -0.5), flat(self.k)
        return self.flat


@dataclass
class GateCarry:
    """What one forward pass hands on between blocks: the Attention of the last two blocks (each block's lse from
    its output path where `attend` or the fused kernel gives it, its gate's statistics where `attend` made them, its
    flattened q and k once made), keyed by that block's q and k, and the map the reference features keep (`stats`).

    FeatureGateGPT.forward creates a fresh one per pass (never stored on a module). Keys are compared by identity,
    so what is kept is only reused for exactly the tensors it was computed from.
    """

    seen: list[Attention] = field(default_factory=list)
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    stats: object = None

    def attention(self, q: torch.Tensor, k: torch.Tensor) -> Attention:
        """The Attention of (q, k): the one kept, or a new one that is kept (with the previous block's)."""
        for a in self.seen:
            if a.q is q and a.k is k:
                return a
        self.seen = self.seen[-1:] + [Attention(q, k)]
        return self.seen[-1]

    def stats_of(self, q: torch.Tensor, k: torch.Tensor):
        return self.stats if self.q is q and self.k is k else None

    def keep(self, q: torch.Tensor, k: torch.Tensor, stats) -> None:
        self.q, self.k, self.stats = q, k, stats


MASKED_SCORE = -1e30  # future keys: finite, so P = 0 there and P * score = 0 (never 0 * -inf = nan)

# Scores held at a time by attention_stats, in float32 elements: 2 MiB keeps a CPU tile in cache; on a GPU one tile
# covers a paper-size block (fewer kernel launches).
TILE_ELEMENTS = {"cpu": 1 << 19, "cuda": 1 << 26}
TILE_ROWS_CPU = (32, 64)  # query rows per CPU tile: a quarter of the window, within these bounds (see _tiling)


def _tiling(n_maps: int, T: int, device: torch.device) -> tuple[int, int]:
    """(query rows, maps) per tile; it depends only on shapes and device. Each CPU tile also computes the masked half
    of its diagonal square in vain: a third of its work at T = 128 with 64 rows, a fifth with 32 (the demo model's
    forward 2-12% faster in three interleaved runs), while at T = 512 fewer rows only add calls (32: 2% slower)."""
    low, high = TILE_ROWS_CPU
    rows = min(T, max(low, min(high, T // 4))) if device.type == "cpu" else T
    return rows, max(1, min(n_maps, TILE_ELEMENTS.get(device.type, TILE_ELEMENTS["cpu"]) // (rows * T)))


def _score_tiles(q: torch.Tensor, k: torch.Tensor):
    """(maps, query rows, masked scores [maps, rows, keys]) over the tiles of flat (q, k) [N, T, Dh]: each tile's
    keys end at its last row (causality) and future keys hold MASKED_SCORE, so only a cache-sized tile of scores
    exists at a time, never the [N, T, T] map."""
    N, T, _ = q.shape
    rows, maps = _tiling(N, T, q.device)
    future = torch.full((rows, rows), MASKED_SCORE, device=q.device).triu(1)
    for m0 in range(0, N, maps):
        m = slice(m0, m0 + maps)
        for t0 in range(0, T, rows):
            t = slice(t0, min(T, t0 + rows))
            x = torch.bmm(q[m, t], k[m, : t.stop].transpose(1, 2))
            x[:, :, t0:].add_(future[: x.size(1), : x.size(1)])  # the tile's own diagonal square holds the future
            yield m, t, x


class AttentionStats(NamedTuple):
    """Per-head statistics of one block's causal attention P = softmax_{s <= t}(S), S = q k^T / sqrt(Dh), [B, H, T]."""

    lse: torch.Tensor  # logsumexp_{s <= t} S[t, s]
    entropy: torch.Tensor  # -sum_s P log P
    cross_score: torch.Tensor | None  # sum_s P S' for the scores S' = q' k'^T / sqrt(Dh) of another block


def attention_stats(att: Attention, cross: Attention | None = None) -> AttentionStats:
    """The AttentionStats of a block's attention, with cross_score for another block's; float32 whatever the dtypes.

    The ones its block's own pass left (`attend`), else one pass over tiles of scores (`_tile_pass`). With the lse
    known, log P = S - lse comes straight from the scores, P = softmax(log P) (renormalizing changes P by rounding
    only) and H = -sum_s P log P. The lse is known from the output path, or, where the fused kernel applies (a gate
    called on its own), from that kernel without the values (the lse does not depend on them: the same bits as the
    output path's). Else the pass computes it (see `_tile_pass`). Either way the entropy sum works with values of
    the size of log P, so it does not cancel; sum_s P S' = q'_t . (P K')_t.
    """
    if att.stats is not None and att.stats[0] is cross:
        return att.stats[1]
    with torch.autocast(att.q.device.type, enabled=False):
        if att.lse is None and fused_lse_applies(att.q):
            att.lse = _fused_attention(att.q, att.k, att.k)[1]
        _tile_pass(att, cross, None, True)
    return att.stats[1]


def attend(att: Attention, v: torch.Tensor, cross: Attention | None, stats: bool) -> torch.Tensor:
    """Causal attention softmax(S) V [B, H, T, Dh] of one block from one pass over tiles of its scores, which also
    leaves its lse in `att` and, with `stats`, its gate's AttentionStats (cross: the previous block's Attention).
    The output comes from the same operations whether or not `stats` is asked (the exact replay relies on it)."""
    return _tile_pass(att, cross, v, stats)


def _tile_pass(att: Attention, cross: Attention | None, v: torch.Tensor | None, stats: bool) -> torch.Tensor | None:
    """One pass over tiles of a block's scores (_score_tiles): P V [B, H, T, Dh] for values `v` (else None), the
    lse into att.lse when unknown, and with `stats` the AttentionStats into att.stats.

    With the lse unknown, each row is shifted by its maximum x = S - max first, log_z = -log max_s P comes from the
    one fused softmax (max_s P >= 1 / (t + 1): the log never underflows), lse = max + log_z and H = log_z - sum_s P x.

    With values (`attend`), where the C++ kernel takes the tensors (models/kernel.py: float32 CPU, a head size that
    is a multiple of 8), the kernel makes all of it in one loop per map instead, with the same formulas and its own
    lse. Its choice depends on q, k, v only, so the output has the same bits with or without statistics.
    """
    B, H, T, Dh = att.q.shape
    if v is not None and kernel.applies(att.q, att.k, v):
        return _kernel_pass(att, cross, v, stats)
    v = None if v is None else v.reshape(B * H, T, Dh)
    q, k = att.flat_()
    known = att.lse is not None
    lse = att.lse.reshape(B * H, T, 1) if known else q.new_empty(B * H, T, 1)
    y = None if v is None else q.new_empty(B * H, T, Dh)
    entropy = q.new_empty(B * H, T) if stats else None
    cross_score = q.new_empty(B * H, T) if stats and cross is not None else None
    if cross_score is not None:
        cq, ck = cross.flat_()
    for m, t, x in _score_tiles(q, k):
        if known:
            p = x.sub_(lse[m, t]).softmax(-1)  # x = log P
        else:
            row_max = x.amax(-1, keepdim=True)
            p = x.sub_(row_max).softmax(-1)  # x = log P + log_z
            log_z = p.amax(-1, keepdim=True).log_().neg_()
            lse[m, t] = row_max + log_z
        if y is not None:
            y[m, t] = torch.bmm(p, v[m, : t.stop])
        if not stats:
            continue
        if cross_score is not None:  # sum_s P S'[t, s] = q'_t . (P K')_t
            cross_score[m, t] = torch.bmm(p, ck[m, : t.stop]).mul_(cq[m, t]).sum(-1)
        px = x.mul_(p).sum(-1)
        entropy[m, t] = px.neg_() if known else log_z.squeeze(-1) - px
    if not known:
        att.lse = lse.view(B, H, T)
    if stats:
        view = lambda x: None if x is None else x.view(B, H, T)  # noqa: E731
        att.stats = (cross, AttentionStats(att.lse, view(entropy), view(cross_score)))
    return None if y is None else y.view(B, H, T, Dh)


def _kernel_pass(att: Attention, cross: Attention | None, v: torch.Tensor, stats: bool) -> torch.Tensor:
    """_tile_pass's work by the C++ kernel (the other block's statistics by torch ops where the kernel does not take
    its q, k: the output stays the kernel's)."""
    crossed = stats and cross is not None and kernel.applies(cross.q, cross.k)
    y, lse, entropy, cross_score = kernel.attend(att.q, att.k, v, stats and (cross is None or crossed),
                                                 *((cross.q, cross.k) if crossed else ()))
    if att.lse is None:
        att.lse = lse
    if entropy is not None:
        att.stats = (cross, AttentionStats(att.lse, entropy, cross_score))
    elif stats:
        attention_stats(att, cross)
    return y


_LOG_VISIBLE: dict[tuple[int, torch.device], torch.Tensor] = {}


def _log_visible(T: int, device: torch.device) -> torch.Tensor:
    """log(t + 1) for t < T (t + 1 keys are visible at position t), float32; kept once made per window length and
    device (a plain tensor even when first asked within inference_mode, so training may use it too). Under a
    dispatch mode (fake tensors of torch.compile's tracing, FLOP counters) made afresh and not kept: a kept tensor
    must not mix with the mode's tensors, nor one of the mode's be kept."""
    moded = _get_current_dispatch_mode() is not None
    log = None if moded else _LOG_VISIBLE.get((T, device))
    if log is None:
        with torch.inference_mode(False), torch.no_grad():
            log = torch.arange(1, T + 1, device=device, dtype=torch.float32).log_()
        if not moded:
            _LOG_VISIBLE[T, device] = log
    return log


def _finish(entropy_h, kl_h, lse, h, update) -> torch.Tensor:
    """[B, T, 4] from per-head entropy, KL (None in the first block) and lse [B, H, T]; shared with the reference.
    Both are >= 0 by definition; clamping removes rounding noise (e.g. -1e-7 for a one-hot attention row). The
    entropy is 0 at t = 0 (one visible key); elsewhere divided by log(t + 1) >= log 2."""
    log_visible = _log_visible(lse.size(-1), lse.device)
    entropy = entropy_h.mean(1).clamp_min_(0.0).div_(log_visible)  # [B, T]
    entropy[:, 0] = 0.0  # 0 / 0 there
    kl = torch.zeros_like(entropy) if kl_h is None else kl_h.mean(1).clamp_min_(0.0)
    log_partition = (lse - log_visible).mean(1)
    update_norm = torch.linalg.vector_norm(update.float(), dim=-1).div_(
        torch.linalg.vector_norm(h.float(), dim=-1).add_(1e-6))
    return torch.stack([entropy, kl, log_partition, update_norm], dim=-1)


@torch.no_grad()
def gate_features(h, update, q, k, prev_q, prev_k, carry: GateCarry | None = None) -> torch.Tensor:
    """The four per-token features of block l, [B, T, 4], computed without gradient (detached).

    With S[b, n, t, s] = q_t . k_s / sqrt(Dh) for s <= t and P_l[b, n, t, :] = softmax_{s <= t}(S) the causal
    attention of head n in block l (recomputed here from the block's queries and keys; the output path uses the
    fused kernel instead), and lse_t = logsumexp_{s <= t} S[t, s]:

    0. entropy       mean_n H(P_l[n, t]) / log(t + 1): head-averaged attention entropy normalized by the log of the
                     number of visible keys, in [0, 1]; 0 at t = 0 (one visible key, nothing to normalize).
    1. kl            mean_n KL(P_l[n, t] || P_{l-1}[n, t]) = mean_n sum_{s <= t} P_l log(P_l / P_{l-1}): head-averaged
                     KL divergence of this block's attention from the previous block's, at the same token and
                     head index; 0 in the first block (prev_q is None).
    2. log_partition mean_n [lse_t - log(t + 1)]: the head-averaged log of the mean exponentiated score over the
                     visible keys (0 when all scores are 0).
    3. update_norm   ||F_l(h)_t|| / (||h_t|| + 1e-6): the block update's L2 norm relative to the residual stream's.

    Computed in float32 by attention_stats, a pass over tiles of query rows that never holds a [T, T] map; with
    log P_{l-1} = S' - lse_{l-1} (S' the previous block's scores),
        KL = -H - sum_s P_l log P_{l-1} = -H - sum_s P_l S' + lse_{l-1},
    and sum_s P_l S' comes from the same pass. Each lse comes from `carry` when the output path's fused kernel left
    it there, else as attention_stats makes it; the previous block's flattened q and k too when its gate made them.
    No gradient because the controller reads the block, it does not shape it: gradients reach the controller MLP
    only, so gating cannot be learned by distorting attention or update norms.
    """
    carry = carry if carry is not None else GateCarry()
    prev = None if prev_q is None else carry.attention(prev_q, prev_k)
    stats = attention_stats(carry.attention(q, k), prev)
    kl_h = None if prev is None else -stats.entropy - (stats.cross_score - prev.lse_())
    return _finish(stats.entropy, kl_h, stats.lse, h, update)


# ---- reference: the features from the materialized [B, H, T, T] map ---------------------------------------------
# The first implementation, kept as the oracle of tests/test_featuregate.py and the "before" of
# benchmarks/forward_speed.py (swap it in with `featuregate.gate_features = featuregate.reference_gate_features`,
# within `featuregate.fused_output()` for the output path it had then).

@dataclass
class AttentionMap:
    """One block's causal attention in float32, as the reference features use it (see causal_attention)."""

    shifted: torch.Tensor  # S - max_{s <= t} S on visible keys, about MASKED_SCORE on future keys, [B, H, T, T]
    log_z: torch.Tensor  # log sum_{s <= t} exp(S - max S) = -log max_s P, in [0, log(t + 1)], [B, H, T]


def causal_attention(q: torch.Tensor, k: torch.Tensor) -> tuple[AttentionMap, torch.Tensor, torch.Tensor]:
    """The attention map of (q, k), its causal probabilities P [B, H, T, T] (0 on future keys) and
    lse = logsumexp_{s <= t} S [B, H, T], in float32 whatever the autocast context."""
    B, H, T, Dh = q.shape
    future = torch.full((T, T), MASKED_SCORE, device=q.device).triu(1)
    with torch.autocast(q.device.type, enabled=False):
        q, k = (q.float() * Dh ** -0.5).reshape(B * H, T, Dh), k.float().reshape(B * H, T, Dh)
        shifted = torch.baddbmm(future, q, k.transpose(1, 2)).view(B, H, T, T)  # S + mask in one kernel
    row_max = shifted.amax(-1, keepdim=True)
    shifted.sub_(row_max)
    p = shifted.softmax(-1)
    log_z = p.amax(-1).log().neg_()
    return AttentionMap(shifted, log_z), p, row_max.squeeze(-1) + log_z


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_s a[..., s] b[..., s] as a batched matrix product: no [B, H, T, T] product tensor is materialised."""
    return (a.unsqueeze(-2) @ b.unsqueeze(-1)).flatten(-3)


@torch.no_grad()
def reference_gate_features(h, update, q, k, prev_q, prev_k, carry: GateCarry | None = None) -> torch.Tensor:
    """gate_features from the full float32 maps: with X = S - max_s S and log P = X - log_z,
    H = log_z - sum_s P X and KL = sum_s P (X - X') - log_z + log_z'; O(B H T^2) memory per block."""
    with torch.autocast(q.device.type, enabled=False):
        att, p, lse = causal_attention(q, k)
        if prev_q is not None:
            prev = carry.stats_of(prev_q, prev_k) if carry is not None else None
            if not isinstance(prev, AttentionMap):
                prev, _, _ = causal_attention(prev_q, prev_k)
            cross = row_dot(p, prev.shifted) - prev.log_z  # sum_s P_l log P_{l-1}, [B, H, T]
        if carry is not None:
            carry.keep(q, k, att)
        entropy_h = att.log_z - row_dot(p, att.shifted)
        kl_h = None if prev_q is None else -entropy_h - cross
        return _finish(entropy_h, kl_h, lse, h, update)


class FeatureGate(nn.Module):
    """The controller of one block: features (see gate_features) -> Linear -> GELU -> Linear -> sigmoid."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(N_FEATURES, cfg.gate_hidden)
        self.out = nn.Linear(cfg.gate_hidden, 1)
        nn.init.constant_(self.out.bias, math.log(GATE_INIT / (1 - GATE_INIT)))  # start near GATE_INIT

    def forward(self, h, update, q, k, prev_q, prev_k, carry: GateCarry | None = None) -> torch.Tensor:
        feats = gate_features(h, update, q, k, prev_q, prev_k, carry)  # float32 by definition
        feats = feats.to(self.fc.weight.dtype)  # a model loaded in bf16: its MLP computes in bf16 (float32: no-op)
        return torch.sigmoid(self.out(F.gelu(self.fc(feats)))).squeeze(-1)


class ScalarGate(nn.Module):
    """A learned coefficient sigmoid(logit), expanded to [B, T]. Uniform ties one logit across all blocks."""

    def __init__(self, logit: nn.Parameter):
        super().__init__()
        self.logit = logit

    def forward(self, h, update, q, k, prev_q, prev_k, carry: GateCarry | None = None) -> torch.Tensor:
        return torch.sigmoid(self.logit).expand(h.shape[:2]).contiguous()  # a real [B, T] tensor, like the others


class ConstantGate(nn.Module):
    """A fixed coefficient (uniform-fixed, uniform-matched), expanded to [B, T]."""

    def __init__(self, value: float):
        super().__init__()
        self.value = value

    def forward(self, h, update, q, k, prev_q, prev_k, carry: GateCarry | None = None) -> torch.Tensor:
        return h.new_full(h.shape[:2], self.value)

    def extra_repr(self) -> str:
        return f"value={self.value}"


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, gate: nn.Module | None):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.gate = gate

    def forward(self, h, prev_q, prev_k, carry: GateCarry):
        """Returns the new residual stream, this block's gate [B, T] (None if ungated), and its q, k.

        The gate gets the carry positionally, so any replacement forward that accepts *args keeps working.
        """
        feature_gate = isinstance(self.gate, FeatureGate)
        # its statistics are worth computing with the output only if the gate's own forward is going to run (a
        # replay replaces it, as Controller.replay does); the output is the same either way
        runs = feature_gate and getattr(self.gate.forward, "__func__", None) is FeatureGate.forward
        a, q, k, lse = self.attn(self.ln1(h), carry if feature_gate else None, (prev_q, prev_k), runs)
        update = a + self.mlp(self.ln2(h + a))
        if self.gate is None:
            return h + update, None, q, k
        if lse is not None:  # for this block's gate and the next one's, whether or not this gate runs
            carry.attention(q, k).lse = lse.detach()
        g = self.gate(h, update, q, k, prev_q, prev_k, carry)
        return h + g.unsqueeze(-1).to(update.dtype) * update, g, q, k


class FeatureGateGPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.block_size, config.d_model)
        shared = nn.Parameter(torch.tensor(math.log(GATE_INIT / (1 - GATE_INIT))))  # uniform: one tied logit
        self.blocks = nn.ModuleList(Block(config, self._make_gate(shared)) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        self.lm_head.weight = self.wte.weight  # tied head
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _make_gate(self, shared: nn.Parameter) -> nn.Module | None:
        v = self.config.variant
        if v in ("dense", "fixeddepth"):
            return None
        if v == "uniform":
            return ScalarGate(shared)
        if v == "layerstatic":
            return ScalarGate(nn.Parameter(shared.detach().clone()))
        if v in ("uniform-fixed", "uniform-matched"):
            return ConstantGate(self.config.gate_value)
        return FeatureGate(self.config)

    @staticmethod
    def _init_weights(m: nn.Module):
        if isinstance(m, nn.Linear):  # controller biases keep their own init (FeatureGate.__init__)
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def n_params(self) -> int:
        """Unique parameters (the tied head counted once), as the paper counts them."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, ids: torch.Tensor, *, return_gates: bool = False):
        """Logits [B, T, V]; with return_gates also the gates [L, B, T] (None for dense / fixeddepth)."""
        B, T = ids.shape
        if T > self.config.block_size:
            raise FcauditError(f"window of {T} tokens exceeds block_size {self.config.block_size}: use shorter windows")
        h = self.wte(ids) + self.wpe(torch.arange(T, device=ids.device))
        prev_q = prev_k = None
        carry = GateCarry()  # per pass: each block's attention map is computed once and handed to the next gate
        gates = []
        for block in self.blocks:
            h, g, prev_q, prev_k = block(h, prev_q, prev_k, carry)
            gates.append(g)
        logits = self.lm_head(self.ln_f(h))
        if not return_gates:
            return logits
        return logits, (torch.stack(gates) if self.config.gated else None)

    @torch.no_grad()
    def gate_mass(self, ids: torch.Tensor) -> float:
        """Mean gate over tokens and layers (1.0 for the ungated variants)."""
        _, gates = self(ids, return_gates=True)
        return 1.0 if gates is None else gates.float().mean().item()

