"""MUDDPythia: a Pythia-style decoder with multiway dynamic dense (MUDD) cross-layer connections, a native
implementation of `Caiyun-AI/MUDDPythia-1.4B` (spec: shared/specs/muddpythia.md) that loads its weights strictly,
running no remote code. After block i the controller `dynamic_dense[i]` emits signed coefficients dw [C_i, B, T, i+2]
(static `dense_bs[i]` included) mixing the embedding and block outputs into the next block's q, k, v and residual
streams: it is the FCA site, and replacing its forward disables the controller while the rest computes the same.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from safetensors.torch import save_file

from fcaudit.device import DTYPES, as_dtype, dtype_name
from fcaudit.errors import FcauditError, one_line
from fcaudit.hub import resolve
from fcaudit.io import atomic_write, write_json
from fcaudit.weights import check_depth, check_sizes, read_state_dict, stored_shapes

MODEL_TYPE = "muddpythia"


@dataclass
class MUDDConfig:
    block_size: int = 2048
    vocab_size: int = 50432
    n_layer: int = 24
    n_head: int = 16
    n_local_heads: int = -1  # -1: same as n_head (config default when absent)
    dim: int = 2048
    head_dim: int = -1  # -1: dim // n_head
    intermediate_size: int = -1  # -1: 4 * dim
    rope_base: float = 10000.0
    rotary_pct: float = 0.25
    norm_eps: float = 1e-5
    use_qk_norm: bool = False
    use_parallel_residual: bool = True
    use_linear_bias: bool = True
    dense: bool = True
    dynamic_dense: bool = True
    dense_type: str = "qkvr"
    sepln: bool = True
    stack_hidden: bool = False
    expand_last: bool = False
    round64: bool = False
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"

    def __post_init__(self):
        self._check_fields()
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if self.head_dim == -1:
            self.head_dim = self.dim // self.n_head
        if self.intermediate_size == -1:
            self.intermediate_size = 4 * self.dim
        # Only the published variant is implemented; say which field is off rather than compute something else.
        wanted = dict(dense=True, dynamic_dense=True, dense_type="qkvr", sepln=True, stack_hidden=False,
                      tie_word_embeddings=False)
        for name, value in wanted.items():
            if getattr(self, name) != value:
                raise FcauditError(f"MUDDPythia config field {name}={getattr(self, name)!r} is not supported; "
                                   f"only {name}={value!r} (the published MUDDPythia variant) is implemented")
        if self.n_head % self.n_local_heads or self.dim != self.n_head * self.head_dim:
            raise FcauditError(f"MUDDPythia config needs dim == n_head*head_dim and n_head divisible by "
                               f"n_local_heads (got dim={self.dim}, n_head={self.n_head}, head_dim={self.head_dim}, "
                               f"n_local_heads={self.n_local_heads})")
        if self.torch_dtype not in DTYPES:
            raise FcauditError(f"MUDDPythia config torch_dtype={self.torch_dtype!r}: use one of {sorted(DTYPES)}")

    def _check_fields(self) -> None:
        """Types and ranges of config.json's values, before anything is derived from them (one line each)."""
        def bad(name: str, want: str) -> FcauditError:
            return FcauditError(f"MUDDPythia config {name}={getattr(self, name)!r} is invalid: set {name} to {want} "
                                "in config.json")

        counts = {"block_size": 2, "vocab_size": 1, "n_layer": 2, "n_head": 1, "dim": 1}  # n_layer 1: ffn_width / 0
        optional = {"n_local_heads": 1, "head_dim": 1, "intermediate_size": 0}  # -1: derived from the others
        for name, low in {**counts, **optional}.items():
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or (v < low and not (name in optional and v == -1)):
                raise bad(name, f"an integer >= {low}" + (" (or -1)" if name in optional else ""))
        for name in ("rope_base", "rotary_pct", "norm_eps"):
            v, unit = getattr(self, name), name == "rotary_pct"
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not ok or not (0 <= v <= 1 if unit else v > 0):
                raise bad(name, "a number in [0, 1]" if unit else "a finite number > 0")
            setattr(self, name, float(v))  # an int of 2**64 overflows torch's pow; as a float it is a number
        for f in fields(self):  # bool and str fields
            kind = {"bool": (bool, "true or false"), "str": (str, "a string")}.get(f.type)
            if kind and not isinstance(getattr(self, f.name), kind[0]):
                raise bad(f.name, kind[1])

    @property
    def rotary_ndims(self) -> int:
        return int(self.head_dim * self.rotary_pct)

    def n_streams(self, i: int) -> int:
        """C_i: q, k, v, r streams feed the next block; the last layer feeds only the final norm."""
        return 1 if i == self.n_layer - 1 else len(self.dense_type)

    def ffn_width(self, i: int) -> int:
        # Python's round (ties to even), as the published code; a tiny config can get a zero-width layer 0.
        return round(self.intermediate_size * (i / (self.n_layer - 1) + 0.5) / 128) * 128

    def controller_hidden(self, i: int) -> int:
        hidden = (i + 2) * self.n_streams(i)
        if i == self.n_layer - 1 and self.expand_last:
            hidden *= 4
        if self.round64:
            hidden = (hidden // 64 + 1) * 64  # always adds a step, even on a multiple of 64
        return hidden

    @classmethod
    def from_dict(cls, d: dict) -> "MUDDConfig":
        """From an HF config.json dict; unknown keys (architectures, auto_map, ...) are ignored."""
        if d.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise FcauditError(f"config model_type is {d.get('model_type')!r}, not {MODEL_TYPE!r}")
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names and v is not None}
        if "torch_dtype" not in kw and isinstance(d.get("dtype"), str):  # transformers >= 5 writes "dtype"
            kw["torch_dtype"] = d["dtype"]
        if isinstance(kw.get("torch_dtype"), str):
            kw["torch_dtype"] = kw["torch_dtype"].removeprefix("torch.")
        return cls(**kw)

    def to_dict(self) -> dict:
        return {"model_type": MODEL_TYPE, "architectures": ["MUDDPythia"], **asdict(self)}


class RMSNorm(nn.Module):
    """RMSNorm with scale, normalised in float32 (q_norm / k_norm over head_dim)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_table(block_size: int, n: int, base: float, device=None) -> torch.Tensor:
    """cos/sin [block_size, n/2, 2] computed in float32 for every position, then stored in float16."""
    inv_freq = 1.0 / (base ** (torch.arange(0, n, 2, device=device)[: n // 2].float() / n))
    angles = torch.outer(torch.arange(block_size, device=device).float(), inv_freq)
    return torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1).to(torch.float16)


def apply_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate the first n = 2*table.shape[1] dims of x [B, T, H, D], NeoX "half" pairing (j with j+n/2), in float32
    on the float16 table; pair j is written back interleaved at (2j, 2j+1), as the reference does (bit-exactness)."""
    half = table.shape[1]
    pairs = x[..., : 2 * half].float().unflatten(-1, (2, half)).transpose(-1, -2)  # [B, T, H, n/2, (j, j+n/2)]
    cos, sin = table[: x.shape[1], None, :, 0], table[: x.shape[1], None, :, 1]  # [T, 1, n/2]
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return torch.cat([rotated.type_as(x), x[..., 2 * half:]], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: MUDDConfig):
        super().__init__()
        self.cfg = cfg
        bias = cfg.use_linear_bias
        self.wq = nn.Linear(cfg.dim, cfg.n_head * cfg.head_dim, bias=bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_local_heads * cfg.head_dim, bias=bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_local_heads * cfg.head_dim, bias=bias)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=bias)
        if cfg.use_qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def forward(self, xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = xq.shape
        q = self.wq(xq).view(B, T, cfg.n_head, cfg.head_dim)
        k = self.wk(xk).view(B, T, cfg.n_local_heads, cfg.head_dim)
        v = self.wv(xv).view(B, T, cfg.n_local_heads, cfg.head_dim)
        if cfg.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, table), apply_rotary(k, table)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        rep = cfg.n_head // cfg.n_local_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-2, -1)) * cfg.head_dim ** -0.5
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, torch.finfo(torch.float16).min)  # the reference's mask value
        y = scores.softmax(dim=-1) @ v  # softmax in the model dtype, as the reference
        return self.wo(y.transpose(1, 2).reshape(B, T, cfg.dim))


class FeedForward(nn.Module):
    def __init__(self, cfg: MUDDConfig, width: int):
        super().__init__()
        with warnings.catch_warnings():  # width 0 is legitimate (tiny configs): its output is the w2 bias
            warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
            self.w1 = nn.Linear(cfg.dim, width, bias=cfg.use_linear_bias)
            self.w2 = nn.Linear(width, cfg.dim, bias=cfg.use_linear_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))  # exact (erf) GELU


class TransformerBlock(nn.Module):
    """Block 0 takes one tensor; later blocks take four streams (q, k, v, r), each q/k/v with its own LayerNorm."""

    def __init__(self, cfg: MUDDConfig, i: int):
        super().__init__()
        self.cfg, self.i = cfg, i
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg, cfg.ffn_width(i))
        self.ffn_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        if i == 0:
            self.attention_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        else:
            self.attention_norms = nn.ModuleList(nn.LayerNorm(cfg.dim, eps=cfg.norm_eps) for _ in range(3))

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, ...], table: torch.Tensor) -> torch.Tensor:
        if self.i == 0:
            res = x
            normed = self.attention_norm(x)
            attn = self.attention(normed, normed, normed, table)
        else:
            res = x[3]
            attn = self.attention(*(norm(s) for norm, s in zip(self.attention_norms, x[:3])), table)
        h = res + attn
        return h + self.feed_forward(self.ffn_norm(res if self.cfg.use_parallel_residual else h))


class DynamicDense(nn.Module):
    """The controller of layer i, the FCA site: block output -> the complete dw [C_i, B, T, i+2], static `bias`
    (dense_bs[i], a top-level parameter so the state-dict key stays `dense_bs.{i}`) included."""

    def __init__(self, cfg: MUDDConfig, i: int):
        super().__init__()
        self.C, self.n_sources, self.eps = cfg.n_streams(i), i + 2, cfg.norm_eps
        hidden = cfg.controller_hidden(i)
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, self.C * self.n_sources, bias=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)  # RMSNorm without weight, model dtype
        dw = self.w2(F.gelu(self.w1(x)))
        dw = rearrange(dw, "b t (c l) -> c b t l", c=self.C)
        return dw + bias[:, None, None, :]


def mix(dw: torch.Tensor, hiddens: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Stream c = sum_j dw[c, :, :, j] * h_j, summed in order of j (the reference's order, for bit-exactness)."""
    streams = []
    for c in range(dw.shape[0]):
        acc = dw[c, :, :, 0, None] * hiddens[0]
        for j in range(1, len(hiddens)):
            acc = acc + dw[c, :, :, j, None] * hiddens[j]
        streams.append(acc)
    return tuple(streams)


def mix_stacked(dw: torch.Tensor, stack: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """mix() as one batched product per layer, [C, J] coefficients times each token's [J, D] hiddens from stack
    [B, T, L+1, D]; not bit-exact against mix(), as it sums in its own order (in bf16 it rounds once)."""
    C, B, T, J = dw.shape
    w = dw.permute(1, 2, 0, 3).reshape(B * T, C, J)
    out = torch.bmm(w, stack[:, :, :J].reshape(B * T, J, -1))
    return out.view(B, T, C, -1).unbind(2)


class MUDDPythia(nn.Module):
    """fast_mix: mix the streams by mix_stacked instead of the published-order mix() (not bit-exact against it). A
    plain attribute, not in the config or checkpoint, so a loaded model can switch it; capture and replay both use
    it, so an audit's exact-replay check holds either way."""

    def __init__(self, config: MUDDConfig, fast_mix: bool = False):
        super().__init__()
        self.config = cfg = replace(config)  # own copy: presets are shared module-level objects
        self.fast_mix = fast_mix
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.n_layer))
        self.dynamic_dense = nn.ModuleList(DynamicDense(cfg, i) for i in range(cfg.n_layer))
        self.dense_bs = nn.ParameterList(
            nn.Parameter(torch.zeros(cfg.n_streams(i), i + 2)) for i in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self._rope: dict[torch.device, torch.Tensor] = {}  # not a buffer: .to(bfloat16) must not recast it
        if not any(p.is_meta for p in self.parameters()):
            self.apply(self._init_weights)
            self.init_dense()

    def _init_weights(self, m: nn.Module):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    @torch.no_grad()
    def init_dense(self):
        """Training from scratch: the static mix starts as "take the latest hidden state" (a plain pre-LN residual
        stream) and the controller silent, so a random model trains like a Transformer and learns to mix from there."""
        for i, (dd, bs) in enumerate(zip(self.dynamic_dense, self.dense_bs)):
            nn.init.zeros_(dd.w2.weight)
            bs.zero_()
            bs[:, i + 1] = 1.0
        for layer in self.layers:  # scale residual projections by depth (GPT-2)
            nn.init.normal_(layer.attention.wo.weight, std=0.02 / math.sqrt(2 * self.config.n_layer))
            nn.init.normal_(layer.feed_forward.w2.weight, std=0.02 / math.sqrt(2 * self.config.n_layer))

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    def rope(self, device: torch.device) -> torch.Tensor:
        if device not in self._rope:
            c = self.config
            with torch.inference_mode(False):  # a normal tensor even if first built during an inference pass
                self._rope[device] = rotary_table(c.block_size, c.rotary_ndims, c.rope_base, device)
        return self._rope[device]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> logits [B, T, vocab] (prefill, no caches)."""
        if ids.shape[1] > self.config.block_size:
            raise FcauditError(f"window of {ids.shape[1]} tokens exceeds block_size {self.config.block_size}: "
                               f"use --window {self.config.block_size} or less")
        table = self.rope(ids.device)
        x = self.tok_embeddings(ids)
        if self.fast_mix:  # the stack is written in place as layers run: autograd could not differentiate through it
            if torch.is_grad_enabled():
                raise FcauditError("fast_mix is an inference path: run under torch.no_grad() or inference_mode, "
                                   "or set model.fast_mix = False to train")
            stack = x.new_empty(*x.shape[:2], self.config.n_layer + 1, x.shape[-1])
            stack[:, :, 0] = x
        hiddens = [x]
        for i, layer in enumerate(self.layers):
            out = layer(x, table)
            dw = self.dynamic_dense[i](out, self.dense_bs[i])
            if self.fast_mix:
                stack[:, :, i + 1] = out
                x = mix_stacked(dw, stack)
            else:
                hiddens.append(out)
                x = mix(dw, hiddens)
        return self.output(self.norm(x[0]))

    def save_pretrained(self, out_dir: str | os.PathLike) -> Path:
        """HF format in the model's dtype, each file atomically, the weights before the config.json naming them."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        atomic_write(out / "model.safetensors", lambda p: save_file(state, str(p), metadata={"format": "pt"}))
        write_json(out / "config.json", {**self.config.to_dict(), "torch_dtype": dtype_name(self.dtype)})
        return out

    @classmethod
    def from_pretrained(cls, dir_or_hub_id: str | os.PathLike, revision: str | None = None,
                        dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu") -> "MUDDPythia":
        """Load a MUDDPythia checkpoint from a local directory or a hub id (optionally at `revision`); dtype None
        keeps the checkpoint's own `torch_dtype` (bfloat16 for the published 1.4B model)."""
        path = resolve(dir_or_hub_id, revision)
        if not (path / "config.json").exists():
            raise FcauditError(f"no config.json in {path}: pass a MUDDPythia checkpoint directory")
        try:
            raw = json.loads((path / "config.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise FcauditError(f"{path / 'config.json'} is not valid JSON ({one_line(e, 80)}): re-download or rewrite "
                               "it") from None
        if not isinstance(raw, dict):
            raise FcauditError(f"{path / 'config.json'} is not a JSON object: re-download or rewrite it")
        try:
            config = MUDDConfig.from_dict(raw)
        except TypeError as e:
            raise FcauditError(f"{path / 'config.json'} has a field of the wrong type ({e}): fix config.json") from None
        if config.block_size > MAX_POSITIONS:  # no weight holds it: the first forward would build a table this long
            raise FcauditError(f"{path / 'config.json'} has block_size {config.block_size}, more positions than "
                               f"fcaudit builds a rotary table for ({MAX_POSITIONS}): use the config.json saved with "
                               "these weights")
        stored = stored_shapes(path)  # every size against the weights' headers before any module is built
        check_depth(path, stored, "n_layer", config.n_layer)
        check_sizes(lambda: cls(config), path, stored)
        with torch.device("meta"):  # no allocation or init: the checkpoint supplies every tensor
            model = cls(config)
        state = read_state_dict(path)  # the config's auto_map (the published model's own code) is never run
        if dtype is None:  # the checkpoint's own dtype: its config's, else that of the stored tensors
            stored = state.get("tok_embeddings.weight")
            declared = "torch_dtype" in raw or "dtype" in raw
            dtype = config.torch_dtype if declared or stored is None else stored.dtype
        target = as_dtype(dtype)
        try:
            model.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as e:
            raise FcauditError(f"checkpoint {path} does not match its config.json (n_layer, dim, ...) "
                               f"or is not a MUDDPythia checkpoint ({one_line(e, 240)}): use the matching config.json "
                               "and weights") from None
        config.torch_dtype = dtype_name(target)
        return model.to(device=device, dtype=target).eval()


from_pretrained = MUDDPythia.from_pretrained
MAX_POSITIONS = 2**20  # a loaded config's block_size at most: its rotary table is built whole at the first forward


# `fcaudit train --model mudd`: byte-level models sized like the FeatureGate tiny/demo presets (same window, about
# the same cost per step), so `fcaudit demo` contrasts the two families at equal budget.
BYTE_PRESETS: dict[str, MUDDConfig] = {
    "tiny": MUDDConfig(block_size=64, vocab_size=256, n_layer=3, n_head=4, dim=64, intermediate_size=256,
                       use_qk_norm=True, expand_last=True, round64=True),
    "demo": MUDDConfig(block_size=128, vocab_size=256, n_layer=4, n_head=4, dim=96, intermediate_size=384,
                       use_qk_norm=True, expand_last=True, round64=True),
}
