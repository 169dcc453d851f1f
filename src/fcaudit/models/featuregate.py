"""The FeatureGate model family: a byte-level pre-LN decoder whose block updates are scaled by a gate,
h[l+1, t] = h[l, t] + g[l, t] * F_l(h_l)[t] with F_l(h) = a + mlp(ln2(h + a)), a = attn(ln1(h)).

Variants: dense (g = 1, no gate module), fixeddepth (dense with k blocks), uniform (one sigmoid(w) for all layers),
layerstatic (sigmoid(w_l) per layer), uniform-fixed / uniform-matched (a constant; matched: a FeatureGate model's gate
mass) and featuregate (a per-token controller of the block's attention features). Each gate is `blocks[l].gate`,
returning g [B, T]; every variant runs the same attention kernel, so a comparison of variants measures the gates. The
head is tied to the token embedding, which gives the paper's parameter counts (`model.n_params()`).

Decoding: `model.start_decoding(batch)` gives a KV cache, and `model(ids[:, t:t+1], cache=state)` the logits of the next
position, equal to the full-sequence forward's up to float rounding (one query row instead of the whole window). The
decoders of MoD and early exit reuse these blocks and this cache.
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


class KVCache:
    """One block's keys and values of the tokens decoded so far, [B, H, window, Dh], allocated once. Rows fill
    unequally where a block runs on some tokens only (MoD's routed blocks): `length` per row, masked on reading."""

    def __init__(self, cfg, batch: int, window: int, like: torch.Tensor):
        shape = (batch, cfg.n_head, window, cfg.d_model // cfg.n_head)
        self.k, self.v = like.new_zeros(shape), like.new_zeros(shape)
        self.length = torch.zeros(batch, dtype=torch.long, device=like.device)
        self.longest, self.ragged = 0, False
        self.ran = 0  # (token, block) pairs whose update this block computed: the rows that attended

    def append(self, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Keys and values [n, H, 1, Dh] of the batch rows `rows` (None: every row)."""
        if rows is None and not self.ragged:
            self.k[:, :, self.longest], self.v[:, :, self.longest] = k[:, :, 0], v[:, :, 0]
            self.length += 1
            self.longest += 1
            return
        rows = torch.arange(self.k.size(0), device=self.k.device) if rows is None else rows
        at = self.length[rows]
        self.k[rows, :, at], self.v[rows, :, at] = k[:, :, 0], v[:, :, 0]
        self.length[rows] += 1
        self.longest = int(self.length.max())
        self.ragged = bool((self.length != self.longest).any())

    def read(self, rows: torch.Tensor | None = None):
        """(keys, values, mask) of the batch rows `rows` (None: every row): [n, H, longest, Dh] each, and where rows
        hold fewer keys, which of them are real ([n, 1, 1, longest], else None)."""
        k, v = self.k[:, :, :self.longest], self.v[:, :, :self.longest]
        length = self.length
        if rows is not None:
            k, v, length = k[rows], v[rows], length[rows]
        self.ran += k.size(0)
        if not self.ragged:
            return k, v, None
        return k, v, (torch.arange(self.longest, device=k.device) < length[:, None])[:, None, None, :]


@dataclass(eq=False)
class Decoding:
    """The state of token-by-token decoding of one batch (`GPT.start_decoding`): every block's KV cache and the
    position of the next token."""

    caches: list[KVCache]
    window: int
    position: int = 0

    def advance(self, ids: torch.Tensor) -> int:
        """The position of this call's tokens (ids [B, 1]: one per sequence); the state moves on to the next."""
        if ids.dim() != 2 or ids.shape[1] != 1:
            raise FcauditError(f"decoding takes one token per sequence and call, got ids of shape {tuple(ids.shape)}: "
                               "pass ids[:, t:t+1]")
        if self.position >= self.window:
            raise FcauditError(f"this decoding holds {self.window} tokens and all are decoded: start_decoding again "
                               "with a longer window")
        self.position += 1
        return self.position - 1

    def executed(self) -> list[int]:
        """(token, block) pairs each block computed so far."""
        return [c.ran for c in self.caches]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, kv: KVCache | None = None, rows: torch.Tensor | None = None,
                run: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention output [B, T, D] and the per-head queries and keys [B, H, T, Dh] (for the gate). Decoding
        (`kv`, T = 1): the keys and values of x (the batch rows `rows`; None: all) enter the cache, and the rows `run`
        of x (None: all) attend over their cached keys: [n, 1, D] and [n, H, 1, Dh], [n, H, cached, Dh]."""
        if kv is not None:
            self.remember(x, kv, rows)
            who = rows if run is None else run if rows is None else rows[run]
            return self.attend(x if run is None else x[run], kv, who)
        q, k, v = rearrange(self.qkv(x), "b t (three h d) -> three b h t d", three=3, h=self.n_head)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(rearrange(y, "b h t d -> b t (h d)")), q, k

    def remember(self, x: torch.Tensor, kv: KVCache, rows: torch.Tensor | None = None) -> None:
        """Only the keys and values of x [n, 1, D] into the cache: what a token skipping this block still gives the
        tokens after it."""
        d = x.size(-1)
        k, v = rearrange(F.linear(x, self.qkv.weight[d:]), "b t (two h d) -> two b h t d", two=2, h=self.n_head)
        kv.append(k, v, rows)

    def attend(self, x: torch.Tensor, kv: KVCache, rows: torch.Tensor | None = None):
        """The batch rows `rows` (x [n, 1, D]: theirs) attend over the keys cached for them."""
        q = rearrange(F.linear(x, self.qkv.weight[: x.size(-1)]), "b t (h d) -> b h t d", h=self.n_head)
        k, v, mask = kv.read(rows)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
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
    """One block's causal attention as the gates read it, made per forward pass: its queries [B, H, T, Dh] and keys
    [B, H, past + T, Dh] (decoding: the cached keys before the query too) and, once a gate has computed it, the lse
    [B, H, T] (logsumexp of the causal scores), which the next gate reuses."""

    q: torch.Tensor
    k: torch.Tensor
    lse: torch.Tensor | None = None

    @property
    def past(self) -> int:
        """Keys before the first query: 0 in a window's forward, the cached tokens when decoding."""
        return self.k.size(2) - self.q.size(2)

    def flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 q / sqrt(Dh) and k, [B*H, T, Dh] and [B*H, past + T, Dh]: the operands of the tiled products."""
        return (self.q.float() * self.q.size(-1) ** -0.5).flatten(0, 1), self.k.float().flatten(0, 1)


MASKED_SCORE = -1e30  # future keys: finite, so P = 0 there and P * score = 0 (never 0 * -inf = nan)

# Scores held at a time (float32 elements): 2 MiB keeps a CPU tile in cache; a GPU tile covers a paper-size block.
TILE_ELEMENTS = {"cpu": 1 << 19, "cuda": 1 << 26}
TILE_ROWS_CPU = (32, 64)  # query rows per CPU tile: a quarter of the window, within these bounds


def _score_tiles(q: torch.Tensor, k: torch.Tensor):
    """(maps, query rows, masked scores [maps, rows, keys]) over the tiles of flat q [N, T, Dh] and k [N, past + T,
    Dh]: query row i is position past + i, each tile's keys end at its last row (causality). Fewer rows on the CPU
    waste less of each tile's masked diagonal square."""
    N, T, _ = q.shape
    past = k.size(1) - T
    low, high = TILE_ROWS_CPU
    rows = min(T, max(low, min(high, T // 4))) if q.device.type == "cpu" else T
    maps = max(1, min(N, TILE_ELEMENTS.get(q.device.type, TILE_ELEMENTS["cpu"]) // (rows * T)))
    future = torch.full((rows, rows), MASKED_SCORE, device=q.device).triu(1)
    for m0 in range(0, N, maps):
        m = slice(m0, m0 + maps)
        for t0 in range(0, T, rows):
            t = slice(t0, min(T, t0 + rows))
            x = torch.bmm(q[m, t], k[m, : past + t.stop].transpose(1, 2))
            x[:, :, past + t0:].add_(future[: x.size(1), : x.size(1)])  # the tile's own diagonal square: the future
            yield m, t, x


def _tile_pass(att: Attention, cross: Attention | None = None, stats: bool = True):
    """One pass over tiles of a block's scores S: its lse into att.lse and, with `stats`, the per-head entropy
    -sum_s P log P and (with another block's `cross`) the cross score sum_s P S' = q'_t . (P K')_t, [B, H, T] each.
    With x = S - max, log_z = -log max_s P (>= -log(t + 1): no underflow), lse = max + log_z and
    H = log_z - sum_s P x: sums of terms the size of log P, which do not cancel."""
    B, H, T, _ = att.q.shape
    q, k = att.flat()
    past = att.past
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
            cross_score[m, t] = torch.bmm(p, ck[m, : past + t.stop]).mul_(cq[m, t]).sum(-1)
        entropy[m, t] = log_z.squeeze(-1) - x.mul_(p).sum(-1)
    att.lse = lse.view(B, H, T)
    if not stats:
        return None, None
    return entropy.view(B, H, T), None if cross_score is None else cross_score.view(B, H, T)


def _finish(entropy_h, kl_h, lse, h, update, past: int = 0) -> torch.Tensor:
    """[B, T, 4] from per-head entropy, KL (None in the first block) and lse [B, H, T] of the queries at positions
    past..past + T - 1; entropy and KL are >= 0, so clamping removes only rounding noise (e.g. -1e-7 for a one-hot
    attention row)."""
    log_visible = torch.arange(past + 1, past + lse.size(-1) + 1, device=lse.device, dtype=torch.float32).log_()
    entropy = entropy_h.mean(1).clamp_min_(0.0).div_(log_visible)  # [B, T]
    if past == 0:
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
            return _finish(entropy_h, None, att.lse, h, update, att.past)
        if prev.lse is None:
            _tile_pass(prev, stats=False)
        return _finish(entropy_h, -entropy_h - (cross_score - prev.lse), att.lse, h, update, att.past)


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

    def update(self, h: torch.Tensor, kv: KVCache | None = None, rows: torch.Tensor | None = None,
               run: torch.Tensor | None = None) -> tuple[torch.Tensor, Attention]:
        """F(h) = a + mlp(ln2(h + a)) with a = attn(ln1(h)), and the Attention it ran (for the gates). Decoding: h
        holds the batch rows `rows` (None: all), all of which enter the cache; F is computed for the rows `run` of h."""
        a, q, k = self.attn(self.ln1(h), kv, rows, run)
        h = h if run is None else h[run]
        return a + self.mlp(self.ln2(h + a)), Attention(q, k)

    def forward(self, h: torch.Tensor, prev: Attention | None,
                kv: KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor | None, Attention]:
        """The new residual stream, this block's gate [B, T] (None if ungated) and its Attention (for the next gate)."""
        update, att = self.update(h, kv)
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

    def embed(self, ids: torch.Tensor, cache: Decoding | None = None) -> torch.Tensor:
        T = ids.shape[1]
        if T > self.config.block_size:
            raise FcauditError(f"window of {T} tokens exceeds block_size {self.config.block_size}: use shorter windows")
        start = 0 if cache is None else cache.advance(ids)
        return self.wte(ids) + self.wpe(torch.arange(start, start + T, device=ids.device))

    def start_decoding(self, batch: int, window: int | None = None) -> Decoding:
        """An empty KV cache for decoding `batch` sequences of up to `window` tokens (default: block_size), one token
        per call: `model(ids[:, t:t+1], cache=state)`."""
        window = self.config.block_size if window is None else window
        if not 1 <= window <= self.config.block_size:
            raise FcauditError(f"decoding window {window} is outside 1..block_size {self.config.block_size}: pass a "
                               "shorter window")
        return Decoding([KVCache(self.config, batch, window, self.wte.weight) for _ in self.blocks], window)

    def caches(self, cache: Decoding | None) -> list[KVCache | None]:
        """Each block's KV cache of a decoding state (None for each block when scoring a window)."""
        return [None] * len(self.blocks) if cache is None else cache.caches


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

    def forward(self, ids: torch.Tensor, *, return_gates: bool = False, cache: Decoding | None = None):
        """Logits [B, T, V]; with return_gates also the gates [L, B, T] (None for dense / fixeddepth). With `cache`
        (start_decoding), ids [B, 1] is the next token of each sequence."""
        h = self.embed(ids, cache)
        prev, gates = None, []
        for block, kv in zip(self.blocks, self.caches(cache)):
            h, g, prev = block(h, prev, kv)
            gates.append(g)
        logits = self.lm_head(self.ln_f(h))
        if not return_gates:
            return logits
        return logits, (torch.stack(gates) if self.config.gated else None)
