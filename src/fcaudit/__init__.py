"""fcaudit: Frozen-Controller Auditing of dynamic neural networks.

    import fcaudit as fca
    ctrl = fca.controller_for(model)  # or fca.Controller.from_modules(model, "blocks.*.gate", layout="batch token")
    result = fca.audit(model, ctrl, eval_windows, calib_windows, randomizations=20, seed=0, out="audit-dir")
    fca.summarize([result, ...])
"""

from fcaudit.errors import FcauditError

__version__ = "0.1.0"

# The engine imports torch; keep `import fcaudit` cheap for the CLI's --help by importing these on first use.
_LAZY = {
    "Controller": "fcaudit.controllers", "controller_for": "fcaudit.controllers", "register": "fcaudit.controllers",
    "Codec": "fcaudit.controllers", "Layout": "fcaudit.controllers",
    "AuditResult": "fcaudit.audit", "plan": "fcaudit.audit",
    "summarize": "fcaudit.summary", "Criteria": "fcaudit.protocol",
    "build_report": "fcaudit.report.render", "load_model": "fcaudit.models.checkpoint",
    "load_corpus": "fcaudit.data", "audit_windows": "fcaudit.data",
}


def __getattr__(name: str):
    if name == "audit":  # the package fcaudit.audit is callable: fca.audit(...) runs an audit
        import importlib

        return importlib.import_module("fcaudit.audit")
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fcaudit' has no attribute {name!r}")


__all__ = ["FcauditError", "__version__", "audit", *_LAZY]
