"""The Frozen-Controller Audit: the driver (audit) checks the inputs (inputs) and drives the engine, which runs one
process's work units (units) over the coefficient store (store) in a group of processes (group); the planner (plan)
sizes an audit without running it; directory and files keep the audit directory, and results (AuditResult) is its one
reader."""

from fcaudit.auditor.driver import audit
from fcaudit.auditor.group import Group, TorchGroup, group_from_env
from fcaudit.auditor.planner import AuditPlan, plan
from fcaudit.auditor.results import AuditResult, load_records
from fcaudit.auditor.store import CoefficientStore

__all__ = ["AuditPlan", "AuditResult", "CoefficientStore", "Group", "TorchGroup", "audit", "group_from_env",
           "load_records", "plan"]

