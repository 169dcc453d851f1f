"""Gates: one coefficient per (token, stream) or a vector over features, scaling what a layer adds. The paper's
conditions; the structure-removed reference is the mass-matched GlobalMean (a gate has no sources to mix, so a
mixture's SourceUniformMean would be its own static mean and retention would read 0 by construction)."""

from __future__ import annotations

from fcaudit.kinds.base import Kind, register


class ScalarGate(Kind):
    name = "scalar_gate"
    references = ("GlobalMean",)
    follows = ("StaticTopK",)


class VectorGate(Kind):
    name = "vector_gate"
    follows = ("StaticTopK",)


SCALAR_GATE = register(ScalarGate())
VECTOR_GATE = register(VectorGate())
