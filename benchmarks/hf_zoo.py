"""Every causal LM of the installed transformers, given to fcaudit with zero code as a new user would: a tiny random
model built from its config class's defaults (every size brought down), `save_pretrained` into a directory, then
the `fcaudit audit DIR` path (4 + 4 windows of 16 byte ids of the embedded corpus, R = 2). Prints one row per
architecture: the controller kinds found (sites per kind) and whether the exact replay held, or the one-line refusal;
then a summary over the architectures that have an input-dependent controller.

Whether an architecture has a controller is decided without fcaudit, from the source of the module that defines
its causal LM class (`controlled`): an MoE (an expert count and a top-k), or a gate: a sigmoid or softplus of the
input (selective-SSM Δ, decays, output and recurrent gates), not of a router's scores or a parameter alone, nor an
activation (`NOT_GATE`). `NOT_CONTROLLERS` lists the matches that are not controllers and `CONTROLLERS` the
controllers that match none of the patterns, each with why. On transformers 5.25 this gives 89 model types, which
load 81 causal LM classes: a multimodal `x` and its `x_text`, and the aliases of another architecture's class
(sarvam_mla, sarvam_moe, param2moe), load one class; the summary counts both. Issue 47 counts 80 classes: these
but LFM2, whose gates are products of two projections of the input, with no sigmoid. `SELECTIONS` names the
architectures whose only input-dependent mechanism is a selection fcaudit has no kind for yet (LSH buckets, entropy
patching): listed, not counted.

Tiny configs: `shrink` brings every size-like integer of the defaults (SIZES) down, in nested configs too, cuts
per-layer lists to the layers kept (a hybrid keeps the first layer of each type), and `OVERRIDES` (data) fixes the
architectures it is not enough for. A row's "bug" is a traceback rather than a FcauditError: fcaudit's fault, or a
tiny config transformers cannot run ("not built").
Usage: python benchmarks/hf_zoo.py [--only mamba qwen3_next ...] [--controlled]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import logging
import re
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fcaudit.errors import FcauditError, one_line

WINDOW, WINDOWS, R = 16, 4, 2
NOTE = 90  # characters of a note shown in a row

# config key -> its tiny value (integers above it are brought down to it), in the config and every nested config
SIZES = {
    **dict.fromkeys(("vocab_size", "vocab_size_per_layer_input", "audio_vocab_size", "unpadded_vocab_size"), 256),
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "embedding_size", "hidden_size_global",
                     "word_embed_proj_dim", "emb_dim", "lru_width", "attention_hidden_size", "input_size",
                     "backbone_hidden_size", "router_hidden_size", "ple_embed_dim", "embedding_dim"), 64),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers",
                     "num_encoder_layers", "depth", "num_blocks"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads",
                     "num_decoder_attention_heads", "num_encoder_attention_heads", "linear_num_key_heads",
                     "linear_num_value_heads", "linear_num_heads", "index_n_heads", "index_num_heads",
                     "decoder_attention_heads", "encoder_attention_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "kv_n_heads", "swa_num_key_value_heads",
                     "multi_query_group_num", "num_query_groups"), 2),
    **dict.fromkeys(("head_dim", "kv_channels", "attention_head_size", "d_head", "dim_head", "global_head_dim",
                     "qk_nope_head_dim", "v_head_dim", "qk_rope_head_dim", "qk_head_dim", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_head_dim", "index_head_dim", "attention_head_dim"), 16),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "d_ff", "dim_ff", "dff", "ffn_hidden_size",
                     "moe_intermediate_size", "shared_expert_intermediate_size", "expert_ffn_hidden_size",
                     "intermediate_size_mlp", "dense_intermediate_size", "first_dense_intermediate_size",
                     "mlp_only_intermediate_size", "moe_shared_expert_intermediate_size",
                     "shared_experts_intermediate_size", "feed_forward_size", "decoder_ffn_dim",
                     "encoder_ffn_dim"), 64),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 8),
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "moe_top_k",
                     "top_k_experts", "n_shared_experts", "num_shared_experts", "moe_num_shared_experts",
                     "n_group", "topk_group"), 2),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx", "max_target_positions",
                     "context_length", "max_sequence_length", "original_max_position_embeddings",
                     "sliding_window", "attention_window_size", "attention_chunk_size"), 64),
    **dict.fromkeys(("q_lora_rank", "kv_lora_rank", "o_lora_rank", "laurel_rank", "hc_lowrank", "adapter_rank",
                     "gated_norm_rank", "loop_gate_rank", "time_step_rank", "mamba_dt_rank"), 16),
    **dict.fromkeys(("state_size", "ssm_state_size", "mamba_d_state", "d_state"), 8),
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads"), 8),
    **dict.fromkeys(("mamba_head_dim", "mamba_headdim", "mamba_d_head"), 16),
    **dict.fromkeys(("index_topk", "index_topk_blocks"), 4),
    # which layers are dense or start MoE: every layer kept is one of each kind
    **dict.fromkeys(("first_k_dense_replace", "moe_layer_start_index", "num_dense_layers", "num_kv_shared_layers"), 0),
    "mamba_d_ssm": 128, "rotary_dim": 8, "encoder_hash_byte_group_vocab": 256, "num_expert_group": 2,
    "hidden_size_per_layer_input": 16,
}
TOKEN_ID = re.compile(r"(_token_id|_token_index|_token_ids)$")  # ids at or above the byte vocabulary: see shrink

# model_type -> config keys the generic shrinker gets wrong for it (data; each is a config value)
GEMMA4_MOE = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=64,
                  hidden_size_per_layer_input=16)
OVERRIDES: dict[str, dict] = {
    "dots1": dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1),  # no defaults
    "hunyuan_v1_moe": dict(head_dim=16),
    "deepseek_v2": dict(n_routed_experts=8, num_experts_per_tok=2),  # no defaults
    "longcat_flash": dict(qk_rope_head_dim=32, head_dim=32, qk_nope_head_dim=8, v_head_dim=16, qk_head_dim=40),
    "dots3_note_text": dict(head_dim=32),  # qk_nope_head_dim + qk_rope_head_dim
    "dots3_note": dict(head_dim=32, text_config=dict(head_dim=32),
                       vision_config=dict(adapter_in_dim=64, adapter_out_dim=64),
                       audio_config=dict(adapter_input_size=64, adapter_out_dim=64)),
    # one short-convolution layer and one attention layer (LFM2's defaults make every layer attention)
    "lfm2": dict(layer_types=["conv", "full_attention"], full_attn_idxs=[1]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    # configs whose defaults are derived in __post_init__ (layer counts): the undervived values
    "dory": dict(layer_types=None, num_hidden_layers=4, n_input_layers=1, n_output_layers=1, n_recurrent_layers=None),
    "hrm_text": dict(num_layers_per_stack=None, num_hidden_layers=1),
    # its loop layers (6..17 by default) inside the tiny depth: the middle one of three, a full-attention layer
    "inkling2_loop_text": dict(num_hidden_layers=3, n_layers_per_attn_res_block=1, loop_layer_index_start=1,
                               loop_layer_index_end=2, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"]),
    "mamba2": dict(num_heads=8),  # num_heads x head_dim = expand x hidden_size
    "falcon_h1": dict(mamba_d_ssm=128, mamba_d_head=16),
    "zamba2": dict(attention_hidden_size=128, attention_head_dim=32),  # attention reads [hidden, embedding]
    # two hybrid layers: the second ties its shared transformer to the first's
    "zamba": dict(attention_hidden_size=128, attention_head_dim=32, num_hidden_layers=4,
                  layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0,
                  use_mamba_kernels=False),
    "bamba": dict(attn_layer_indices=[1]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    "kolibri1_1": dict(index_layers=[4], kv_source_layers=[0, 1, 2, 3, 4], index_pool_size=64, index_num_heads=2,
                       index_num_local_tokens=8, index_num_sink_tokens=2),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                           indexer_compress_ratio=2),
    "qwen4_exp": dict(text_config=dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                                       indexer_compress_ratio=2)),
    "xlstm": dict(embedding_dim=64, num_blocks=2, qk_dim_factor=1.0),
    "dbrx": dict(attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"moe_num_experts": 8, "moe_top_k": 2, "ffn_hidden_size": 64, "hidden_size": 64}),
    # MoE blocks that the defaults leave off
    "gemma4_text": GEMMA4_MOE,
    "gemma4": dict(text_config=GEMMA4_MOE),
    "doge": dict(is_moe=True),
    "reformer": dict(is_decoder=True, axial_pos_embds_dim=[32, 32], axial_pos_shape=[4, 4], local_attn_chunk_length=4,
                     lsh_attn_chunk_length=4),
}


@dataclass
class Row:
    model_type: str
    controlled: str | None  # what its source says its controller is (`controlled`), or None
    status: str  # "audited", "refused", "bug" (a traceback), "not built"
    line: str  # kinds and replay, or the one-line error
    cls: str = ""  # the causal LM class transformers loads for it
    seconds: float = 0.0
    kinds: Counter = field(default_factory=Counter)


# ----------------------------------------------------------------------------------------------------------------
# which architectures have an input-dependent controller, read from their modeling source (not from fcaudit)

MOE = re.compile(r"num_experts|n_routed_experts|num_local_experts|moe_num_experts")
GATE = re.compile(r"sigmoid|softplus")
# lines of GATE that are not an input-dependent gate: a router's scores, the swish x * sigmoid(x) and GLU activations,
# a function of a parameter alone, attention sinks
NOT_GATE = re.compile(r"router|logits|scores|expert|sinks|\bweight\.sigmoid|softplus\(weight\)|\((self\.\w+)\)"
                      r"|(\w+) \*=? ?torch\.sigmoid\(\2\b|(\w+) = \3 \* torch\.sigmoid\(\3\)")
# model_type -> why its softplus/sigmoid match is not a controller
NOT_CONTROLLERS = {
    "granite_swa": "sigmoid(logsumexp - sink): attention sinks, a normalization of the softmax",
}
GATES = "gates (a sigmoid or softplus of the input: SSM Δ, decays, output and recurrent gates)"
# model_type -> its controller, where the source holds none of the patterns
CONTROLLERS = {
    "lfm2": f"{GATES}: its short-convolution gates B and C, products of two projections of the input, no sigmoid",
}

# model_type -> its only input-dependent mechanism, a selection that fcaudit has no kind for yet (like the sparse-
# attention indexers of the architectures above, named in their audits); listed by name, not counted as controllers
SELECTIONS = {
    "blt": "entropy patching: patch boundaries where a small byte LM's next-byte entropy crosses a threshold",
    "reformer": "LSH attention: each key's bucket, from a random rotation of its input",
    **dict.fromkeys(("gemma4_assistant", "gemma4_unified_assistant"),
                    "the top-k centroids of the output vocabulary that the drafter computes logits for"),
}


def causal_lm_name(model_type: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


def controlled(model_type: str) -> str | None:
    """What makes the architecture's causal LM input-dependent, from its modeling file's source, or None."""
    if model_type in NOT_CONTROLLERS:
        return None
    if model_type in CONTROLLERS:
        return CONTROLLERS[model_type]
    import transformers

    try:
        src = Path(inspect.getfile(getattr(transformers, causal_lm_name(model_type)))).read_text()
    except (ImportError, AttributeError, RuntimeError):  # a class this install cannot import: its row says so
        return None
    found = []
    if MOE.search(src) and "topk" in src:
        found.append("MoE router")
    if any(GATE.search(ln) and not NOT_GATE.search(ln) and not ln.lstrip().startswith("#") for ln in src.splitlines()):
        found.append(GATES)
    return ", ".join(found) or None


# ----------------------------------------------------------------------------------------------------------------
# tiny configs

TYPE_LISTS = ("layer_types", "layers_block_type", "hybrid_override_pattern", "block_types", "mlp_layer_types")


def _layers_kept(cfg: dict) -> int | None:
    """The layer count that keeps one of each layer type of every list of types, in order (a hybrid's attention and
    mixer layers, the first sparse layer after dense ones), or None where the config lists no types."""
    kept = [max(2, max({t: i for i, t in reversed(list(enumerate(types)))}.values()) + 1)
            for key in TYPE_LISTS if isinstance(types := cfg.get(key), (list, str)) and len(types) > 0]
    return max(kept, default=None)


def shrink(cfg: dict, ids: dict[int, int] | None = None) -> dict:
    """`cfg` (a config's to_dict) with every size brought down and per-layer lists cut to the layers kept. Token ids
    beyond the byte vocabulary become bytes that UTF-8 text never holds (255, 254, ...), the same id everywhere."""
    ids = {} if ids is None else ids
    out = {}
    depth = cfg.get("num_hidden_layers")
    kept = _layers_kept(cfg)
    for k, v in cfg.items():
        if isinstance(v, dict) and k not in ("rope_parameters", "rope_scaling", "id2label", "label2id"):
            out[k] = shrink(v, ids)
        elif isinstance(v, int) and not isinstance(v, bool) and k in SIZES:
            out[k] = min(v, SIZES[k])
        elif isinstance(v, int) and not isinstance(v, bool) and TOKEN_ID.search(k) and v >= SIZES["vocab_size"]:
            out[k] = ids.setdefault(v, SIZES["vocab_size"] - 1 - len(ids))
        else:
            out[k] = v
    layers = kept or out.get("num_hidden_layers")
    if kept is not None:
        for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
            if key in out:
                out[key] = kept
    if isinstance(depth, int) and layers is not None:
        for k, v in out.items():  # per-layer lists: one entry per layer
            if (isinstance(v, list) or isinstance(v, str) and k in TYPE_LISTS) and len(v) == depth > 1:
                out[k] = v[:layers]
        if isinstance(out.get("per_layer_config"), dict):  # {layer index: what differs}
            out["per_layer_config"] = {i: c for i, c in out["per_layer_config"].items() if int(i) < layers}
    if "head_dim" in out and out["head_dim"] is None and out.get("num_attention_heads"):  # else derived from sizes
        out["head_dim"] = out.get("hidden_size", 64) // out["num_attention_heads"]
    if "kv_lora_rank" in out and "num_attention_heads" in out:  # MLA: one latent, as many key heads as queries
        out["num_key_value_heads"] = out["num_attention_heads"]
    return out


def tiny_config(model_type: str):
    """The config class's defaults, shrunk (`shrink`), with the architecture's OVERRIDES, no token ids beyond the
    byte vocabulary, and eager attention (the path every torch build runs)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    cfg = shrink(cls().to_dict())
    for k in ("transformers_version", "architectures", "_name_or_path", "torch_dtype", "dtype", "auto_map"):
        cfg.pop(k, None)
    for k, v in OVERRIDES.get(model_type, {}).items():  # a dict for a nested config changes only its keys
        cfg[k] = {**cfg[k], **v} if isinstance(v, dict) and isinstance(cfg.get(k), dict) else v
    config = cls(**cfg)
    config._attn_implementation = "eager"
    return config


def tiny_model(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random causal LM of `model_type` (seeded), in eval mode."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    return model.eval()


# ----------------------------------------------------------------------------------------------------------------
# the audit, as `fcaudit audit DIR` runs it

def audit_dir(ckpt: Path, out: Path):
    """`fcaudit audit ckpt --out out --eval 4 --calib 4 --window 16 --randomizations 2 --batch-size 4 --quiet`,
    through the function the command calls."""
    from fcaudit.checkpoint_audit import audit_checkpoint
    from fcaudit.config import AuditConfig

    config = AuditConfig(out=str(out), n_eval=WINDOWS, n_calib=WINDOWS, window=WINDOW, randomizations=R, seed=0,
                         batch_size=WINDOWS, quiet=True, device="cpu", flags=True)
    return audit_checkpoint(str(ckpt), "embedded", config)


def describe(result, said: str) -> tuple[Counter, str]:
    """(sites per kind, the row's text) of an audit's result and what it printed: the controller's notes (the
    mechanisms it leaves unaudited) in full, the beginning of each other note."""
    kinds = Counter(result.config["controller"]["kinds"])
    skipped = [f.line for f in result.replay.findings if f.check == "controller"]
    notes = [ln.removeprefix("note: ") for ln in said.splitlines() if ln.startswith("note: ")]
    others = [n if len(n) <= NOTE else n[:NOTE] + "…" for n in notes if not any(s in n for s in skipped)]
    text = ", ".join(f"{k} x{n}" for k, n in kinds.items()) + f"; exact replay {result.replay.bit_equal}"
    return kinds, text + "".join(f"; {n}" for n in skipped) + "".join(f"; note: {n}" for n in others)


def audit_one(model_type: str, why: str | None) -> Row:
    """One architecture's row: built, saved, audited; any error caught and said in one line."""
    start = time.perf_counter()
    row = Row(model_type, why, "not built", "", causal_lm_name(model_type))
    try:
        model = tiny_model(model_type)
    except Exception as e:  # noqa: BLE001 (a config transformers cannot build at this size: the benchmark's fault)
        row.line = f"{type(e).__name__}: {one_line(e, 160)}"
        row.seconds = time.perf_counter() - start
        return row
    with tempfile.TemporaryDirectory() as tmp:
        try:
            model.save_pretrained(Path(tmp) / "ckpt")
            del model
            said = io.StringIO()
            with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
                result = audit_dir(Path(tmp) / "ckpt", Path(tmp) / "audit")
            row.kinds, row.line = describe(result, said.getvalue())
            row.status = "audited"
        except FcauditError as e:  # the temporary directory named as the CLI's argument
            row.status, row.line = "refused", str(e).replace(str(Path(tmp) / "ckpt"), "DIR")
        except Exception as e:  # noqa: BLE001 (a traceback: fcaudit's bug, counted as one)
            tb = traceback.extract_tb(e.__traceback__)[-1]
            row.status = "bug"
            row.line = f"{type(e).__name__}: {one_line(e, 160)} ({Path(tb.filename).name}:{tb.lineno})"
    row.seconds = time.perf_counter() - start
    return row


# ----------------------------------------------------------------------------------------------------------------
# the table and its summary

def refusal_group(line: str) -> str:
    """A refusal's reason without the architecture's names, paths and numbers, to count alike refusals together."""
    names = r"\S+\.\S+|(?<!\w)'[^']*'(?!\w)|\b(?!MoE\b)\w*[a-z]\w*[A-Z]\w*\b|\d+"  # paths, quotes, classes
    head = re.sub(names, "…", line.split(";")[0]).strip()
    return head if len(head) <= NOTE else head[:NOTE] + "…"


def found_none(row: Row) -> bool:
    return row.status == "refused" and any(s in row.line for s in ("no controller adapter", "no controller fcaudit"))


def summary(rows: list[Row]) -> list[str]:
    """The counts over the architectures with a controller (model types, and the causal LM classes they load), the
    refusals grouped, each traceback, and by name those in which fcaudit found none; then the others' counts."""
    ctl = [r for r in rows if r.controlled]
    by = {s: [r for r in ctl if r.status == s] for s in ("audited", "refused", "bug", "not built")}
    classes = {r.cls for r in ctl}
    exact = sum("exact replay True" in r.line for r in by["audited"])
    # a gate in the source, but the audit found only routers and named nothing it left out
    partial = [r.model_type for r in by["audited"] if GATES in r.controlled and set(r.kinds) <= {"expert_router"}
               and "not audited" not in r.line]
    lines = [f"{len(ctl)} architectures with an input-dependent controller ({len(classes)} causal LM classes): "
             f"{len(by['audited'])} audited with zero code ({len({r.cls for r in by['audited']})} classes; exact "
             f"replay {exact}; {len(by['audited']) - len(partial)} with every kind of controller their source has "
             f"found or named), {len(by['refused'])} refused, {len(by['bug'])} fcaudit bugs (tracebacks), "
             f"{len(by['not built'])} not built"]
    lines += grouped(by["refused"])
    lines += [f"  {r.status}: {r.model_type}: {r.line}" for r in by["bug"] + by["not built"]]
    missed = [r.model_type for r in ctl if found_none(r)]
    lines.append(f"with a controller in which fcaudit found none ({len(missed)}): {' '.join(missed) or '-'}")
    lines.append(f"audited, but with a gate in their source that fcaudit neither audited nor named ({len(partial)}): "
                 f"{' '.join(partial) or '-'}")
    rest = [r for r in rows if not r.controlled]
    anyway = [r.model_type for r in rest if r.status == "audited"]
    lines.append(f"{len(rest)} architectures without one: {sum(found_none(r) for r in rest)} refused as having "
                 f"none, {sum(r.status == 'refused' and not found_none(r) for r in rest)} refused otherwise, "
                 f"{len(anyway)} audited ({' '.join(anyway) or '-'}), {sum(r.status == 'not built' for r in rest)} "
                 f"not built, {sum(r.status == 'bug' for r in rest)} fcaudit bugs")
    lines += grouped([r for r in rest if r.status == "refused" and not found_none(r)], "refused otherwise")
    lines += [f"  only a selection fcaudit has no kind for: {r.model_type} ({SELECTIONS[r.model_type]}): {r.status}"
              for r in rest if r.model_type in SELECTIONS]
    unbuilt = [r.model_type for r in rest if r.status == "not built"]
    return lines + ([f"  not built {len(unbuilt)} (see their rows): {' '.join(unbuilt)}"] if unbuilt else [])


def grouped(rows: list[Row], what: str = "refused") -> list[str]:
    """One line per kind of refusal, the most frequent first, naming the architectures."""
    groups: dict[str, list[str]] = {}
    for r in rows:
        groups.setdefault(refusal_group(r.line), []).append(r.model_type)
    return [f"  {what} {len(names)}: {why} ({' '.join(names)})"
            for why, names in sorted(groups.items(), key=lambda g: -len(g[1]))]


def main(argv: list[str] | None = None) -> list[Row]:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", help="these model types")
    p.add_argument("--controlled", action="store_true", help="only the architectures with a controller")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # save_pretrained's, one per architecture
    logging.disable(logging.WARNING)  # transformers' notes on kernels it falls back from
    torch.set_num_threads(1)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}", flush=True)
    start = time.perf_counter()
    rows = []
    unknown = sorted(set(args.only or ()) - set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
    if unknown:
        p.error(f"not a causal LM model type of transformers {transformers.__version__}: {' '.join(unknown)}")
    for mt in args.only or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        why = controlled(mt)
        if args.controlled and why is None:
            continue
        row = audit_one(mt, why)
        rows.append(row)
        mark = "controller" if why else "selection" if mt in SELECTIONS else "none"
        print(f"{mt:26s} {mark:10s} {row.status:9s} {row.seconds:5.1f}s {row.line}", flush=True)
    print(f"wall {time.perf_counter() - start:.0f} s", flush=True)
    for line in summary(rows):
        print(line, flush=True)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
