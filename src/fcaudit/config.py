"""The settings of one audit, from `fcaudit audit`'s flags or `fcaudit.audit`'s keywords: checked once here, recorded
in config.json and compared there when an audit resumes; and the upper bounds that every command's config checks its
counts against (`check_count`)."""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from fcaudit.device import as_dtype
from fcaudit.errors import FcauditError
from fcaudit.io import valid_path
from fcaudit.protocol import Criteria

# Upper bounds, each far above a paper-scale audit (512 + 512 windows of 2048 tokens, R = 20, batch 8) and low enough
# that a mistyped value is refused in one line instead of filling the memory or the disk.
MAX_WINDOWS = 2**20  # --eval, --calib: every evaluation window's coefficients are stored
MAX_WINDOW = 2**17  # --window, tokens: the longest contexts of today's models
MAX_RANDOMIZATIONS = 10_000  # --randomizations: one records file per randomized condition and randomization
MAX_BATCH_SIZE = 4096  # --batch-size: windows per forward pass
MAX_WORLD_SIZE = 4096  # --world-size: processes a dry run plans for
MAX_SEED = 2**63 - 1  # --seed: int64, so numpy, pandas and Parquet keep it exact
MAX_STEPS = 10**7  # train --steps (and the step counts derived from it): the paper's longest run takes 100,000
MAX_MIN_RUN_TIME = 3600.0  # execution --min-run-time, seconds of timing per model

# (flag, keyword, lowest, highest, why the lowest)
_BOUNDS = {
    "n_eval": ("--eval", "n_eval", 2, MAX_WINDOWS, "CrossInput needs a derangement of at least 2 evaluation windows"),
    "n_calib": ("--calib", "n_calib", 1, MAX_WINDOWS, "static profiles need at least 1 calibration window"),
    "window": ("--window", "window", 2, MAX_WINDOW, "a next-token NLL needs 2 tokens"),
    "randomizations": ("--randomizations", "randomizations", 1, MAX_RANDOMIZATIONS, ""),
    "seed": ("--seed", "seed", 0, MAX_SEED, "numpy's generators take no negative seed"),
    "batch_size": ("--batch-size", "batch size", 1, MAX_BATCH_SIZE, ""),
    "world_size": ("--world-size", "world size", 1, MAX_WORLD_SIZE, ""),
}
LossFn = Callable[[Any, Any], Any]


@dataclass(frozen=True)
class AuditConfig:
    """What one audit runs with; None where the inputs decide (windows given to `fca.audit`, the model's context).

    `fca.audit(..., config=config)` takes one whole, or builds one from its keyword settings
    (`fca.audit(..., seed=1)` is `AuditConfig(seed=1)`); `fcaudit audit` builds one from its flags, with `flags=True`
    so that errors name the flags. Each integer is bounded by its `fcaudit.config.MAX_*`.

    Parameters
    ----------
    out
        The audit directory; None writes a new temporary one.
    n_eval
        `fcaudit audit`: evaluation windows drawn from the test split.
    n_calib
        `fcaudit audit`: calibration windows drawn from the validation split.
    window
        `fcaudit audit`: tokens per window (None: the model's context, at most `families.DEFAULT_WINDOW_CAP`).
    randomizations
        Draws of each randomized condition (the paper's R).
    seed
        Seeds every draw (and `fcaudit audit`'s windows): the same seed on the same inputs gives the same records bit
        for bit.
    batch_size
        Windows per forward pass.
    tolerance
        0 demands a bit-equal replay of logits and NLL; above 0, max |Δlogit| and |ΔNLL| up to it pass.
    criteria : fcaudit.Criteria or dict
        The prespecified criteria, fixed in config.json before the audit runs.
    loss_fn
        `loss_fn(output, ids) -> [batch]` instead of the next-token NLL (the replay check still compares logits).
    model_info
        What config.json records of the model; "family" names the seeds `fca.summarize` pools (default: class, size).
    quiet
        No progress bar or summary table.
    execution
        Also answer question 3 after the audit: on the first evaluation batch, the work the controller decided
        beside what the forward pass computed (observed rows per block) and FLOPs per token, live and with the same
        decisions replayed, the controller disabled (`fcaudit.execution.decided.audit_execution`), written to
        execution.json and read by `AuditResult.execution()`. It changes no record: a resumed audit may add it.
    device
        `fcaudit audit`: where to load the checkpoint.
    dtype
        `fcaudit audit`: the dtype to load it in (None: the checkpoint's).
    revision
        `fcaudit audit`: a hub id's revision.
    device_map
        `fcaudit audit`: spread a Hugging Face model with accelerate (instead of `device`).
    offload_folder
        `fcaudit audit`: where a device map's "disk" weights go.
    family
        `fcaudit audit`: the name `summarize` pools checkpoints by.
    dry_run
        `fcaudit audit`: plan only (sizes and memory), nothing run or written.
    world_size
        `fcaudit audit`: processes a dry run plans for (None: the launcher's).

    Examples
    --------
    >>> config = fca.AuditConfig(randomizations=2, seed=1, out="audits/my-lm")  # for fca.audit(..., config=config)
    >>> fca.AuditConfig(batch_size=0)
    Traceback (most recent call last):
    fcaudit.errors.FcauditError: batch size must be an integer >= 1, got 0
    """

    out: Path | None = None
    n_eval: int | None = None
    n_calib: int | None = None
    window: int | None = None
    randomizations: int = 20
    seed: int = 0
    batch_size: int = 8
    tolerance: float = 0.0
    criteria: Criteria = field(default_factory=Criteria)
    loss_fn: LossFn | None = None
    model_info: Mapping | None = None
    quiet: bool = False
    execution: bool = False
    device: str = "auto"
    dtype: str | None = None
    revision: str | None = None
    device_map: str | None = None
    offload_folder: Path | None = None
    family: str | None = None
    dry_run: bool = False
    world_size: int | None = None
    flags: InitVar[bool] = False

    def __post_init__(self, flags: bool) -> None:
        for name in _BOUNDS:
            value = getattr(self, name)
            if value is not None or name in ("randomizations", "seed", "batch_size"):
                object.__setattr__(self, name, _bounded(name, value, flags))
        t = self.tolerance
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t >= 0):
            raise FcauditError(f"--tolerance {t}: pass a number >= 0" if flags else
                               f"tolerance must be a number >= 0, got {t!r}")
        object.__setattr__(self, "tolerance", float(t))
        object.__setattr__(self, "criteria", _criteria(self.criteria))
        if self.model_info is not None and not isinstance(self.model_info, Mapping):
            raise FcauditError(f"model_info must be a dict (e.g. {{'family': 'my-lm'}}), got "
                               f"{type(self.model_info).__name__}")
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise FcauditError(f"loss_fn must be a function (output, ids) -> [batch], got {type(self.loss_fn).__name__}")
        if self.out is not None:
            object.__setattr__(self, "out", valid_path(self.out, "--out" if flags else "out"))
        if self.dtype is not None:
            as_dtype(self.dtype)
        if self.family is not None and not isinstance(self.family, str):
            raise FcauditError(f"--family {self.family!r}: pass a name, e.g. --family mixtral-seeds")
        if self.family is not None and not self.family.strip():
            raise FcauditError("--family '': pass a name, e.g. --family mixtral-seeds")
        if self.offload_folder is not None and self.device_map is None:
            raise FcauditError("--offload-folder holds what a device map puts on disk: pass --device-map too, or "
                               "drop it")
        if self.device_map is not None and self.device != "auto":
            raise FcauditError(f"--device {self.device} and --device-map {self.device_map}: pass one (the map names "
                               "the devices)")
        if self.device_map is not None and self.dry_run and (self.world_size or 1) > 1:
            raise FcauditError("--device-map spreads one model in one process: a dry run for several processes "
                               "(--world-size) plans a run that would be refused; drop one of them")

    def to_json(self) -> dict:
        """The settings config.json records, which a resumed audit must match (the driver adds the windows, model and
        controller); where and how the model is loaded and the output change no record."""
        loss = "token_nll" if self.loss_fn is None else getattr(self.loss_fn, "__qualname__", repr(self.loss_fn))
        return {"seed": self.seed, "randomizations": self.randomizations, "batch_size": self.batch_size,
                "tolerance": self.tolerance, "criteria": self.criteria.to_dict(), "loss": loss}


# the settings `fca.audit` reads (the others load a checkpoint and draw its windows: `fcaudit audit`'s)
AUDIT_SETTINGS = ("out", "randomizations", "seed", "batch_size", "tolerance", "criteria", "loss_fn", "model_info",
                  "quiet", "execution")


def with_settings(config: AuditConfig | None, settings: Mapping[str, Any], caller: str = "fca.audit") -> AuditConfig:
    """`caller`'s config (`fca.audit`'s, `fca.plan`'s): `AuditConfig(**settings)`, or `config` with `settings`
    replacing its fields."""
    if unknown := [name for name in settings if name not in AUDIT_SETTINGS]:
        loads = " (`fcaudit audit CHECKPOINT`'s: there the checkpoint and windows are loaded)" if unknown[0] in {
            f.name for f in fields(AuditConfig)} else ""
        raise FcauditError(f"{caller} has no setting {unknown[0]!r}{loads}; its settings are "
                           f"{', '.join(AUDIT_SETTINGS)} (fcaudit.AuditConfig's fields)")
    if config is None:
        return AuditConfig(**settings)
    if not isinstance(config, AuditConfig):
        raise FcauditError(f"config must be a fcaudit.AuditConfig, got {type(config).__name__}")
    return replace(config, **settings) if settings else config


def _bounded(name: str, value, flags: bool) -> int:
    flag, keyword, low, high, why = _BOUNDS[name]
    exact = not isinstance(value, bool) and isinstance(value, (int, np.integer))
    if exact and low <= value <= high:
        return int(value)
    if exact and value > high:
        raise FcauditError(f"{flag} {value}: pass an integer <= {high} (fcaudit's limit)" if flags else
                           f"{keyword} must be at most {high} (fcaudit's limit), got {value}")
    if flags and name == "window":
        why += "; leave --window out for the model's context"
    reason = f" ({why})" if why else ""
    raise FcauditError(f"{flag} {value}: pass an integer >= {low}{reason}" if flags else
                       f"{keyword} must be an integer >= {low}{reason}, got {value!r}")


def check_count(value, flag: str, low: int, high: int) -> int:
    """An integer in [low, high], or one line naming the flag and the bound (above `high`: fcaudit's limit, far above
    any real run and low enough that a mistyped value cannot fill the memory or run for days)."""
    exact = not isinstance(value, bool) and isinstance(value, (int, np.integer))
    if exact and low <= value <= high:
        return int(value)
    if exact and value > high:
        raise FcauditError(f"{flag} {value}: pass an integer <= {high} (fcaudit's limit)")
    raise FcauditError(f"{flag} {value!r}: pass an integer >= {low}")


def _criteria(criteria) -> Criteria:
    if isinstance(criteria, Criteria):
        return criteria
    if criteria is None or isinstance(criteria, Mapping):
        return Criteria.from_dict(dict(criteria or {}))
    raise FcauditError(f"criteria must be a fcaudit.Criteria or a dict, got {type(criteria).__name__}")
