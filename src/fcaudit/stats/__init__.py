"""FCA statistics: ΔNLL and factor effects (effects), inference (inference), coefficient variation (variance), and
one checkpoint's window-level statistics with their result objects (results)."""

from fcaudit.stats.effects import (
    FactorEffects,
    FactorialCells,
    condition_means,
    delta_nll,
    factor_effects,
    factorial_cells,
    per_example_deltas,
    randomization_means,
    retention,
)
from fcaudit.stats.inference import (
    ConfidenceInterval,
    Estimate,
    checkpoint_bootstrap,
    holm,
    mc_se,
    paired_bootstrap,
    retention_bootstrap,
    sign_flip_test,
)
from fcaudit.stats.results import (
    FactorEffectsResult,
    PenaltiesResult,
    RetentionResult,
    WindowStatistics,
    retention_of,
)
from fcaudit.stats.variance import (
    coefficient_profile,
    functional_anova,
    variance_by_slice,
    variance_decomposition,
    variation,
)

__all__ = [
    "ConfidenceInterval", "Estimate", "FactorEffects", "FactorEffectsResult", "FactorialCells", "PenaltiesResult",
    "RetentionResult", "WindowStatistics", "checkpoint_bootstrap", "coefficient_profile", "condition_means",
    "delta_nll", "factor_effects", "factorial_cells", "functional_anova", "holm", "mc_se", "paired_bootstrap",
    "per_example_deltas", "randomization_means", "retention", "retention_bootstrap", "retention_of",
    "sign_flip_test", "variance_by_slice", "variance_decomposition", "variation",
]
