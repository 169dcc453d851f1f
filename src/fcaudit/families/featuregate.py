"""The FeatureGate family (paper §4.1): every variant of fcaudit.models.featuregate, trained from scratch here.

Controller: the gate module of every block (`blocks.*.gate`) emits one scalar per token ("batch token"); the static
profile is the layerwise LayerMean and the structure-removed reference the mass-matched GlobalMean.
"""

from __future__ import annotations

from pathlib import Path

from fcaudit.controllers.controller import Controller
from fcaudit.errors import FcauditError
from fcaudit.families import Family, register
from fcaudit.io import read_json
from fcaudit.models.checkpoint import MODEL_TYPE, read_checkpoint, save_checkpoint
from fcaudit.models.featuregate import PRESETS, VARIANTS, FeatureGateGPT, GPTConfig, config_for

PATTERN = "blocks.*.gate"


def controller(model: FeatureGateGPT) -> Controller:
    if not model.config.gated:
        raise FcauditError(f"model variant {model.config.variant!r} has no gate modules ({PATTERN}) to audit; "
                           "audit a gated variant (featuregate, uniform, layerstatic)")
    return Controller.from_modules(model, PATTERN, layout="batch token", static_name="LayerMean")


def label(model: FeatureGateGPT) -> str:
    v = model.config.variant
    return f"fixeddepth-{model.config.n_layer}" if v == "fixeddepth" else v


def build(cfg) -> FeatureGateGPT:
    return FeatureGateGPT(config_for(cfg.preset, cfg.model, gate_value=cfg.gate_value, fixed_depth=cfg.fixed_depth))


def configure(cfg) -> None:
    """Completes the variants' options (TrainConfig checked which models take them): uniform-fixed's and
    uniform-matched's constant gate (uniform-matched's measured on a trained FeatureGate run), fixeddepth's depth."""
    if cfg.model == "uniform-matched":
        if cfg.matched_to is not None:
            cfg.gate_value = _measured_gate_mass(cfg.matched_to)
            cfg.matched_to = str(Path(cfg.matched_to).resolve())
        elif cfg.gate_value is None:
            raise FcauditError("uniform-matched needs the FeatureGate gate mass: pass --gate-value or "
                               "--matched-to RUN_DIR (a trained FeatureGate run)")
    if cfg.model == "fixeddepth" and cfg.fixed_depth is None:
        raise FcauditError("fixeddepth needs its number of blocks: pass --depth K (K >= 1)")
    if cfg.model == "fixeddepth" and cfg.fixed_depth > (n := PRESETS[cfg.preset].n_layer):
        raise FcauditError(f"--depth {cfg.fixed_depth}: fixeddepth keeps the first K of preset {cfg.preset}'s {n} "
                           f"blocks; pass K <= {n}")
    if cfg.gate_value is None:
        cfg.gate_value = GPTConfig.gate_value  # uniform-fixed's constant


def _measured_gate_mass(run_dir: str) -> float:
    path = Path(run_dir) / "metrics.json"
    if not path.is_file():
        raise FcauditError(f"no metrics.json in {run_dir}: train the FeatureGate model first or pass --gate-value")
    mass = read_json(path).get("gate_mass")
    if mass is None:
        raise FcauditError(f"{path} has no gate mass: point matched_to at a FeatureGate run")
    return float(mass)


register(Family(
    name="featuregate",
    accepts=lambda config: config.get("model_type") == MODEL_TYPE,
    load=lambda dir, device, dtype: read_checkpoint(dir, FeatureGateGPT, device, dtype),
    matches=lambda model: isinstance(model, FeatureGateGPT),
    controller=controller,
    ungated=lambda model: not model.config.gated,
    label=label,
    trains=VARIANTS,
    presets=tuple(PRESETS),
    build=build,
    configure=configure,
    save=lambda model, out, meta: save_checkpoint(out, model, meta),
    gates=lambda model, ids: model(ids, return_gates=True),
    ungated_mass=1.0,
))
