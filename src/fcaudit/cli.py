"""The `fcaudit` command: train, audit, summarize, report, demo.

Every command turns an FcauditError into one line on stderr and exit code 2.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable, List, Optional

import typer

from fcaudit.errors import FcauditError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Frozen-Controller Auditing: variation, functional dependence and execution of dynamic networks.")


def command(fn: Callable) -> Callable:
    """Register a command whose FcauditError becomes one line on stderr and exit code 2."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except FcauditError as e:
            from fcaudit.audit.group import ignore_sigterm

            ignore_sigterm()  # under torchrun: every rank prints its line and exits 2
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None

    return app.command()(run)


@command
def train(
    model: str = typer.Option("featuregate", help="featuregate|dense|uniform|layerstatic|uniform-fixed|uniform-matched|fixeddepth|mudd"),
    preset: str = typer.Option("demo", help="tiny|demo|paper-76m|paper-504m (mudd: tiny|demo)"),
    seed: int = typer.Option(0),
    corpus: str = typer.Option("embedded", help="embedded, a local text file/directory, wikitext-103 or openwebtext"),
    out: Path = typer.Option(..., help="run directory (rerun the same command to resume)"),
    steps: Optional[int] = typer.Option(None, help="optimizer steps (default: the preset's)"),
    batch_size: Optional[int] = typer.Option(None),
    lr: Optional[float] = typer.Option(None),
    gate_value: Optional[float] = typer.Option(None, help="constant gate for uniform-fixed / uniform-matched"),
    matched_to: Optional[Path] = typer.Option(None, help="uniform-matched: FeatureGate run dir whose gate mass it takes"),
    depth: Optional[int] = typer.Option(None, help="number of blocks k for fixeddepth"),
    device: str = typer.Option("auto", help="auto|cpu|cuda"),
) -> None:
    """Train one model; writes a checkpoint and metrics.json (Byte-PPL, gate mass)."""
    from fcaudit.train import TrainConfig, train as run_train

    overrides = {k: v for k, v in dict(steps=steps, batch_size=batch_size, lr=lr, gate_value=gate_value,
                                       fixed_depth=depth,
                                       matched_to=str(matched_to) if matched_to else None).items() if v is not None}
    result = run_train(TrainConfig(model=model, preset=preset, seed=seed, corpus=corpus, out=str(out), device=device,
                                   **overrides))
    mass = "n/a" if result.gate_mass is None else f"{result.gate_mass:.4f}"
    typer.echo(f"Byte-PPL {result.byte_ppl:.4f}  gate mass {mass}  -> {out}")


@command
def audit(
    checkpoint: str = typer.Argument(..., help="checkpoint directory or Hugging Face hub id"),
    corpus: str = typer.Option("embedded"),
    out: Path = typer.Option(..., help="audit directory (rerun the same command to resume)"),
    eval: int = typer.Option(512, "--eval", help="evaluation windows (test split)"),
    calib: int = typer.Option(512, "--calib", help="calibration windows (validation split)"),
    window: int = typer.Option(512, help="tokens per window"),
    randomizations: int = typer.Option(20, help="randomizations R of each randomized condition"),
    seed: int = typer.Option(0),
    batch_size: int = typer.Option(8),
    device: str = typer.Option("auto"),
    revision: Optional[str] = typer.Option(None, help="hub revision (e.g. 3c241c8)"),
    dtype: Optional[str] = typer.Option(None, help="float32|bfloat16 (default: the checkpoint's)"),
    tolerance: float = typer.Option(0.0, help="allowed max |Δlogit| of the exact replay (0 = bit-exact)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print store size and memory needed, run nothing"),
    world_size: Optional[int] = typer.Option(None, help="--dry-run: forward passes per rank for this many processes "
                                             "(default: torchrun's WORLD_SIZE, else 1)"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress bar or summary table"),
) -> None:
    """Frozen-Controller Audit of one checkpoint (under torchrun: shared by the ranks, see README "Sharded audits")."""
    from fcaudit.auditing import audit_checkpoint

    audit_checkpoint(checkpoint, corpus=corpus, out=out, n_eval=eval, n_calib=calib, window=window,
                     randomizations=randomizations, seed=seed, batch_size=batch_size, device=device,
                     revision=revision, dtype=dtype, tolerance=tolerance, dry_run=dry_run, quiet=quiet,
                     world_size=world_size)


@command
def summarize(audit_dirs: List[Path] = typer.Argument(..., help="audit directories (one per checkpoint)"),
              out: Path = typer.Option(...)) -> None:
    """Checkpoint-level statistics across seeds (bootstrap CIs, sign-flip tests, Holm)."""
    from fcaudit.summary import summarize as run_summary

    summary = run_summary(audit_dirs, out=out)
    typer.echo(str(summary))


@command
def execution(checkpoints: List[str] = typer.Argument(..., help="checkpoint directories (include a Dense one for ratios)"),
              out: Path = typer.Option(...),
              batch_size: int = typer.Option(8),
              window: Optional[int] = typer.Option(None, help="tokens per window (default: smallest block_size)"),
              thresholds: List[float] = typer.Option([], "--threshold", help="post-training gate threshold (repeatable)"),
              corpus: str = typer.Option("embedded", help="corpus for the thresholding NLL"),
              threshold_windows: int = typer.Option(32, help="test windows for thresholding"),
              min_run_time: float = typer.Option(1.0, help="seconds of timing per model"),
              threads: Optional[int] = typer.Option(None, help="torch CPU threads while timing"),
              device: str = typer.Option("auto")) -> None:
    """Executed blocks, FLOPs, latency and throughput (question 3), and optional gate thresholding."""
    from fcaudit.execution import measure_execution

    table = measure_execution(checkpoints, out, batch_size=batch_size, window=window, device=device,
                              thresholds=thresholds, corpus=corpus, threshold_windows=threshold_windows,
                              min_run_time=min_run_time, threads=threads)
    typer.echo(table.to_string(index=False))


@command
def report(inputs: List[Path] = typer.Argument(..., help="summary, audit or training directories"),
           out: Path = typer.Option(...)) -> None:
    """Markdown + self-contained HTML report with the paper's tables and figures."""
    from fcaudit.report.render import build_report

    path = build_report(inputs, out)
    typer.echo(f"report: {path}")


@command
def demo(out: Path = typer.Option(Path("demo-out"), help="output directory (rerun to resume)"),
         quick: bool = typer.Option(False, "--quick", help="tiny models, about 2 minutes"),
         device: str = typer.Option("auto")) -> None:
    """The whole study end to end on the embedded corpus: train, audit, summarize, report."""
    from fcaudit.demo import run_demo

    run_demo(out, quick=quick, device=device)


def main() -> None:
    app(prog_name="fcaudit")
