"""What fcaudit reads of a checkpoint directory: its weights and nothing that runs. Safetensors first; a pickle file
(.bin, .pt, .pth, which a public checkpoint may ship) only through torch's restricted unpickler. An index's shards
must lie inside the directory, config.json's sizes are checked against the stored tensors' before allocation, and a
config asking for its own modeling code (`auto_map`) loads only where fcaudit or transformers has the model."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import warnings
import zipfile
from pathlib import Path
from typing import Callable, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fcaudit.errors import FcauditError, one_line

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLED = "pytorch_model.bin"
PICKLED_INDEX = "pytorch_model.bin.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def shards(dir: Path, index_name: str) -> tuple[dict[str, str], list[Path]]:
    """(weight_map, shard paths) of an index in `dir`, every shard inside `dir`: not an absolute path, one through
    '..', or a link to another checkpoint's weights (a hub snapshot's links into its own cache are its files)."""
    index = dir / index_name
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise FcauditError(f"{index} is not a valid weights index (no weight_map of file names): re-download the "
                           "checkpoint") from None
    paths = []
    root = os.path.normpath(os.path.abspath(dir))
    inside = [os.path.realpath(root)]
    if Path(root).parent.name == "snapshots":  # the hub's cache: a snapshot's files link to its repo's blobs/
        inside.append(os.path.realpath(Path(root).parent.parent / "blobs"))
    for name in sorted(set(weight_map.values())):
        if "\0" in name or not name:  # no file has such a name (os.path raises on a NUL byte)
            raise FcauditError(f"{index} lists the shard {name!r}, which is not inside {dir}: an index names files "
                               "of its own directory; re-download the checkpoint")
        full = os.path.normpath(os.path.join(root, name))
        real = os.path.realpath(full)
        if (os.path.isabs(name) or not full.startswith(root + os.sep)
                or not any(real.startswith(d + os.sep) for d in inside)):
            raise FcauditError(f"{index} lists the shard {name!r}, which is not inside {dir}: an index names files "
                               "of its own directory; re-download the checkpoint")
        if not os.path.isfile(full):
            raise FcauditError(f"shard {name} listed in {index} is missing: download it")
        paths.append(Path(full))
    return weight_map, paths


def _index(dir: Path) -> str | None:
    """The index of `dir`'s shards when it has no model.safetensors (the safetensors index first)."""
    if (dir / SAFETENSORS).is_file():
        return None
    return next((index for index in (SAFETENSORS_INDEX, PICKLED_INDEX) if (dir / index).is_file()), None)


def weight_files(dir: Path) -> list[Path]:
    """The files holding `dir`'s weights, safetensors first: model.safetensors, the shards of its index, else
    pytorch_model.bin or the shards of its index; [] when there are none."""
    index = _index(dir)
    return shards(dir, index)[1] if index else [f for f in (dir / SAFETENSORS, dir / PICKLED) if f.is_file()][:1]


def load_pickled(path: Path, *, mmap: bool = False) -> dict[str, torch.Tensor]:
    """A pickle-format weights file through torch's restricted unpickler only (tensors and plain containers)."""
    try:  # only torch's zip format can be memory-mapped, not the legacy one
        with warnings.catch_warnings():  # torch's unpickler warns (pickle protocol, TorchScript) before it refuses
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and zipfile.is_zipfile(path))
    except Exception as e:  # noqa: BLE001 (an UnpicklingError, or a torn file: the same fix; never torch's advice)
        raise FcauditError(f"{path} is not a plain weights file (torch's restricted unpickler refused it: "
                           f"{type(e).__name__}): convert it to safetensors (safetensors.torch.save_file of its "
                           "state dict, where its source is trusted) and pass that checkpoint") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise FcauditError(f"{path} holds no state dict of tensors: convert the checkpoint's weights to safetensors "
                           "and pass that checkpoint")
    return state


def _corrupt(path: Path, e: Exception) -> FcauditError:
    return FcauditError(f"{path} is corrupt or truncated ({type(e).__name__}): re-download or rewrite the checkpoint")


def read_state_dict(dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of `dir`'s weights, in `weight_files`' order of preference; a shard's key its index does not
    list is refused."""
    index = _index(dir)
    weight_map, files = shards(dir, index) if index else ({}, weight_files(dir))
    if not files:
        raise FcauditError(f"no weights in {dir}: expected {SAFETENSORS}, {SAFETENSORS_INDEX} with shards, or "
                           f"{PICKLED}")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        if path.suffix in PICKLE_SUFFIXES:
            state.update(load_pickled(path))
            continue
        try:
            state.update(load_file(str(path)))
        except Exception as e:  # noqa: BLE001 (SafetensorError, OSError: truncated or not safetensors at all)
            raise _corrupt(path, e) from None
    stray = sorted(set(state) - set(weight_map)) if index else []
    if stray:
        raise FcauditError(f"key {stray[0]!r} is in a shard but not in {index}: re-download {dir}")
    return state


def stored_shapes(dir: Path) -> dict[str, tuple[int, ...]]:
    """Every stored tensor's shape, from the safetensors headers alone (pickle files are memory-mapped); {} when
    `dir` has no weights (the loader says what is missing)."""
    stored: dict[str, tuple[int, ...]] = {}
    for f in weight_files(dir):
        if f.suffix in PICKLE_SUFFIXES:
            stored.update({k: tuple(v.shape) for k, v in load_pickled(f, mmap=True).items()})
            continue
        try:
            with safe_open(str(f), framework="pt") as st:
                stored.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
        except Exception as e:  # noqa: BLE001 (SafetensorError, OSError)
            raise _corrupt(f, e) from None
    return stored


_FLOATS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def stored_dtype(dir: Path) -> torch.dtype | None:
    """The dtype of `dir`'s floating-point weights, from the safetensors headers alone (pickle files are memory-mapped):
    the checkpoint's own precision, which a load keeps unless asked otherwise (mixed ones: the type that holds each
    stored value exactly); None when `dir` has no floating weights."""
    found: set[torch.dtype] = set()
    for f in weight_files(dir):
        if f.suffix in PICKLE_SUFFIXES:
            found |= {v.dtype for v in load_pickled(f, mmap=True).values() if v.is_floating_point()}
            continue
        try:
            with safe_open(str(f), framework="pt") as st:
                found |= {_FLOATS[d] for d in (st.get_slice(k).get_dtype() for k in st.keys()) if d in _FLOATS}
        except Exception as e:  # noqa: BLE001 (SafetensorError, OSError)
            raise _corrupt(f, e) from None
    return functools.reduce(torch.promote_types, sorted(found, key=str)) if found else None


LOAD_FACTOR = 2  # a config.json may imply at most this many times the parameters its weights hold
# a key's first numbered module, whatever its list is named: blocks.3.attn..., model.layers.3.mlp...,
# bert.encoder.layer.3..., XLM's transformer.attentions.3... and transformer.ffns.3...
_LAYER = re.compile(r"(?:^|\.)(\d+)\.")


def layer_of(key: str) -> tuple[str, int] | None:
    """(prefix, index) of a weight inside a numbered layer, the first numbered module of its key ("model.layers.3.mlp.
    experts.5.w": ("model.layers.", 3)), else None."""
    m = _LAYER.search(key)
    return (key[:m.start(1)], int(m.group(1))) if m else None


def check_depth(dir: Path, stored: Mapping[str, tuple[int, ...]], field: str, layers) -> None:
    """Refuse a config.json that asks for more layers than the weights hold, before any module is built: building
    200,000 blocks takes minutes even on the meta device. The weights' depth: the most numbered modules under one
    prefix, whatever the list is named (a multimodal checkpoint's vision tower has its own; XLM keeps a layer's
    parts in lists of their own). A config that states no depth in `field` (None) is left to the size check."""
    if not stored or layers is None:
        return
    held: dict[str, set[int]] = {}
    for key in stored:
        if at := layer_of(key):
            held.setdefault(at[0], set()).add(at[1])
    depth = max((len(v) for v in held.values()), default=0)
    if not isinstance(layers, int) or isinstance(layers, bool) or layers > depth:
        raise FcauditError(f"the weights in {dir} do not match its config.json ({field}={layers!r}, the weights hold "
                           f"{depth} layers): use the config.json saved with these weights")


def check_sizes(build: Callable[[], torch.nn.Module], dir: Path,
                stored: Mapping[str, tuple[int, ...]] | None = None) -> None:
    """Compare the model `build` makes on the meta device (nothing is allocated) with the stored weights (`stored`:
    `stored_shapes(dir)`): each shape, and the number of parameters, so that config.json's sizes (a block_size of
    10**8, a hidden_size its weights do not have) are refused before the model is built for real."""
    stored = stored_shapes(dir) if stored is None else stored
    if not stored:
        return  # the loader says what is missing
    try:  # a model built only to be measured: its constructor's warnings (zero-element tensors) are no one's
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = build()
    except FcauditError:
        raise
    except Exception as e:  # noqa: BLE001 (a library's config class: ZeroDivisionError, OverflowError, ValueError, ...)
        raise FcauditError(f"{dir / 'config.json'} has a value no model can be built with ({type(e).__name__}: "
                           f"{one_line(e, 120)}): use the config.json saved with these weights") from None
    for key, t in model.state_dict().items():
        if key in stored and tuple(t.shape) != stored[key]:
            raise FcauditError(f"the weights in {dir} do not match its config.json ({key}: config.json implies "
                               f"{list(t.shape)}, the weights hold {list(stored[key])}): use the config.json saved "
                               "with these weights")
    # weights stored under other names (a published checkpoint's per-expert keys) still count; a few missing ones
    # are the loader's to name, what is bounded here is the memory a config can make the load take
    implied, held = sum(p.numel() for p in model.parameters()), sum(math.prod(s) for s in stored.values())
    if implied > LOAD_FACTOR * held:
        raise FcauditError(f"the weights in {dir} do not match its config.json (it implies {implied:,} parameters, "
                           f"the weights hold {held:,}): use the config.json saved with these weights")


def refuse_remote_code(dir: Path, config: dict, native: Callable[[str], bool]) -> None:
    """Refuse, before any library reads it, a checkpoint whose config.json's `auto_map` names its own code for a
    model_type that no class of fcaudit's or transformers' loads (`native` is False); the message names the file."""
    auto = config.get("auto_map")
    if not auto or native(str(config.get("model_type"))):
        return
    refs = auto.values() if isinstance(auto, dict) else [auto]
    ref = next((r[0] if isinstance(r, (list, tuple)) and r else r for r in refs), "")
    module = ref.split("--")[-1].rsplit(".", 1)[0] if isinstance(ref, str) else ""  # "repo--modeling_x.XModel"
    named = f"{module}.py, in its auto_map" if module else "its auto_map"
    raise FcauditError(f"{dir / 'config.json'} asks to run the checkpoint's own code ({named}) "
                       f"for model_type {config.get('model_type')!r}, which no library loads natively: fcaudit never "
                       "runs a checkpoint's code; pass a checkpoint of a model transformers or fcaudit implements")
