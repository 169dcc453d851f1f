"""Where a model's weights and computation are: one device, or spread by accelerate's `device_map` over several, with
layers offloaded to the CPU or disk (their parameters on the meta device between forwards). The audit needs the device
its inputs go to, every weight's bytes (for the checkpoint hash), and whether it is dispatched at all."""

from __future__ import annotations

import json
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from fcaudit.errors import FcauditError, one_line

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's own device-map strategies


def parse_device_map(spec: str) -> str | dict[str, str | int]:
    """`--device-map`: one of accelerate's strategies (auto: fill the GPUs, then the CPU, then disk), or a JSON file
    of {module path: device} ("cuda:0", 1, "cpu", "disk"). accelerate is checked first: a map needs it."""
    require_accelerate()
    if spec in STRATEGIES:
        return spec
    path = Path(spec)
    if not path.is_file():
        raise FcauditError(f"--device-map {spec!r}: pass {', '.join(STRATEGIES)} or a JSON file of "
                           '{"module.path": "cuda:0" | "cpu" | "disk"}')
    try:
        mapping = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FcauditError(f"--device-map {spec}: not valid JSON ({one_line(e, 80)}); fix the file") from None
    if not isinstance(mapping, dict) or not mapping or not all(isinstance(v, (str, int)) for v in mapping.values()):
        raise FcauditError(f'--device-map {spec}: pass a JSON object of {{"module.path": device}}, e.g. '
                           '{"model.embed_tokens": 0, "model.layers": 1, "lm_head": "cpu"}')
    gpus = [v for v in mapping.values() if isinstance(v, int) or str(v).startswith("cuda")]
    if gpus and not torch.cuda.is_available():
        raise FcauditError(f"--device-map {spec} puts modules on {gpus[0]!r} but no CUDA device is visible: map them "
                           'to "cpu" or "disk", or run where the GPUs are')
    unknown = [v for v in mapping.values() if v not in gpus and v not in ("cpu", "disk", "meta")]
    if unknown:
        raise FcauditError(f"--device-map {spec}: unknown device {unknown[0]!r}; use cuda:N (or N), cpu or disk")
    return mapping


def require_accelerate() -> None:
    """One line naming the extra to install, before any work that needs accelerate."""
    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise FcauditError("a device map needs accelerate, an optional extra: pip install -e '.[hf]' in fcaudit's "
                           "clone") from None


def input_device(model: nn.Module) -> torch.device:
    """The device the model's input ids go to: its top-level hook's execution device when accelerate dispatched it,
    else the device of its first parameter that holds data (the CPU when none does)."""
    hook = getattr(model, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    p = next((p for p in model.parameters() if not p.is_meta), None)
    return p.device if p is not None else torch.device("cpu")


def device_map(model: nn.Module) -> dict[str, str] | None:
    """The `hf_device_map` transformers keeps of a model loaded with a device_map (module path -> device, "cpu" or
    "disk"), as strings; None for a model on one device that nothing dispatched."""
    mapping = getattr(model, "hf_device_map", None)
    if not isinstance(mapping, dict):
        return None
    return {str(k): str(v if not isinstance(v, int) else f"cuda:{v}") for k, v in mapping.items()}


def is_dispatched(model: nn.Module) -> bool:
    """Whether accelerate spread the model over several devices or offloaded any of it."""
    mapping = device_map(model)
    return mapping is not None and (len(set(mapping.values())) > 1 or any(p.is_meta for p in model.parameters()))


def _onloaded(module: nn.Module) -> AbstractContextManager | None:
    """accelerate's align_module_device, in which an offloaded module's own parameters hold their data on the CPU;
    None for a module that is not offloaded."""
    if not getattr(getattr(module, "_hf_hook", None), "offload", False):
        return None
    from accelerate.utils import align_module_device

    return align_module_device(module, torch.device("cpu"))


def off_cpu(t: torch.Tensor) -> bool:
    """Whether `t` lives on an accelerator (where a probe that may trip a device-side assert must not run)."""
    return t.device.type != "cpu"


@contextmanager
def on_cpu(module: nn.Module) -> Iterator[None]:
    """Within the block every weight of `module` and its submodules holds its data on the CPU: an offloaded
    module's are loaded there, any other's are CPU copies; afterwards each holds its own data again (no copy back)."""
    with ExitStack() as stack:
        for m in module.modules():
            if (onloaded := _onloaded(m)) is not None:
                stack.enter_context(onloaded)
                continue
            for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)):
                if t.device.type != "cpu":
                    stack.callback(setattr, t, "data", t.data)  # its own data again on the way out
                    t.data = t.data.cpu()
        yield


def named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """named_parameters(), then named_buffers(), each tensor with its data, valid until the next is asked for: an
    offloaded module's are loaded one module at a time (named_* lists a module's own tensors together)."""
    owners = dict(model.named_modules())
    for kind in ("parameters", "buffers"):
        with ExitStack() as held:
            loaded = None  # the owner whose offloaded tensors `held` keeps loaded
            for name, t in getattr(model, f"named_{kind}")():
                if not t.is_meta:
                    held.close()  # the last offloaded module goes back before another's tensors are read
                    loaded = None
                    yield name, t
                    continue
                owner, _, leaf = name.rpartition(".")
                if owner != loaded:
                    held.close()
                    held.enter_context(_onloaded(owners[owner]) or nullcontext())
                    loaded = owner
                t = getattr(owners[owner], leaf)
                if t.is_meta:
                    raise FcauditError(f"{name} has no data (it is on the meta device, and accelerate did not offload "
                                       f"it): load the model's weights before auditing it")
                yield name, t
