"""The Frozen-Controller Audit machinery (`fcaudit.audit(...)` is `runner.audit`): work units over a coefficient store, and the one reader of audit directories.

    runner.py     audit() and plan(): inputs, probe, configuration, lock, run, results
    engine.py     the units of one process: capture + exact replay check, calibration, profiles, replays, merge
    units.py      the work units and their schedule (any partition gives the same directory bit for bit)
    group.py      the processes sharing one audit (torchrun ranks), one verdict per phase
    store.py      the coefficient store (safetensors chunks, memory-mapped reads)
    directory.py  the audit directory: layout, marker, lock, configuration
    files.py      atomic writes with content hashes, verified reads
    results.py    AuditResult: the one reader of an audit directory
"""

from fcaudit.auditor.group import Group, TorchGroup, group_from_env
from fcaudit.auditor.results import AuditResult, load_records
from fcaudit.auditor.runner import AuditPlan, audit, plan, print_summary
from fcaudit.auditor.store import CoefficientStore

__all__ = ["AuditPlan", "AuditResult", "CoefficientStore", "Group", "TorchGroup", "audit", "group_from_env",
           "load_records", "plan", "print_summary"]

