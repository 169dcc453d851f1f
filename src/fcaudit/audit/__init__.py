"""The Frozen-Controller Audit engine: work units over a coefficient store, and the one reader of audit directories.

    runner.py     audit() and plan(): inputs, probe, configuration, lock, run, results
    engine.py     the units of one process: capture + exact replay check, calibration, profiles, replays, merge
    units.py      the work units and their schedule (any partition gives the same directory bit for bit)
    group.py      the processes sharing one audit (torchrun ranks), one verdict per phase
    store.py      the coefficient store (safetensors chunks, memory-mapped reads)
    directory.py  the audit directory: layout, marker, lock, configuration
    files.py      atomic writes with content hashes, verified reads
    results.py    AuditResult: the one reader of an audit directory
"""

import sys

from fcaudit.audit.group import Group, TorchGroup, group_from_env
from fcaudit.audit.results import AuditResult, load_records
from fcaudit.audit.runner import AuditPlan, audit, dry_run, plan, print_summary
from fcaudit.audit.store import CoefficientStore

__all__ = ["AuditPlan", "AuditResult", "CoefficientStore", "Group", "TorchGroup", "audit", "dry_run",
           "group_from_env", "load_records", "plan", "print_summary"]


class _CallableModule(type(sys)):
    """`fcaudit.audit` is both this package and the public function: `fca.audit(model, ...)` must work even after
    `import fcaudit.audit.runner` has bound the package to the name `audit` on `fcaudit`."""

    def __call__(self, *args, **kwargs):
        return audit(*args, **kwargs)

    __signature__ = property(lambda self: __import__("inspect").signature(audit))  # help(), inspect: the function's


sys.modules[__name__].__class__ = _CallableModule
