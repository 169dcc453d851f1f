"""FCA statistics: ΔNLL and factor effects (effects), inference (inference), coefficient variation (variance), and
one checkpoint's window-level statistics with their result objects (results)."""
