"""fcaudit: Frozen-Controller Auditing of dynamic neural networks.

    import fcaudit as fca
    model = fca.load("runs/fg-s0")  # a checkpoint directory or hub id
    eval_windows, calib_windows = fca.windows("embedded", n_eval=64, n_calib=64, window=128)
    ctrl = fca.controller_for(model)  # or fca.Controller.from_modules(model, "blocks.*.gate", layout="batch token")
    result = fca.audit(model, ctrl, eval_windows, calib_windows, randomizations=20, seed=0, out="audit-dir")
    result.penalties()["CrossInput"], result.factor_effects(), result.retention()  # Estimates, Mappings
    fca.summarize([result, ...])  # family -> the same results, across checkpoints
    fca.execution(model, ctrl, eval_windows)  # decided against executed work, FLOPs, latency, decoding
"""

import importlib

from fcaudit.errors import FcauditError

__version__ = "0.1.0"

# The public API: name -> module. The one place to update when a name moves. The engine imports torch; names are
# imported on first use so that `import fcaudit` (and the CLI's --help) stays cheap.
_LAZY = {
    "load": "fcaudit.api", "windows": "fcaudit.api",
    "Controller": "fcaudit.controllers", "Codec": "fcaudit.controllers", "Layout": "fcaudit.controllers",
    "controller_for": "fcaudit.families", "register": "fcaudit.families", "Family": "fcaudit.families",
    "AuditResult": "fcaudit.auditor", "plan": "fcaudit.auditor", "audit": "fcaudit.auditor",
    "summarize": "fcaudit.summary", "Criteria": "fcaudit.protocol", "AuditConfig": "fcaudit.config",
    "build_report": "fcaudit.report.render", "ExecutionResult": "fcaudit.execution",
    "ExecutionSettings": "fcaudit.execution",
    # the result objects: one audit's, a summary's, and what both return
    "Replay": "fcaudit.auditor.results", "Finding": "fcaudit.controllers.findings",
    "Summary": "fcaudit.summary", "FamilyResult": "fcaudit.summary",
    "PenaltiesResult": "fcaudit.stats.results", "FactorEffectsResult": "fcaudit.stats.results",
    "RetentionResult": "fcaudit.stats.results", "VariationResult": "fcaudit.stats.results",
    "Estimate": "fcaudit.stats.inference",
}

__all__ = ["FcauditError", "__version__", "execution", *_LAZY]


def __getattr__(name: str):
    if name == "execution":  # a subpackage that is called as a function (fcaudit.execution's __init__)
        return importlib.import_module("fcaudit.execution")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fcaudit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({n for n in globals() if n.startswith("__")} | set(__all__))
