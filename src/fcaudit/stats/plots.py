"""The result objects' `.plot()`: points with horizontal interval bars, one row per quantity (the paper's Figure 2).
The report draws Figure 2 with the same functions, so a notebook and the report show the same picture. A `result`
here is one of fcaudit.stats.results' per-quantity results (names, labels, statistic, confidence_interval, n,
n_positive). matplotlib is imported when a plot is drawn, never at import."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from fcaudit import protocol

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def error_bars(statistic, low, high) -> np.ndarray:
    """Asymmetric error-bar lengths [2, n]; a missing interval draws no bar (0 length) instead of a fake one."""
    statistic, low, high = (np.asarray(v, dtype=float) for v in (statistic, low, high))
    return np.vstack([np.clip(np.nan_to_num(statistic - low), 0, None),
                      np.clip(np.nan_to_num(high - statistic), 0, None)])


def _limits(values: np.ndarray) -> tuple[float, float]:
    """x-limits spanning 0, the points and the interval ends, padded on both sides (a zero span gets a unit one)."""
    values = np.append(values[np.isfinite(values)], 0.0)
    lo, hi = float(values.min()), float(values.max())
    span = hi - lo if hi > lo else max(abs(hi), 1e-3)
    return lo - 0.12 * span, hi + 0.12 * span


def panel(ax: "Axes", result, rows: list[int], ticks: int = 5, xlabel: str = "") -> None:
    """Rows `rows` of `result` on `ax`, the first on top: each point with its interval, a line at 0, and "k/n > 0"
    above a point where the result counts positive checkpoints."""
    import matplotlib.ticker

    if not rows:
        ax.set_axis_off()
        return
    order = rows[::-1]  # the first row on top
    stat = result.statistic[order]
    low, high = (v[order] for v in result.confidence_interval)
    ax.set_xlim(*_limits(np.column_stack([stat, low, high]).ravel()))  # points and caps at an extreme stay in
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(ticks))
    y = np.arange(len(order))
    ax.errorbar(stat, y, xerr=error_bars(stat, low, high), fmt="o", color="#1f77b4", ecolor="#555555", capsize=4)
    ax.set_yticks(y, [result.labels[i] for i in order])
    ax.axvline(0, color="#999999", lw=0.8, ls="--")
    ax.set_xlabel(xlabel)
    # no offset text: it would collide with the axis label
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: "0" if v == 0 else f"{v:.3g}"))
    ax.grid(axis="x", alpha=0.3)
    ax.set_ylim(-0.6, len(order) - 0.2)  # room for the "k/n > 0" note above the top point
    for yi, i in zip(y, order):
        if np.isfinite(result.n_positive[i]):
            ax.annotate(f"{int(result.n_positive[i])}/{int(result.n[i])} > 0", (result.statistic[i], yi),
                        textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8, color="#444444")


PENALTY_AXIS = "ΔNLL vs Correct (nats/token)"


def penalties(result, ax: "Axes | None" = None, reference_ax: "Axes | None" = None) -> "Axes":
    """Figure 2: the conditions' mean ΔNLL with intervals on `ax`; the structure-removed reference on its own linear
    scale on `reference_ax` (it is often orders of magnitude larger): by default a new figure with both panels, or
    with `ax` alone, a narrow panel appended to its right."""
    reference = protocol.structure_removed(result.names)
    main = [i for i, name in enumerate(result.names) if name != reference]
    ref = [i for i, name in enumerate(result.names) if name == reference]
    appended = ax is not None and reference_ax is None and bool(ref)
    if ax is None:
        import matplotlib.pyplot as plt

        _, (ax, reference_ax) = plt.subplots(1, 2, figsize=(10, 0.45 * max(len(main), 3) + 1.6),
                                             gridspec_kw={"width_ratios": [3, 1.3]})
    elif appended:
        from mpl_toolkits.axes_grid1 import make_axes_locatable

        reference_ax = make_axes_locatable(ax).append_axes("right", size="43%", pad=0.3)
    panel(ax, result, main, 5, PENALTY_AXIS)
    if reference_ax is not None:
        panel(reference_ax, result, ref, 3, PENALTY_AXIS)  # few ticks on the narrow panel: no overlap
        if appended:  # its label on the far side, clear of the conditions' panel
            reference_ax.yaxis.tick_right()
        if ref:
            reference_ax.set_title("structure-removed reference\n(own linear scale)", fontsize=9)
    ax.set_title("assignment and static interventions", fontsize=9)
    return ax


def effects(result, ax: "Axes | None" = None, xlabel: str = "effect (ΔNLL, nats/token)") -> "Axes":
    """Every row of `result` on one axis (e.g. the factor effects E_input, E_token, E_interaction)."""
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(6, 0.45 * max(len(result), 3) + 1.2))
    panel(ax, result, list(range(len(result))), 5, xlabel)
    return ax
