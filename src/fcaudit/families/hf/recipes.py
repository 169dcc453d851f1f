"""Where the controllers of Hugging Face architectures are that no structure rule finds: one entry per module class,
data only (pyvene's model cards are the pattern). A class's instances are found wherever a model holds them, under
any path, so the architectures that reuse a class (Mamba's mixer in a hybrid) need no entry of their own; a new
architecture is one entry. MoE routers are found by structure (discover.py) and need none.

Each `Recipe` names one site inside every instance of its class: the output of a submodule (`module`, relative to the
instance, "" for the instance itself), or the result of a torch function (`op`) that the module's `method` runs, as
`Controller.from_modules` and `Controller.from_ops` read them; where the model runs an instance several times in one
forward pass (a looped layer), the site is one site per call, each its own layer (find.py's `per_call`). `what` says
what the coefficients are; the audit names it. `UNAUDITED` names input-dependent mechanisms fcaudit has no kind for
yet, and why: an audit of a model holding one says so in a notice.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Recipe:
    what: str  # what the coefficients are, e.g. "selective-SSM Δ, B and C"
    module: str = ""  # the site's module relative to the class's instance ("" = the instance)
    op: str | None = None  # a torch function's name (see Controller.from_ops), else the module's output
    call: int | None = None  # which call of `op` (or of the module) in one forward pass; None: each, one site each
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
# gated delta nets with b, a and z projected apart (Qwen3.5 and the architectures built on its layer)
_GDN = (Recipe("gated-delta-net β", "in_proj_b", layout="batch token head"),
        Recipe("gated-delta-net decay", "in_proj_a", layout="batch token head"),
        Recipe("gated-delta-net output gate", "in_proj_z"))

ATTENTION: dict[str, tuple[Recipe, ...]] = {
    # attention output gates: sigmoid (Laguna: softplus) of the layer input scales each head's or channel's output.
    # Where a projection of its own computes the gate, its output is the site; where the query's projection also
    # computes it (q_proj -> query and gate), the sigmoid that produces the gate alone is.
    "Qwen3NextAttention": (Recipe("attention output gate", op="sigmoid"),),
    "Qwen3_5Attention": (Recipe("attention output gate", op="sigmoid"),),
    "Qwen3_5MoeAttention": (Recipe("attention output gate", op="sigmoid"),),
    "Qwen4ExpTextAttention": (Recipe("attention output gate", op="sigmoid"),),
    "MiniCPM5MoeAttention": (Recipe("attention output gate", op="sigmoid"),),
    "AXK2Attention": (Recipe("attention output gate", op="sigmoid"),),
    "AfmoeAttention": (Recipe("attention output gate", "gate_proj"),),
    "BeamAttention": (Recipe("attention output gate", "gate_proj"),),
    "HYV4Attention": (Recipe("attention output gate", "gate_proj"),),
    "Inkling2GatedOutputProjection": (Recipe("attention output gate", "gate_proj"),),
    "MiniMaxLightningAttention": (Recipe("attention output gate", "output_gate"),),
    "LagunaAttention": (Recipe("attention output gate", "g_proj"),),  # per head or per channel, as configured
    "Lfm3Attention": (Recipe("attention output gate", "g_proj", layout="batch token head"),),
    "Dots3NoteTextAttention": (Recipe("attention output gate", "g_proj", layout="batch token head"),),
    "BailingHybridAttention": (Recipe("attention output gate", "g_proj", layout="batch token head"),),
    # per-token taps of a short causal convolution of keys and values, added to its static taps (Inkling 2)
    "Inkling2DynamicShortConvolution": (Recipe("dynamic convolution taps", "weight_proj"),),
    # Doge's dynamic mask: per key token and head, a weight from its value states added to the attention logits
    # (beyond keep_window_size keys, the top-k of these weights also picks the keys attended)
    "DogeAttention": (Recipe("dynamic-mask key weights", "dt_proj", layout="batch token head"),),
    # DeepSeek-V4's KV compression: per token and channel, the logits of the softmax pooling each window of keys
    "DeepseekV4HCACompressor": (Recipe("KV-compression pooling logits", "gate_proj"),),
    "DeepseekV4CSACompressor": (Recipe("KV-compression pooling logits", "gate_proj"),),
    # a norm whose output a sigmoid of a low-rank map of it gates, per channel (A.X K2's attention input)
    "AXK2GatedRMSNorm": (Recipe("gated-norm gate", "mlp"),),
    # gated delta nets: β (the delta rule's write strength) and the decay's input (a), per value head, and the
    # output gate z of the gated norm; where one projection computes b and a together, its output is one site.
    # Qwen3-Next's z comes out of in_proj_qkvz with q, k and v: the site is SiLU(z) inside its gated norm, which sees
    # it flattened per head (a replay of the strided slice z itself runs SiLU on a contiguous copy, a last bit off)
    "Qwen3NextGatedDeltaNet": (Recipe("gated-delta-net β and decay", "in_proj_ba"),
                               Recipe("gated-delta-net output gate SiLU(z)", "norm", op="silu",
                                      layout="(batch token head) channel")),
    "Qwen3_5GatedDeltaNet": _GDN,
    "Qwen3_5MoeGatedDeltaNet": _GDN,
    "Qwen4ExpTextGatedDeltaNet": _GDN,
    "LaraMiniGatedDeltaNet": _GDN,
    "OlmoHybridGatedDeltaNet": (Recipe("gated-delta-net β", "b_proj", layout="batch token head"),
                                Recipe("gated-delta-net decay", "a_proj", layout="batch token head"),
                                Recipe("gated-delta-net output gate", "g_proj")),
    # Kimi delta attention (KDA): a per-channel forget gate (its module's output is the decay), β per head, and the
    # output gate of the gated norm
    "KimiLinearDeltaAttention": (Recipe("KDA forget gate", "forget_gate", layout="batch token (head channel)"),
                                 Recipe("KDA β", "b_proj", layout="batch token head"),
                                 Recipe("KDA output gate", "g_b_proj")),
    "BailingHybridDeltaAttention": (Recipe("KDA forget gate", "forget_gate", layout="batch token (head channel)"),
                                    Recipe("KDA β", "b_proj", layout="batch token head"),
                                    Recipe("KDA output gate", "g_proj")),
    # AltUp (Gemma 3n): per token, the coefficients that predict each of the n streams from all n (n x n, flat) and
    # that scale each stream's correction (n), linear maps of the router's modalities
    "Gemma3nTextAltUp": (Recipe("AltUp prediction coefficients", "prediction_coefs"),
                         Recipe("AltUp correction coefficients", "correction_coefs")),
    # Gemma 3n's per_layer_input_gate: act_fn(gate(h)) * per-layer input -> per_layer_projection, a GLU, no controller
    # hyper-connections: per token, the weights collapsing the n residual streams into the block's input (pre, a
    # mixture over streams), expanding its output into each stream (post), and (DeepSeek-V4) mixing the streams
    # (comb: softmax over the last axis, then a fixed Sinkhorn normalisation, which replay recomputes)
    "DeepseekV4HyperConnection": (
        Recipe("hyper-connection pre weights", op="sigmoid", call=0, layout="batch token source",
               kind="source_mixture"),
        Recipe("hyper-connection post weights", op="sigmoid", call=1),
        Recipe("hyper-connection comb weights", op="softmax", layout="batch token stream source",
               kind="source_mixture")),
    "DeepseekV4HyperHead": (Recipe("hyper-connection head weights", op="sigmoid", layout="batch token source",
                                   kind="source_mixture"),),
    "HYV4HyperConnection": (
        Recipe("hyper-connection pre weights", op="sigmoid", call=0, layout="batch token source",
               kind="source_mixture"),
        Recipe("hyper-connection post weights", op="sigmoid", call=1)),
    "HYV4HyperHead": (Recipe("hyper-connection head weights", op="sigmoid", layout="batch token source",
                             kind="source_mixture"),),
    # looped layers (Dory's recurrent layers, HRM's H and L stacks, Inkling2-Loop's loop layers) run several times in
    # a forward pass: each of their sites is one per call, each loop pass its own layer (find.py's per_call)
    "DoryAttention": (Recipe("attention output gate", "gate_proj"),),  # before its learned scale and sigmoid
    "HrmTextAttention": (Recipe("attention output gate", "gate_proj"),),
    "Inkling2LoopGatedOutputProjection": (Recipe("attention output gate", "gate_proj"),),
    "Inkling2LoopDynamicShortConvolution": (Recipe("dynamic convolution taps", "weight_proj"),),
    # in the passes after the first: (1 - tanh(forget)) * state + tanh(message gate) * the previous pass's message
    "Inkling2LoopMessageGate": (Recipe("loop forget gate", "forget_gate_proj"),
                                Recipe("loop message gate", "message_gate_proj")),
    # Qwen4-Exp's gated residual: per (stream, channel) weights of the streams' mean (before their sigmoid), and per
    # stream the block's injection weight (absent from the final mixer)
    "Qwen4ExpTextGatedResidual": (Recipe("hyper-connection input mix weights", "input_mix_weight_up"),
                                  Recipe("hyper-connection injection weights", "block_inject_weight")),
}

RECIPES: dict[str, tuple[Recipe, ...]] = {**RECURRENT, **ATTENTION}

# module class name -> why its input-dependent mechanism is not audited (said in a notice where a model holds one)
UNAUDITED_RECURRENT: dict[str, str] = {
}

# sparse attention: an indexer scores the keys from the input and a top-k picks the ones each query attends to
_KEY_SELECTION = ("sparse-attention key selection (an indexer's top-k picks each query's keys): fcaudit has no kind "
                  "for key selection yet")
_INSIDE_ATTENTION = ("attention-residual weights over earlier blocks' states: the attention kernel computes them and "
                     "returns only the mixed state (the value path), so no site holds them alone")
UNAUDITED_ATTENTION: dict[str, str] = {
    "DeepseekV32Indexer": _KEY_SELECTION,
    "DeepseekV4Indexer": _KEY_SELECTION,
    "GlmMoeDsaIndexer": _KEY_SELECTION,
    "Glm5NextTextIndexer": _KEY_SELECTION,
    "AXK2Indexer": _KEY_SELECTION,
    "Dots3NoteTextIndexer": _KEY_SELECTION,
    "HYV4Indexer": _KEY_SELECTION,
    "HYV4VLIndexer": _KEY_SELECTION,
    "Kolibri1_1Indexer": _KEY_SELECTION,
    "MiniMaxM3VLIndexer": _KEY_SELECTION,
    "MistralLarge4TextIndexer": _KEY_SELECTION,
    "Qwen4ExpTextQSAIndexer": _KEY_SELECTION,
    # attention residuals: a static query attends over earlier blocks' states
    "Inkling2BlockAttentionResidual": _INSIDE_ATTENTION,
    "Inkling2LoopBlockAttentionResidual": _INSIDE_ATTENTION,
    "Inkling2LoopMessageAttentionResidual": _INSIDE_ATTENTION,
}

# routers that discovery does not take (none returns per-token routing fcaudit can replay)
UNAUDITED_ROUTERS: dict[str, str] = {
    # its router logits are viewed as [2, batch * token, keys], which mixes the halves of different tokens (and
    # windows): each token's experts depend on the other tokens and windows of the pass
    "DogeCDMoE": ("its product-key expert router: the router's logits are reshaped across tokens and windows "
                  "(view(2, batch * token, -1)), so a token's experts depend on the rest of the batch"),
}

UNAUDITED: dict[str, str] = {**UNAUDITED_RECURRENT, **UNAUDITED_ATTENTION, **UNAUDITED_ROUTERS}
