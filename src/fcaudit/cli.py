"""The `fcaudit` command: train, audit, summarize, execution, report, demo.

Every command turns an FcauditError into one line on stderr and exit code 2, and takes --threads (torch's CPU
threads for the command; default: torch's choice, with a one-line hint on a busy machine).
"""

from __future__ import annotations

import errno
import functools
import sys
from pathlib import Path
from typing import Annotated, Callable, List, Optional

import typer

from fcaudit.errors import FcauditError

# Plain help (no rich panels): it wraps long option lists instead of cutting them at 80 columns, and shows each
# option's value as a metavar (flags show none).
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Frozen-Controller Auditing: variation, functional dependence and execution of dynamic networks.")

MODELS_HELP = ("featuregate, dense, uniform, layerstatic, uniform-fixed, uniform-matched, fixeddepth (needs --depth), "
               "mudd, moe (a byte-level Mixtral; needs the hf extra), mod (Mixture-of-Depths) or early-exit")
# options that several commands share
Corpus = Annotated[str, typer.Option(metavar="NAME", help="embedded, a local text file or directory, wikitext-103 or "
                                                           "openwebtext")]
Device = Annotated[str, typer.Option(metavar="DEVICE", help="auto, cpu or cuda (auto: CUDA when visible)")]
AllowPartial = Annotated[bool, typer.Option("--allow-partial", help="include unfinished audits (marked PARTIAL "
                                                                     "everywhere)")]
THREADS_HELP = "torch CPU threads (default: torch's choice, one per core; on a busy machine fewer is often faster)"
Threads = Annotated[Optional[int], typer.Option("--threads", metavar="N", help=THREADS_HELP)]


def _hint(line: str) -> None:
    if sys.stderr.isatty():  # a hint for people at a terminal; logs, pipes and tests stay clean
        typer.echo(line, err=True)


def command(fn: Callable) -> Callable:
    """Register a command: --threads applies to its whole run, --out (declared a str, so that '' is seen as given) is
    checked and passed on as a Path, and an FcauditError becomes one line on stderr and exit code 2."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        from fcaudit.io import valid_path
        from fcaudit.threads import using_threads

        try:
            if "out" in kwargs:  # taken as given: Typer would read '' as Path('.'), the current directory
                kwargs["out"] = valid_path(kwargs["out"], "--out")
            with using_threads(kwargs.get("threads"), hint=_hint):
                return fn(*args, **kwargs)
        except FcauditError as e:
            from fcaudit.auditor.group import ignore_sigterm

            ignore_sigterm()  # under torchrun: every rank prints its line and exits 2
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            typer.echo("interrupted: rerun the same command to resume (a training run or an audit continues where "
                       "it stopped)", err=True)
            raise typer.Exit(130) from None
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # every file is written atomically: what was done is complete on disk, and the same command resumes
            typer.echo(f"error: no space left on the device ({e.filename or e.strerror}): free some space and rerun "
                       "the same command (a training run or an audit resumes where it stopped)", err=True)
            raise typer.Exit(2) from None

    return app.command()(run)


@command
def train(
    model: str = typer.Option("featuregate", metavar="NAME", help=MODELS_HELP),
    preset: str = typer.Option("demo", metavar="NAME", help="size: tiny, demo, paper-76m or paper-504m (mudd, moe, "
                                                              "mod: tiny or demo)"),
    seed: int = typer.Option(0, metavar="N", help="training seed (weights, batches)"),
    corpus: Corpus = "embedded",
    out: str = typer.Option(..., metavar="DIR", help="run directory (rerun the same command to resume)"),
    steps: Optional[int] = typer.Option(None, metavar="N", help="optimizer steps (default: the preset's)"),
    batch_size: Optional[int] = typer.Option(None, metavar="N", help="windows per step (default: the preset's)"),
    lr: Optional[float] = typer.Option(None, metavar="LR", help="peak learning rate, > 0 (default: the preset's)"),
    gate_value: Optional[float] = typer.Option(None, metavar="G", help="constant gate in (0, 1) for uniform-fixed "
                                                                        "(default 0.6) or uniform-matched"),
    matched_to: Optional[Path] = typer.Option(None, metavar="DIR", help="uniform-matched: a trained FeatureGate run "
                                                                         "whose gate mass it takes"),
    depth: Optional[int] = typer.Option(None, metavar="K", help="fixeddepth: number of blocks K"),
    device: Device = "auto",
    threads: Threads = None,
) -> None:
    """Train one model.

    Writes a checkpoint and metrics.json (Byte-PPL and gate mass on the test split); rerun to resume.
    """
    from fcaudit.train import TrainConfig, train as run_train

    result = run_train(TrainConfig(model=model, preset=preset, seed=seed, corpus=corpus, out=str(out), device=device,
                                   steps=steps, batch_size=batch_size, lr=lr, gate_value=gate_value, fixed_depth=depth,
                                   matched_to=str(matched_to) if matched_to else None))
    mass = "n/a" if result.gate_mass is None else f"{result.gate_mass:.4f}"
    typer.echo(f"Byte-PPL {result.byte_ppl:.4f}  gate mass {mass}  -> {out}")


@command
def audit(
    checkpoint: str = typer.Argument(..., metavar="CHECKPOINT", help="checkpoint directory or Hugging Face hub id"),
    corpus: Corpus = "embedded",
    out: str = typer.Option(..., metavar="DIR", help="audit directory (rerun the same command to resume)"),
    eval: int = typer.Option(512, "--eval", metavar="N", help="evaluation windows (test split)"),
    calib: int = typer.Option(512, "--calib", metavar="N", help="calibration windows (validation split)"),
    window: Optional[int] = typer.Option(None, metavar="T", help="tokens per window (default: the model's context, "
                                                                  "at most 2048)"),
    randomizations: int = typer.Option(20, metavar="R", help="randomizations of each randomized condition"),
    seed: int = typer.Option(0, metavar="N", help="seed of the windows and randomizations"),
    batch_size: int = typer.Option(8, metavar="N", help="windows per forward pass"),
    device: Device = "auto",
    revision: Optional[str] = typer.Option(None, metavar="REV", help="hub revision (e.g. 3c241c8)"),
    dtype: Optional[str] = typer.Option(None, metavar="DTYPE", help="float32, bfloat16, float16 or float64 "
                                                                    "(default: the checkpoint's)"),
    tolerance: float = typer.Option(0.0, metavar="X", help="allowed max |Δlogit| of the exact replay (0: bit-exact)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print store size and memory needed, run nothing"),
    world_size: Optional[int] = typer.Option(None, metavar="N", help="--dry-run: forward passes per rank for this "
                                             "many processes (default: torchrun's WORLD_SIZE, else 1)"),
    device_map: Optional[str] = typer.Option(None, metavar="MAP", help="spread a Hugging Face model over this "
                                             "machine's GPUs, CPU and disk with accelerate: auto, balanced, "
                                             "sequential or a JSON file {module: device} (instead of --device)"),
    offload_folder: Optional[Path] = typer.Option(None, metavar="DIR", help="--device-map: where its disk weights go"),
    family: Optional[str] = typer.Option(None, metavar="NAME", help="summarize pools one family's checkpoints as "
                                         "seeds (default: its variant and preset, else its directory or hub id)"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress bar or summary table"),
    execution: bool = typer.Option(False, "--execution", help="also measure decided vs executed work and FLOPs on "
                                   "the first batch (execution.json; question 3)"),
    threads: Threads = None,
) -> None:
    """Frozen-Controller Audit of one checkpoint (question 2).

    Captures the coefficients, checks the exact replay, then replays each intervention; writes records, replay.json
    and variation.json into --out. Under torchrun the ranks share the work (README "Sharded audits").
    """
    from fcaudit.checkpoint_audit import audit_checkpoint
    from fcaudit.config import AuditConfig

    config = AuditConfig(out=out, n_eval=eval, n_calib=calib, window=window, randomizations=randomizations, seed=seed,
                         batch_size=batch_size, tolerance=tolerance, quiet=quiet, execution=execution, device=device,
                         dtype=dtype, revision=revision, device_map=device_map, offload_folder=offload_folder,
                         family=family,
                         dry_run=dry_run, world_size=world_size, flags=True)
    audit_checkpoint(checkpoint, corpus, config)


@command
def summarize(audit_dirs: List[Path] = typer.Argument(..., metavar="AUDIT_DIR",
                                                      help="audit directories (one per checkpoint)"),
              out: str = typer.Option(..., metavar="DIR", help="directory for summary.json and the CSV tables"),
              allow_partial: AllowPartial = False, threads: Threads = None) -> None:
    """Statistics across checkpoints (training seeds).

    Bootstrap CIs, exact sign-flip tests, Holm; one checkpoint falls back to window-level intervals.
    """
    from fcaudit.io import OutDir

    OutDir(out, "summary").check()
    from fcaudit.summary import summarize as run_summary

    summary = run_summary(audit_dirs, out=out, allow_partial=allow_partial)
    typer.echo(str(summary))


@command
def execution(checkpoints: List[str] = typer.Argument(..., metavar="CHECKPOINT",
                                                      help="checkpoint directories or hub ids (include a Dense one for "
                                                           "ratios), or audit directories (the audited checkpoint)"),
              out: str = typer.Option(..., metavar="DIR", help="directory for execution.csv/.json and "
                                                                "thresholding.csv"),
              batch_size: int = typer.Option(8, metavar="N", help="windows per timed forward pass"),
              window: Optional[int] = typer.Option(None, metavar="T", help="tokens per window (default: the "
                                                                           "smallest block_size, at most 2048)"),
              thresholds: List[float] = typer.Option([], "--threshold", metavar="TAU",
                                                     help="post-training gate threshold (repeatable)"),
              corpus: str = typer.Option("embedded", metavar="NAME", help="corpus for the thresholding NLL and the "
                                                                          "decoded text window"),
              threshold_windows: int = typer.Option(32, metavar="N", help="test windows for thresholding"),
              min_run_time: float = typer.Option(1.0, metavar="SECONDS", help="seconds of timing per model"),
              threads: Optional[int] = typer.Option(None, "--threads", metavar="N", help="torch CPU threads "
                                                    "(default: torch's choice; 1 gives the steadiest latencies on a "
                                                    "shared machine)"),
              device: Device = "auto") -> None:
    """Executed blocks, FLOPs, latency (question 3).

    An audit directory measures the checkpoint it audited, with its controller. Latencies of all models are measured
    round-robin (median and IQR over repetitions); --threshold adds post-training gate thresholding.
    """
    import pandas as pd
    from rich.console import Console

    from fcaudit.checkpoint_audit import execution_sources
    from fcaudit.execution import ExecutionConfig, measure_execution
    from fcaudit.execution.display import (conditions_table, decided_table, decoding_table, execution_table,
                                           noisy_note, thresholding_table)

    cfg = ExecutionConfig(checkpoints, str(out), batch_size=batch_size, window=window, device=device,
                          min_run_time=min_run_time, thresholds=thresholds, corpus=corpus,
                          threshold_windows=threshold_windows, threads=threads)
    table = measure_execution(cfg, execution_sources(cfg.checkpoints))
    console = Console(highlight=False)
    console.print(execution_table(table))
    console.print(decided_table(table))
    console.print(decoding_table(table))
    if note := noisy_note(table):
        console.print(note, soft_wrap=True)
    for csv, show in ((out / "thresholding.csv", thresholding_table), (out / "conditions.csv", conditions_table)):
        if csv.is_file():
            console.print(show(pd.read_csv(csv)))
    console.print(f"every column: {out / 'execution.csv'}", soft_wrap=True)


@command
def report(inputs: List[Path] = typer.Argument(..., metavar="DIR",
                                               help="summary, audit, training or execution directories"),
           out: str = typer.Option(..., metavar="DIR", help="directory for report.html, report.md, figures, CSVs"),
           allow_partial: AllowPartial = False, threads: Threads = None) -> None:
    """Markdown and HTML report with tables and figures.

    Finds what the given directories hold (summaries, audits, training runs, execution results).
    """
    from fcaudit.report.render import build_report

    path = build_report(inputs, out, allow_partial=allow_partial)
    typer.echo(f"report: {path}")


@command
def demo(out: str = typer.Option("demo-out", metavar="DIR", help="output directory (rerun to resume)"),
         quick: bool = typer.Option(False, "--quick", help="tiny models: under a minute (the full demo: about 7 "
                                                             "minutes on 2 CPU cores)"),
         device: Device = "auto",
         threads: Optional[int] = typer.Option(1, "--threads", metavar="N", help="torch CPU threads (default 1: the "
                                               "same numbers on every run, and no thrashing on a shared machine; "
                                               "more train faster on idle cores, with other last digits)")) -> None:
    """The whole study end to end on the embedded corpus.

    Trains, audits, summarizes, measures execution and writes the report; rerun to resume.
    """
    from fcaudit.demo import run_demo

    run_demo(out, quick=quick, device=device)


def main() -> None:
    app(prog_name="fcaudit")
