"""Where and in which precision a model runs: `--device` and `--dtype` as the CLI and the library accept them."""

import torch

from fcaudit.errors import FcauditError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
            "fp64": "float64", "double": "float64"}


def resolve_device(name: str | torch.device) -> torch.device:
    """auto -> CUDA when visible, else CPU; an explicit CUDA device without CUDA is a clear error."""
    if str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise FcauditError(f"unknown device {name!r}: use auto, cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FcauditError("--device cuda but no CUDA device is visible: use --device cpu or install a CUDA build of "
                           "torch")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise FcauditError(f"--device {name}: {torch.cuda.device_count()} CUDA device(s) are visible, numbered from "
                           "0; pass one of them (or cuda)")
    backend = getattr(torch, device.type, None)  # torch.mps, torch.xpu, ...: a type this build may lack
    if device.type not in ("cpu", "cuda") and not (callable(getattr(backend, "is_available", None))
                                                   and backend.is_available()):
        raise FcauditError(f"--device {name}: this torch build has no {device.type} device; use auto, cpu or cuda")
    return device


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """torch.dtype from a name such as float32, bf16 or torch.bfloat16."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in DTYPES:
        raise FcauditError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16: the name config.json and metadata hold."""
    return str(dtype).removeprefix("torch.")
