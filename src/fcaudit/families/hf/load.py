"""Loading Hugging Face checkpoints (config.json + safetensors) with transformers, the optional extra fcaudit[hf].

transformers never runs a checkpoint's code here (a checkpoint that needs it is refused first), reads safetensors when
there are any, and reads a .bin only after torch's restricted unpickler has opened it (fcaudit.weights)."""

from __future__ import annotations

import functools
import inspect
import json
import logging
import math
import os
import pickle
import shutil
from pathlib import Path

import torch

from fcaudit.errors import FcauditError, one_line
from fcaudit.held_warnings import warnings_held
from fcaudit.hub import resolve
from fcaudit.placement import require_accelerate
from fcaudit.weights import (PICKLE_SUFFIXES, check_depth, check_sizes, layer_of, load_pickled,
                             refuse_remote_code, stored_shapes, weight_files)

MIN_TRANSFORMERS = 5  # the MoE refactor: routers return (logits, top-k weights, top-k index), experts as 3-D weights


def require_transformers(what: str = "auditing Hugging Face models"):
    """The transformers module, or a one-line error naming the install command: called before any work that
    needs it (a load, a build, the demo)."""
    try:
        import transformers
    except ImportError:
        raise FcauditError(f"{what} needs transformers, an optional extra: pip install -e '.[hf]' in fcaudit's "
                           "clone") from None
    transformers.utils.logging.disable_progress_bar()  # fcaudit shows its own progress
    kernels = logging.getLogger("transformers.integrations.hub_kernels")
    if _torch_path_note not in kernels.filters:
        kernels.addFilter(_torch_path_note)
    if int(transformers.__version__.split(".")[0]) < MIN_TRANSFORMERS:
        raise FcauditError(f"transformers {transformers.__version__} is too old for fcaudit (needs >= "
                           f"{MIN_TRANSFORMERS}): pip install -U -e '.[hf]' in fcaudit's clone")
    return transformers


def _torch_path_note(record: logging.LogRecord) -> bool:
    """Drops transformers' note that a mixer (Mamba's scan, a causal conv) runs its reference PyTorch code: the path
    fcaudit audits on a CPU (the recipes' op sites are its torch functions), said once per function on every run."""
    return "falling back to its reference PyTorch implementation" not in record.getMessage()


# Every spelling of the expert count and top-k in transformers' configs: ERNIE-4.5 moe_num_experts and moe_k,
# Hunyuan-MoE and LongCat-Flash moe_topk, DBRX moe_num_experts and moe_top_k (in its ffn_config), Gemma-4
# top_k_experts, Kimi-Linear and Bailing num_experts_per_token
EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "moe_top_k", "top_k_experts")


def looks_like_hf_moe(config: dict) -> bool:
    """Whether a config.json describes a transformers MoE model (top-k routing over several experts), itself or in a
    config nested in it: a multimodal checkpoint's `text_config` (Llama 4's, Gemma-4's: AutoModelForCausalLM loads
    their language model), DBRX's `ffn_config`."""
    return isinstance(config.get("model_type"), str) and any(
        any(c.get(k) for k in EXPERTS_KEYS) and any(c.get(k) for k in TOP_K_KEYS)
        for c in (config, *(v for v in config.values() if isinstance(v, dict))))


def looks_like_hf(config: dict) -> bool:
    """Whether a config.json is a transformers model's: save_pretrained writes its version, or it is an MoE's (a
    config written by hand). Its controllers are found once it is loaded."""
    return isinstance(config.get("model_type"), str) and ("transformers_version" in config or looks_like_hf_moe(config))


def _warnings_after(load):
    """`load` with transformers' warnings held (warnings_held) from the moment transformers is imported."""
    @functools.wraps(load)
    def held(*args, **kwargs):
        require_transformers()  # its loggers and their handler exist
        with warnings_held():
            return load(*args, **kwargs)
    return held


@_warnings_after
def load_hf(path_or_id: str | os.PathLike, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
            device_map: str | dict | None = None, offload_folder: str | os.PathLike | None = None):
    """The model in eval mode with eager experts, from a checkpoint directory or hub id (offline: fails in seconds
    unless cached). `device_map` (not `device`) spreads it with accelerate, putting its "disk" in `offload_folder`."""
    require_transformers()
    if device_map is not None:
        require_accelerate()
    from transformers import AutoModelForCausalLM

    dir = resolve(path_or_id)
    if not (dir / "config.json").is_file():
        raise FcauditError(f"{dir} has no config.json: pass a Hugging Face checkpoint directory (config.json + safetensors)")
    safetensors = _check_files(dir)
    config = _config(dir)
    # transformers' load report lists every unused checkpoint weight (hundreds for Llama 4's vision tower); what
    # matters of it is checked below. A filter, not a level: at WARNING that logger makes transformers check TP plans.
    reports: list[str] = []  # dropped, kept for an error message

    def quiet(record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in record.getMessage():
            reports.append(record.getMessage())
            return False
        return True

    report = logging.getLogger("transformers.modeling_utils")
    report.addFilter(quiet)
    fresh = offload_folder is not None and not Path(offload_folder).exists()  # transformers makes it early
    try:
        placed = {} if device_map is None else {"device_map": device_map, "offload_folder": offload_folder}
        model, info = AutoModelForCausalLM.from_pretrained(dir, config=config,
                                                           dtype=dtype if dtype is not None else "auto",
                                                           experts_implementation="eager", output_loading_info=True,
                                                           trust_remote_code=False, use_safetensors=safetensors,
                                                           **placed)
    except pickle.UnpicklingError:  # _check_files opened every .bin through the same restricted unpickler
        raise FcauditError(f"{dir}: a weights file is not plain tensors: convert it to safetensors and pass that "
                           "checkpoint") from None
    except Exception as e:  # noqa: BLE001 (a model class's code raises any type: RWKV's init of 1 layer divides by 0)
        if fresh:  # a failed load leaves nothing behind: the folder is this call's own (weights written into it)
            shutil.rmtree(offload_folder, ignore_errors=True)
        msg = one_line(e, 100_000)
        if device_map is not None and offload_folder is None and "offload" in msg:
            raise FcauditError("the device map puts weights on disk: pass --offload-folder DIR (room for them)") \
                from None
        if device_map is not None and "device_map" in msg:  # a map that leaves out modules, or names others
            raise FcauditError(f"the device map does not fit {dir} ({one_line(e)}): give every module a device "
                               "(or use --device-map auto)") from None
        # the report the message refers to is the one filtered out: its first mismatched weight
        mismatch = next((line for r in reports for line in r.splitlines() if "size mismatch" in line), None)
        if mismatch:  # "KEY | ... | ... - ckpt torch.Size(..) vs model torch.Size(..)"
            key, _, why = (part.strip() for part in mismatch.split("|", 2))
            raise FcauditError(f"{dir}: config.json does not fit the weights ({key}: {why.split(' - ', 1)[-1]}): use "
                               "the config.json saved with these weights") from None
        raise FcauditError(f"transformers cannot load {dir} ({type(e).__name__}: {one_line(e)}): pass a complete "
                           f"checkpoint directory of a transformers>=5 causal LM") from None
    finally:
        report.removeFilter(quiet)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise FcauditError(f"{dir} lacks {len(missing)} weights of {type(model).__name__} (e.g. {missing[0]}), which "
                           f"would be random: pass a complete checkpoint directory")
    _check_unread(dir, model, info.get("unexpected_keys") or ())
    return (model if device_map is not None else model.to(device)).eval()


def _check_unread(dir: Path, model, unexpected) -> None:
    """Refuse stored weights that the model config.json describes does not read, of its own modules or layers (a
    layer count lowered, a bias turned off): transformers leaves them unread, and the audit would run another model
    than the one saved. Other unread weights belong to no part of it (a multimodal checkpoint's vision tower), the
    stale keys transformers' classes name are dropped before, and the multi-token prediction layers a checkpoint stores
    after the decoder's (the config's num_mtp_layers) are not a causal LM's."""
    mtp = getattr(model.config.get_text_config(), "num_mtp_layers", 0)
    mtp = mtp if isinstance(mtp, int) and not isinstance(mtp, bool) else 0
    modules = dict(model.named_modules())
    for key in sorted(unexpected):
        at = layer_of(key)
        layers = modules.get(at[0][:-1]) if at else None
        if isinstance(layers, torch.nn.ModuleList):  # the model's numbered layers: unread only past them, as MTP's
            unread = not len(layers) <= at[1] < len(layers) + mtp
        else:  # elsewhere: a weight of a module the model has (its bias, where the config turned biases off)
            parent = key.rpartition(".")[0]
            unread = bool(parent) and parent in modules
        if unread:
            raise FcauditError(f"the weights in {dir} do not match its config.json (the weights hold {key}, which the "
                               "model it describes does not read): use the config.json saved with these weights")


def _config(dir: Path):
    """transformers' config of `dir`, its sizes checked against the weights' headers before any module is built (a
    dry run of a config with a huge hidden_size, or with its sizes deleted, would allocate gigabytes). A config class
    raises every kind of error on a value of the wrong type: each is one line."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(dir, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 (ValueError, TypeError, KeyError, IndexError, ZeroDivisionError, ...)
        raise FcauditError(f"{dir / 'config.json'} has a value transformers refuses ({type(e).__name__}: "
                           f"{one_line(e, 120)}): use the config.json saved with these weights") from None
    if type(config) not in AutoModelForCausalLM._model_mapping:  # an encoder, a vision model: no causal LM head
        raise FcauditError(f"{dir} holds a {config.model_type!r} model, for which transformers has no causal LM class "
                           "(AutoModelForCausalLM): fcaudit's commands score next-token predictions; load the model "
                           "yourself and pass fca.audit its controller (fca.Controller.from_modules) and a loss_fn")
    text = config.get_text_config()
    check_scan(text, str(dir / "config.json"), "set {key} to at most {fits} in config.json")
    if getattr(config, "quantization_config", None) is None:  # packed quantized weights hold fewer elements
        stored = stored_shapes(dir)
        check_depth(dir, stored, *_stored_depth(text))
        check_sizes(lambda: AutoModelForCausalLM.from_config(config), dir, stored)
    return config


# model_type -> the config field that counts the decoder layers its weights hold, where num_hidden_layers counts
# something else (HRM: its cache slots, num_layers_per_stack x H_cycles x (L_cycles + 1), of each stack's layers)
STORED_DEPTH = {"hrm_text": "num_layers_per_stack"}


def _stored_depth(config) -> tuple[str, object]:
    """The config's field that counts the decoder layers its weights hold, and its value: num_hidden_layers, or what
    the config class derives it from (LongCat-Flash: 2 x num_layers, two attention sublayers in each layer)."""
    if (field := STORED_DEPTH.get(getattr(config, "model_type", None))) is not None:
        return field, getattr(config, field, None)
    derived = inspect.getattr_static(type(config), "num_hidden_layers", None)
    if isinstance(derived, property) and derived.fget is not None:
        read = [n for n in derived.fget.__code__.co_names if _is_count(getattr(config, n, None))]
        if len(read) == 1:
            return read[0], getattr(config, read[0])
    return "num_hidden_layers", getattr(config, "num_hidden_layers", None)


# a chunked scan's (Mamba-2 and its hybrids, xLSTM) chunk size and head count, in each config's spelling
CHUNK_KEYS = ("mamba_chunk_size", "chunk_size")
SCAN_HEADS_KEYS = ("mamba_n_heads", "mamba_num_heads", "n_mamba_heads", "num_heads")
SCAN_BYTES = 2**28  # the most one window's chunk x chunk tensors in one layer may take


def check_scan(config, where: str, fix: str) -> None:
    """Refuse a chunked scan whose chunk makes one window's forward pass allocate more than SCAN_BYTES, before
    any pass runs (the controller's discovery probe would run out of memory, or take minutes, with no word).
    transformers' torch scan (the path fcaudit audits) pads a window to a multiple of the chunk and holds three
    float32 [head, chunk, chunk] tensors per chunk (decays, scores, their product): a short window costs a chunk's.
    `where` names the config; `fix` says where to set the chunk, a format of {key} and {fits}."""
    key = next((k for k in CHUNK_KEYS if _is_count(getattr(config, k, None))), None)
    heads = next((getattr(config, k) for k in SCAN_HEADS_KEYS if _is_count(getattr(config, k, None))), None)
    if key is None or heads is None or heads < 1:
        return
    chunk = getattr(config, key)
    need = 3 * 4 * heads * chunk**2
    if need > SCAN_BYTES:
        fits = 1 << max(0, math.isqrt(SCAN_BYTES // (12 * heads)).bit_length() - 1)  # a power of two within
        raise FcauditError(f"{where} has {key}={chunk}: transformers' torch scan pads a window to a multiple of "
                           f"{chunk} tokens and holds {heads} heads x {chunk} x {chunk} float32 scores per chunk of a "
                           f"window, ~{need / 2**30:.1f} GiB in each layer: {fix.format(key=key, fits=fits)} (the "
                           "chunk changes the scan's result only in rounding)")


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_files(dir: Path) -> bool:
    """Refuse, before transformers reads `dir`, a checkpoint that needs its own code, shards outside `dir` and a .bin
    the restricted unpickler refuses. Returns whether the weights are safetensors (then transformers reads no other)."""
    from transformers import CONFIG_MAPPING

    try:
        config = json.loads((dir / "config.json").read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise FcauditError(f"{dir / 'config.json'} is not valid JSON ({one_line(e, 80)}): restore it from the "
                           "checkpoint") from None
    if not isinstance(config, dict):
        raise FcauditError(f"{dir / 'config.json'} is not a JSON object: restore it from the checkpoint")
    refuse_remote_code(dir, config, lambda model_type: model_type in CONFIG_MAPPING)
    _refuse_encoder_decoder(dir, config)
    files = weight_files(dir)
    for f in files:
        if f.suffix in PICKLE_SUFFIXES:
            load_pickled(f, mmap=True)
    return bool(files) and all(f.suffix == ".safetensors" for f in files)


def _refuse_encoder_decoder(dir: Path, config: dict) -> None:
    """An encoder-decoder checkpoint is audited through its decoder with an encoder input given, which a directory
    does not say: the API route (seq2seq.py), named in one line."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    if config.get("is_encoder_decoder") and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise FcauditError(f"{dir} holds an encoder-decoder model ({model_type}), and `fcaudit audit` loads causal "
                           "LMs: audit its decoder through the API: load it with transformers, wrap it as "
                           "fcaudit.families.hf.seq2seq.DecoderLM(model, encoder_ids) (the encoder's input, the same "
                           "for every window), describe its routers with fca.Controller.from_modules(lm, "
                           "'model.decoder.**.router', codec=...) (Switch Transformers: "
                           "fcaudit.families.hf.codecs.SwitchRoute(num_experts, expert_capacity)), then fca.audit")
