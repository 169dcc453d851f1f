"""The FeatureGate model family: a byte-level pre-LN decoder whose block updates are scaled by a gate,
h[l+1, t] = h[l, t] + g[l, t] * F_l(h_l)[t] with F_l(h) = a + mlp(ln2(h + a)), a = attn(ln1(h)).

Variants: dense (g = 1, no gate module), fixeddepth (dense with k blocks), uniform (one sigmoid(w) for all layers),
layerstatic (sigmoid(w_l) per layer), uniform-fixed / uniform-matched (a constant; matched: a FeatureGate model's gate
mass) and featuregate (a per-token controller of the block's attention features). Each gate is `blocks[l].gate`,
returning g [B, T]; every variant runs the same attention kernel, so a comparison of variants measures the gates. The
head is tied to the token embedding, which gives the paper's parameter counts (`model.n_params()`).
"""

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from fcaudit.errors import FcauditError

VARIANTS = ("dense", "uniform", "uniform-fixed", "uniform-matched", "layerstatic", "fixeddepth", "featuregate")
GATE_INIT = 0.6  # learned gates start here (the paper's gate masses sit near 0.6)
N_FEATURES = 4


def check_config(config, variants: tuple[str, ...], counts: dict[str, int]) -> None:
    """config.json is user-editable: a bad variant, integer or head count fails here, not inside a forward pass."""
    name = type(config).__name__
    if config.variant not in variants:
        raise FcauditError(f"unknown model variant {config.variant!r}: use one of {', '.join(variants)}")
    for field, low in counts.items():
        v = getattr(config, field)
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise FcauditError(f"{name} {field}={v!r} is invalid: set {field} to an integer >= {low} in config.json")
    if config.d_model % config.n_head:
        raise FcauditError(f"d_model {config.d_model} is not divisible by n_head {config.n_head}: change one of them")
    eps = config.norm_eps
    if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps) and eps > 0):
        raise FcauditError(f"{name} norm_eps={eps!r} is invalid: set norm_eps to a number > 0 (e.g. 1e-5) in "
                           "config.json")


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
        check_config(self, VARIANTS, dict(n_layer=1, n_head=1, d_model=1, block_size=2, vocab_size=1, gate_hidden=1))
        v = self.gate_value
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 < v < 1):
            raise FcauditError(f"GPTConfig gate_value={v!r} is invalid: set gate_value to a gate value between 0 and "
                               "1 in config.json")

    @property
    def gated(self) -> bool:
        return self.variant not in ("dense", "fixeddepth")


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


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention output [B, T, D] and the per-head queries and keys [B, H, T, Dh] (for the gate)."""
        q, k, v = rearrange(self.qkv(x), "b t (three h d) -> three b h t d", three=3, h=self.n_head)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(rearrange(y, "b h t d -> b t (h d)")), q, k


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


@dataclass(eq=False)
class Attention:
    """One block's causal attention as the gates read it, made per forward pass: its queries and keys [B, H, T, Dh]
    and, once a gate has computed it, the lse [B, H, T] (logsumexp of the causal scores), which the next gate reuses."""

    q: torch.Tensor
    k: torch.Tensor
    lse: torch.Tensor | None = None

    def flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 q / sqrt(Dh) and k, [B*H, T, Dh]: the operands of the tiled products."""
        B, H, T, Dh = self.q.shape
        return (self.q.float() * Dh ** -0.5).reshape(B * H, T, Dh), self.k.float().reshape(B * H, T, Dh)


MASKED_SCORE = -1e30  # future keys: finite, so P = 0 there and P * score = 0 (never 0 * -inf = nan)

# Scores held at a time (float32 elements): 2 MiB keeps a CPU tile in cache; a GPU tile covers a paper-size block.
TILE_ELEMENTS = {"cpu": 1 << 19, "cuda": 1 << 26}
TILE_ROWS_CPU = (32, 64)  # query rows per CPU tile: a quarter of the window, within these bounds


def _score_tiles(q: torch.Tensor, k: torch.Tensor):
    """(maps, query rows, masked scores [maps, rows, keys]) over the tiles of flat (q, k) [N, T, Dh]: each tile's
    keys end at its last row (causality). Fewer rows on the CPU waste less of each tile's masked diagonal square."""
    N, T, _ = q.shape
    low, high = TILE_ROWS_CPU
    rows = min(T, max(low, min(high, T // 4))) if q.device.type == "cpu" else T
    maps = max(1, min(N, TILE_ELEMENTS.get(q.device.type, TILE_ELEMENTS["cpu"]) // (rows * T)))
    future = torch.full((rows, rows), MASKED_SCORE, device=q.device).triu(1)
    for m0 in range(0, N, maps):
        m = slice(m0, m0 + maps)
        for t0 in range(0, T, rows):
            t = slice(t0, min(T, t0 + rows))
            x = torch.bmm(q[m, t], k[m, : t.stop].transpose(1, 2))
            x[:, :, t0:].add_(future[: x.size(1), : x.size(1)])  # the tile's own diagonal square holds the future
            yield m, t, x


def _tile_pass(att: Attention, cross: Attention | None = None, stats: bool = True):
    """One pass over tiles of a block's scores S: its lse into att.lse and, with `stats`, the per-head entropy
    -sum_s P log P and (with another block's `cross`) the cross score sum_s P S' = q'_t . (P K')_t, [B, H, T] each.
    With x = S - max, log_z = -log max_s P (>= -log(t + 1): no underflow), lse = max + log_z and
    H = log_z - sum_s P x: sums of terms the size of log P, which do not cancel."""
    B, H, T, _ = att.q.shape
    q, k = att.flat()
    lse = q.new_empty(B * H, T, 1)
    entropy = q.new_empty(B * H, T) if stats else None
    cross_score = q.new_empty(B * H, T) if stats and cross is not None else None
    if cross_score is not None:
        cq, ck = cross.flat()
    for m, t, x in _score_tiles(q, k):
        row_max = x.amax(-1, keepdim=True)
        p = x.sub_(row_max).softmax(-1)
        log_z = p.amax(-1, keepdim=True).log_().neg_()
        lse[m, t] = row_max + log_z
        if not stats:
            continue
        if cross_score is not None:
            cross_score[m, t] = torch.bmm(p, ck[m, : t.stop]).mul_(cq[m, t]).sum(-1)
        entropy[m, t] = log_z.squeeze(-1) - x.mul_(p).sum(-1)
    att.lse = lse.view(B, H, T)
    if not stats:
        return None, None
    return entropy.view(B, H, T), None if cross_score is None else cross_score.view(B, H, T)


def _finish(entropy_h, kl_h, lse, h, update) -> torch.Tensor:
    """[B, T, 4] from per-head entropy, KL (None in the first block) and lse [B, H, T]; entropy and KL are >= 0, so
    clamping removes only rounding noise (e.g. -1e-7 for a one-hot attention row)."""
    log_visible = torch.arange(1, lse.size(-1) + 1, device=lse.device, dtype=torch.float32).log_()
    entropy = entropy_h.mean(1).clamp_min_(0.0).div_(log_visible)  # [B, T]
    entropy[:, 0] = 0.0  # 0 / 0 there
    kl = torch.zeros_like(entropy) if kl_h is None else kl_h.mean(1).clamp_min_(0.0)
    log_partition = (lse - log_visible).mean(1)
    update_norm = torch.linalg.vector_norm(update.float(), dim=-1).div_(
        torch.linalg.vector_norm(h.float(), dim=-1).add_(1e-6))
    return torch.stack([entropy, kl, log_partition, update_norm], dim=-1)


@torch.no_grad()
def gate_features(h, update, att: Attention, prev: Attention | None) -> torch.Tensor:
    """The four per-token features of block l, [B, T, 4], in float32 and without gradient (the controller reads the
    block, it does not shape it). With P_l[n, t] the causal attention of head n (`att`; `prev`: block l-1's, None in
    the first block) over scores S = q_t . k_s / sqrt(Dh), s <= t, and lse_t = logsumexp_{s <= t} S:

    0. entropy       mean_n H(P_l[n, t]) / log(t + 1), in [0, 1]; 0 at t = 0 (one visible key)
    1. kl            mean_n KL(P_l[n, t] || P_{l-1}[n, t]); 0 in the first block
    2. log_partition mean_n [lse_t - log(t + 1)]: the log of the mean exponentiated score over the visible keys
    3. update_norm   ||F_l(h)_t|| / (||h_t|| + 1e-6)

    KL = -H - sum_s P_l S' + lse_{l-1} (log P_{l-1} = S' - lse_{l-1}), its middle term from this block's pass.
    Leaves att.lse for the next gate; computes prev.lse where its gate did not run.
    """
    with torch.autocast(att.q.device.type, enabled=False):
        entropy_h, cross_score = _tile_pass(att, prev)
        if prev is None:
            return _finish(entropy_h, None, att.lse, h, update)
        if prev.lse is None:
            _tile_pass(prev, stats=False)
        return _finish(entropy_h, -entropy_h - (cross_score - prev.lse), att.lse, h, update)


class FeatureGate(nn.Module):
    """The controller of one block: features (see gate_features) -> Linear -> GELU -> Linear -> sigmoid."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(N_FEATURES, cfg.gate_hidden)
        self.out = nn.Linear(cfg.gate_hidden, 1)
        nn.init.constant_(self.out.bias, math.log(GATE_INIT / (1 - GATE_INIT)))  # start near GATE_INIT

    def forward(self, h, update, att: Attention, prev: Attention | None) -> torch.Tensor:
        feats = gate_features(h, update, att, prev).to(self.fc.weight.dtype)  # float32; a bf16 model's MLP is bf16
        return torch.sigmoid(self.out(F.gelu(self.fc(feats)))).squeeze(-1)


class ScalarGate(nn.Module):
    """A learned coefficient sigmoid(logit), expanded to [B, T]. Uniform ties one logit across all blocks."""

    def __init__(self, logit: nn.Parameter):
        super().__init__()
        self.logit = logit

    def forward(self, h, update, att: Attention, prev: Attention | None) -> torch.Tensor:
        return torch.sigmoid(self.logit).expand(h.shape[:2]).contiguous()  # a real [B, T] tensor, like the others


class ConstantGate(nn.Module):
    """A fixed coefficient (uniform-fixed, uniform-matched), expanded to [B, T]."""

    def __init__(self, value: float):
        super().__init__()
        self.value = value

    def forward(self, h, update, att: Attention, prev: Attention | None) -> torch.Tensor:
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

    def update(self, h: torch.Tensor) -> tuple[torch.Tensor, Attention]:
        """F(h) = a + mlp(ln2(h + a)) with a = attn(ln1(h)), and the Attention it ran (for the gates)."""
        a, q, k = self.attn(self.ln1(h))
        return a + self.mlp(self.ln2(h + a)), Attention(q, k)

    def forward(self, h: torch.Tensor, prev: Attention | None) -> tuple[torch.Tensor, torch.Tensor | None, Attention]:
        """The new residual stream, this block's gate [B, T] (None if ungated) and its Attention (for the next gate)."""
        update, att = self.update(h)
        if self.gate is None:
            return h + update, None, att
        g = self.gate(h, update, att, prev)
        return h + g.unsqueeze(-1).to(update.dtype) * update, g, att


class GPT(nn.Module):
    """nanoGPT's decoder, GPT-2's initialization, around the blocks `make_blocks` returns; the head is tied."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.block_size, config.d_model)
        self.blocks = nn.ModuleList(self.make_blocks())
        self.ln_f = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        self.lm_head.weight = self.wte.weight  # tied head
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def make_blocks(self) -> list[nn.Module]:
        raise NotImplementedError

    @staticmethod
    def _init_weights(m: nn.Module):
        if isinstance(m, (nn.Linear, nn.Embedding)):  # controller biases keep their own init (FeatureGate.__init__)
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def n_params(self) -> int:
        """Unique parameters (the tied head counted once), as the paper counts them."""
        return sum(p.numel() for p in self.parameters())

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        T = ids.shape[1]
        if T > self.config.block_size:
            raise FcauditError(f"window of {T} tokens exceeds block_size {self.config.block_size}: use shorter windows")
        return self.wte(ids) + self.wpe(torch.arange(T, device=ids.device))


class FeatureGateGPT(GPT):
    config_class = GPTConfig

    def make_blocks(self) -> list[Block]:
        shared = nn.Parameter(torch.tensor(math.log(GATE_INIT / (1 - GATE_INIT))))  # uniform: one tied logit
        return [Block(self.config, self._make_gate(shared)) for _ in range(self.config.n_layer)]

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

    def forward(self, ids: torch.Tensor, *, return_gates: bool = False):
        """Logits [B, T, V]; with return_gates also the gates [L, B, T] (None for dense / fixeddepth)."""
        h = self.embed(ids)
        prev, gates = None, []
        for block in self.blocks:
            h, g, prev = block(h, prev)
            gates.append(g)
        logits = self.lm_head(self.ln_f(h))
        if not return_gates:
            return logits
        return logits, (torch.stack(gates) if self.config.gated else None)
