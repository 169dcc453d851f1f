"""Where the controllers of Hugging Face architectures are that no structure rule finds: one entry per module class,
data only (pyvene's model cards are the pattern). A class's instances are found wherever a model holds them, under
any path, so the architectures that reuse a class (Mamba's mixer in a hybrid) need no entry of their own; a new
architecture is one entry. MoE routers are found by structure (discover.py) and need none.

Each `Recipe` names one site inside every instance of its class: the output of a submodule (`module`, relative to the
instance, "" for the instance itself), or the result of a torch function (`op`) that the module's `method` runs, as
`Controller.from_modules` and `Controller.from_ops` read them. `what` says what the coefficients are; the audit
names it. `UNAUDITED` names input-dependent mechanisms fcaudit has no kind for yet, and why: an audit of a model
holding one says so in a notice.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Recipe:
    what: str  # what the coefficients are, e.g. "selective-SSM Δ, B and C"
    module: str = ""  # the site's module relative to the class's instance ("" = the instance)
    op: str | None = None  # a torch function's name (see Controller.from_ops), else the module's output
    call: int | None = None  # which call of `op` (or of the module) in one forward pass; None: its only one
    method: str = "forward"
    layout: str = "batch token channel"  # an einops layout of the coefficient tensor (fcaudit.Layout)
    kind: str = "vector_gate"
    parts: tuple[int, ...] = ()  # of a tuple that `op` returns (a chunk), the coefficients; the rest is the value path


# module class name -> the controller sites inside each of its instances, by group of mechanisms

# state-space and recurrent mixers: selective-SSM parameters, recurrent and LSTM gates
_MAMBA1 = (Recipe("selective-SSM Δ (low rank), B and C", "x_proj"),)
# Mamba-2's scan (torch path): softplus(dt + dt_bias) is Δ per head, and its two repeat_interleave calls spread the
# groups' B, then C, over the heads; the value path x never passes through either op
_MAMBA2 = (Recipe("selective-SSM Δ", op="softplus", layout="batch token head"),
           Recipe("selective-SSM B", op="repeat_interleave", call=0, layout="batch token (head state)"),
           Recipe("selective-SSM C", op="repeat_interleave", call=1, layout="batch token (head state)"))
_SHORT_CONV = (Recipe("short-conv gates B and C", op="chunk", layout="batch channel token", parts=(0, 1)),)

RECURRENT: dict[str, tuple[Recipe, ...]] = {
    # Mamba-1: x_proj computes each token's Δ (low rank), B and C from its input: the selection mechanism
    "MambaMixer": _MAMBA1,
    "FalconMambaMixer": _MAMBA1,
    "JambaMambaMixer": _MAMBA1,
    # Zamba's Mamba-1 heads each have their own x_proj weight, applied by one batched matmul: [head, batch, Δ|B|C,
    # token]; each head is an independent SSM, read as a stream
    "ZambaMambaMixer": (Recipe("selective-SSM Δ (low rank), B and C per Mamba head", op="matmul", call=0,
                               layout="stream batch channel token"),),
    "Mamba2Mixer": _MAMBA2,
    "BambaMixer": _MAMBA2,
    "Zamba2MambaMixer": _MAMBA2,
    "FalconH1Mixer": _MAMBA2,
    "GraniteMoeHybridMambaLayer": _MAMBA2,
    "NemotronHMamba2Mixer": _MAMBA2,
    # RG-LRU (Griffin): its first sigmoid is the input gate, its second the recurrence gate that sets the decay a_t
    "RecurrentGemmaRglru": (Recipe("RG-LRU input gate", op="sigmoid", call=0),
                            Recipe("RG-LRU recurrence gate", op="sigmoid", call=1)),
    # RWKV-4: the receptance sigmoid(R x) gates the time-mix (WKV) output and the channel-mix output
    "RwkvSelfAttention": (Recipe("RWKV time-mix receptance", op="sigmoid"),),
    "RwkvFeedForward": (Recipe("RWKV channel-mix receptance", op="sigmoid"),),
    # LFM2's short convolution: in_proj's output chunked into B, C and the value x; y = C * conv(B * x), so B and C
    # are input-dependent gates around the convolution (the chunk's first two parts; x is recomputed on replay)
    "Lfm2ShortConv": _SHORT_CONV,
    "Lfm2MoeShortConv": _SHORT_CONV,
    "Lfm3ShortConv": _SHORT_CONV,
    # mLSTM (weight_mode "single"): the exponential input gate's and the forget gate's pre-activations per head, and
    # the output gate
    "xLSTMLayer": (Recipe("mLSTM input gate pre-activation", "igate_preact", layout="batch token head"),
                   Recipe("mLSTM forget gate pre-activation", "fgate_preact", layout="batch token head"),
                   Recipe("mLSTM output gate", "ogate_act_fn")),
}

# attention-side mechanisms: output gates, delta-rule β and decay, residual-stream mixing (AltUp, hyper-connections)
ATTENTION: dict[str, tuple[Recipe, ...]] = {
}

RECIPES: dict[str, tuple[Recipe, ...]] = {**RECURRENT, **ATTENTION}

# module class name -> why its input-dependent mechanism is not audited (said in a notice where a model holds one)
UNAUDITED_RECURRENT: dict[str, str] = {
}

UNAUDITED_ATTENTION: dict[str, str] = {
}

UNAUDITED: dict[str, str] = {**UNAUDITED_RECURRENT, **UNAUDITED_ATTENTION}
