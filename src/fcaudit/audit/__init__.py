"""The Frozen-Controller Audit engine: coefficient store, interventions, runner and results."""

import sys

from fcaudit.audit.interventions import CONDITIONS, Profiles, derangement, shuffle_tokens, token_permutations
from fcaudit.audit.results import AuditResult, load_records
from fcaudit.audit.runner import AuditPlan, audit, dry_run, plan, print_summary
from fcaudit.audit.store import CoefficientStore

__all__ = ["AuditPlan", "AuditResult", "CONDITIONS", "CoefficientStore", "Profiles", "audit", "derangement",
           "dry_run", "load_records", "plan", "print_summary", "shuffle_tokens", "token_permutations"]


class _CallableModule(type(sys)):
    """`fcaudit.audit` is both this package and the public function: `fca.audit(model, ...)` must work even after
    `import fcaudit.audit.runner` has bound the package to the name `audit` on `fcaudit`."""

    def __call__(self, *args, **kwargs):
        return audit(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
