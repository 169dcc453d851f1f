"""The kinds of controller coefficient, one object each in one module (`Kind`, fcaudit.kinds.base): gates,
mixtures, expert and capacity routers, token routers, and the depth kinds (exit depth, halting, skip masks).
`Description` is a controller as the protocol, the engine, the statistics and execution see it.

Adding a kind: subclass `Kind` (its conditions, reference, the checks of its captured decisions, how each condition
moves its coefficients and the budget that keeps) and `register(MyKind())`; a site then takes `kind="my_kind"`.
"""

# registration order is the order `lookup`'s refusal lists the kinds in
# isort: off
from fcaudit.kinds.base import KINDS, PAPER, RANDOMIZED, STATIC_REFERENCES, Context, Kind, lookup, register, unregister
from fcaudit.kinds.gates import SCALAR_GATE, VECTOR_GATE
from fcaudit.kinds.mixtures import SOURCE_MIXTURE
from fcaudit.kinds.routers import CAPACITY_ROUTER, EXPERT_ROUTER
from fcaudit.kinds.tokens import TOKEN_NOTE, TOKEN_ROUTER, chosen
from fcaudit.kinds.depth import DEPTH, DEPTH_NOTE, EXIT_DEPTH, HALTING, SKIP_MASK
from fcaudit.kinds.description import Description
# isort: on

__all__ = ["KINDS", "PAPER", "RANDOMIZED", "STATIC_REFERENCES", "Context", "Kind", "lookup", "register", "unregister", "DEPTH",
           "DEPTH_NOTE", "EXIT_DEPTH", "HALTING", "SKIP_MASK", "Description", "SCALAR_GATE", "VECTOR_GATE",
           "SOURCE_MIXTURE", "CAPACITY_ROUTER", "EXPERT_ROUTER", "TOKEN_NOTE", "TOKEN_ROUTER", "chosen"]
