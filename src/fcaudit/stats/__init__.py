"""FCA statistics: ΔNLL and factor effects (effects), inference (inference), coefficient variation (variance)."""

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
from fcaudit.stats.variance import coefficient_profile, functional_anova, variance_by_slice, variance_decomposition

# inference needs scipy and statsmodels, about a second to import: an audit (which ends with the variance
# decomposition, from this package) pays for them only where it computes intervals or tests
_INFERENCE = ("ConfidenceInterval", "Estimate", "checkpoint_bootstrap", "holm", "mc_se", "paired_bootstrap",
              "retention_bootstrap", "retention_window_bootstrap", "sign_flip_test")


def __getattr__(name: str):
    if name in _INFERENCE:
        from fcaudit.stats import inference

        return getattr(inference, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "ConfidenceInterval", "Estimate", "FactorEffects", "FactorialCells", "checkpoint_bootstrap",
    "coefficient_profile", "condition_means", "delta_nll", "factor_effects", "factorial_cells", "functional_anova",
    "holm", "mc_se", "paired_bootstrap", "per_example_deltas", "randomization_means", "retention",
    "retention_bootstrap", "retention_window_bootstrap", "sign_flip_test", "variance_by_slice",
    "variance_decomposition",
]
