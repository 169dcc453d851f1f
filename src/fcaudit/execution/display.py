"""What `fcaudit execution` prints: the columns a reader compares, as rich tables (every column stays in the CSV)."""

from __future__ import annotations

import math

import pandas as pd
from rich import box
from rich.table import Table


def _num(v, fmt: str = "{:.4g}") -> str:
    return "—" if v is None or (isinstance(v, float) and not math.isfinite(v)) else fmt.format(v)


def _ratio(v) -> str:
    return _num(v, "{:.2f}x")


def _table(title: str, left: tuple[str, ...], right: tuple[str, ...], **caption) -> Table:
    """A table of the `left` (label) columns and the `right`-justified number columns."""
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
              **caption)
    for name in left + right:
        t.add_column(name, justify="left" if name in left else "right", no_wrap=True)
    return t


def execution_table(df: pd.DataFrame) -> Table:
    """One row per model: the share of the governed work its controller decided and the share executed (observed),
    blocks run (token routers: token x block pairs run), FLOPs and latency (median and IQR over repetitions) vs
    Dense, throughput."""
    tokens = "token_block_fraction" in df  # token routers: the share of token x block pairs that ran
    t = _table("Execution (question 3)", ("Model",), ("Decided", "Executed", "Blocks\nrun",
               *(("Token x block\npairs run",) if tokens else ()),
               "FLOPs\nvs Dense", "ms/batch\nmedian", "ms\nIQR", "Latency\nvs Dense", "Tokens/s", "Byte-PPL"))
    for r in df.to_dict(orient="records"):
        noisy = bool(r.get("latency_noisy", False))
        pairs = (_num(r.get("token_block_fraction", math.nan), "{:.1%}"),) if tokens else ()
        t.add_row(str(r["model"]), _num(r.get("decided", math.nan), "{:.1%}"), _num(r.get("executed", math.nan),
                  "{:.1%}"), f"{r['executed_blocks']}/{r['n_blocks']}", *pairs, _ratio(r.get("flops_vs_dense")),
                  _num(r["latency_ms"], "{:.3g}") + ("*" if noisy else ""), _num(r.get("latency_iqr_ms"), "{:.2g}"),
                  _ratio(r.get("latency_vs_dense")), _num(r["tokens_per_s"], "{:,.0f}"), _num(r.get("byte_ppl")))
    return t


def _layers_run(fraction: float) -> str:
    """The share of (layer, token) pairs that ran, as a verdict where nothing was skipped."""
    return "no layer skipped" if fraction == 1.0 else _num(fraction, "{:.1%}")


def decoding_table(df: pd.DataFrame) -> Table:
    """One row per model decoding a text window token by token with a KV cache: the (layer, token) pairs that ran,
    FLOPs per token and time per token vs Dense, and how far the decoded logits are from the window's forward (the
    same logits up to float rounding)."""
    rows = df.to_dict(orient="records")
    notes = {str(r["model"]): note for r in rows if isinstance(note := r.get("decode_note"), str) and note}
    t = _table("Decoding with a KV cache (one sequence, token by token)", ("Model", "Layer x token\npairs run"),
               ("FLOPs\nvs Dense", "ms/token\nmedian", "Latency\nvs Dense", "|Δlogit|\nmax"),
               caption="\n".join(f"{name}: {note}" for name, note in notes.items()) or None, caption_justify="left")
    for r in rows:
        if str(r["model"]) in notes:
            t.add_row(str(r["model"]), "not decodable", "—", "—", "—", "—")
            continue
        t.add_row(str(r["model"]), _layers_run(r["executed_layer_fraction"]), _ratio(r.get("decode_flops_vs_dense")),
                  _num(r["decode_ms_per_token"], "{:.3g}") + ("*" if r.get("decode_noisy") else ""),
                  _ratio(r.get("decode_latency_vs_dense")), _num(r["decode_max_abs_dlogit"], "{:.1e}"))
    return t


def noisy_note(df: pd.DataFrame) -> str | None:
    """A line naming the models whose latency spread (max - min over repetitions) exceeds the median, scoring or
    decoding."""
    noisy = [df[c].fillna(False).astype(bool) for c in ("latency_noisy", "decode_noisy") if c in df]
    if not noisy or not any(n.any() for n in noisy):
        return None
    names = ", ".join(map(str, df.loc[pd.concat(noisy, axis=1).any(axis=1), "model"]))
    return (f"* {names}: latency spread over repetitions (max - min) exceeds the median, the machine's load changed "
            "while timing; rerun with --threads 1 on a quieter machine before quoting these ratios")


def thresholding_table(df: pd.DataFrame) -> Table:
    """Post-training thresholding: how much could be skipped at each threshold, and at what Byte-PPL."""
    t = _table("Gate thresholding (potential skipping: the blocks still run)", ("Model",),
               ("Threshold", "Gates\nbelow", "Skippable blocks\nper window", "Byte-PPL", "ΔNLL"),
               caption="Byte-PPL here is on the first test windows (threshold 0: the unmodified model), not the "
                       "main table's", caption_justify="left")
    for r in df.to_dict(orient="records"):
        t.add_row(str(r["model"]), _num(r["threshold"], "{:g}"), _num(r["frac_below"], "{:.1%}"),
                  f"{_num(r['skippable_blocks'], '{:.2f}')} of {r['n_layers']}", _num(r["byte_ppl"]),
                  _num(r["delta_nll"], "{:+.4g}"))
    return t


def conditions_table(df: pd.DataFrame) -> Table:
    """Routed models under Correct and each condition measured: experts run and their FLOPs (top-k routers), tokens
    run and FLOPs vs Correct (token routers), latency."""
    experts, tokens = ("experts_per_token" in df), ("token_fraction" in df)
    t = _table("Routed models: executed work under the audit's conditions", ("Model", "Condition"),
               (("Experts\n/token", "FLOPs of\nall experts") if experts else ())
               + (("Tokens run\n(routed)", "Token x block\npairs run", "FLOPs\nvs Correct") if tokens else ())
               + ("ms/batch\nmedian", "vs\nCorrect"))
    for r in df.to_dict(orient="records"):
        cells = [_num(r["experts_per_token"], "{:.3g}"), _num(r["active_expert_fraction"], "{:.0%}")] if experts else []
        if tokens:
            cells += [_num(r["token_fraction"], "{:.1%}"), _num(r["token_block_fraction"], "{:.1%}"),
                      _ratio(r.get("flops_vs_correct"))]
        t.add_row(str(r["model"]), str(r["label"]), *cells,
                  _num(r["latency_ms"], "{:.3g}") + ("*" if r.get("latency_noisy") else ""),
                  _ratio(r.get("latency_vs_correct")))
    return t
