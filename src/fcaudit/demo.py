"""`fcaudit demo`: the paper's study end to end on the embedded corpus, small enough for a laptop CPU: train Table 1's
models (several seeds of the audited FeatureGate variants) and an early-exit model, audit them (MoD twice: its top-k
router and its causal predictor), then summaries, execution and the report. Every step writes its own directory under OUT and is skipped
once finished, so rerunning the command resumes."""

from __future__ import annotations

import functools
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

import torch
from rich.console import Console

from fcaudit.checkpoint_audit import audit_checkpoint
from fcaudit.config import AuditConfig
from fcaudit.data import load_corpus
from fcaudit.device import resolve_device
from fcaudit.errors import FcauditError
from fcaudit.execution import ExecutionConfig, measure_execution
from fcaudit.families.hf import require_transformers
from fcaudit.families.mod import causal_checkpoint
from fcaudit.io import OutDir, read_json, read_object
from fcaudit.report.render import build_report
from fcaudit.report.tables import to_markdown, training_display, training_table
from fcaudit.summary import summarize
from fcaudit.train import TrainConfig, TrainResult, train

console = Console(stderr=True)


@dataclass(frozen=True)
class DemoPlan:
    preset: str  # FeatureGate-family preset
    mudd_preset: str
    seeds: int  # training seeds of FeatureGate, Uniform and LayerStatic
    steps: int | None  # None: the preset's default
    mudd_steps: int | None
    moe_steps: int | None  # the byte-level Mixtral (Hugging Face transformers), preset = `preset`
    fixed_depth: int  # k of FixedDepth-k
    n_eval: int
    n_calib: int
    window: int
    randomizations: int
    batch_size: int
    thresholds: tuple[float, ...] = (0.3, 0.5, 0.6, 0.7)  # post-training gate thresholding (execution)
    exit_steps: int | None = None  # the early-exit model's (None: `steps`): its exit classifiers need them to exit
    min_run_time: float = 1.0  # seconds of latency timing per model (execution)


FULL = DemoPlan(preset="demo", mudd_preset="demo", seeds=5, steps=None, mudd_steps=300,
                moe_steps=240, fixed_depth=2, n_eval=64, n_calib=64, window=128, randomizations=5, batch_size=16)
QUICK = DemoPlan(preset="tiny", mudd_preset="tiny", seeds=2, steps=30, mudd_steps=30, moe_steps=30,
                 fixed_depth=1, n_eval=16, n_calib=16, window=64, randomizations=2, batch_size=16, min_run_time=0.5,
                 exit_steps=120)

# the models trained (several seeds, or seed 0 alone), audited (MoD also through its causal copy) and measured
MULTI_SEED = ("featuregate", "uniform", "layerstatic")
ONE_SEED = ("dense", "uniform-fixed", "uniform-matched", "fixeddepth", "mudd", "moe", "mod", "early-exit")
AUDITED = MULTI_SEED + ("mudd", "moe", "mod", "early-exit")
MEASURED = ("dense", "uniform", "layerstatic", "featuregate", "fixeddepth", "mudd", "moe", "mod", "early-exit")


def run_demo(out: Path, *, quick: bool = False, device: str = "auto") -> Path:
    require_transformers("the demo (it trains and audits a Hugging Face MoE model)")  # before anything is trained
    plan = QUICK if quick else FULL
    resolve_device(device)  # before the directory is claimed: a refused device leaves nothing behind
    out = _claim(out, plan).root
    t0 = time.perf_counter()
    corpus = load_corpus("embedded")
    console.print(f"[bold]fcaudit demo[/bold] ({'quick' if quick else 'full'}) -> {out}  "
                  f"corpus: {corpus.source}, {sum(corpus.describe()['tokens'].values()) / 1e6:.1f} MB")
    runs = _train_all(out, plan, device, corpus)
    audits, causal = _audit_all(out, plan, device, runs)

    # 3. summaries, execution, report
    summary = summarize(audits, out=out / "summary")
    console.print(str(summary), soft_wrap=True, markup=False, highlight=False)
    ckpts = [out / "train" / f"{m}-s0" for m in MEASURED] + ([causal] if causal else [])
    started = time.perf_counter()
    measure_execution(ExecutionConfig(ckpts, out / "execution", batch_size=8, window=plan.window,
                                      device=device, min_run_time=plan.min_run_time, thresholds=plan.thresholds,
                                      threshold_windows=plan.n_eval, progress=False))
    console.print(f"execution -> {out / 'execution'}  ({time.perf_counter() - started:.0f} s)")
    report = build_report([out / "train", out / "summary", *audits, out / "execution"], out / "report")
    console.print(f"[bold green]done[/bold green] in {time.perf_counter() - t0:.0f} s: report {report}")
    return report


def _claim(out: Path, plan: DemoPlan) -> OutDir:
    """`out` claimed for the demo, holding this plan (a demo of another plan there is refused: it cannot resume)."""
    out = OutDir(out, "demo").check()
    saved = out.root / "demo_plan.json"
    planned = json.loads(json.dumps(asdict(plan)))  # tuples come back from JSON as lists
    if saved.is_file() and read_object(saved, "delete it and rerun the demo") != planned:
        raise FcauditError(f"{out.root} holds a demo with another plan (--quick or not): use another --out or delete "
                           f"{out.root}")
    out.claim()
    if not saved.is_file():
        out.write_json(saved, asdict(plan))
    return out


def _train_all(out: Path, plan: DemoPlan, device: str, corpus) -> list[tuple[str, int]]:
    """1. Training (Table 1): every (model, seed) run, in worker processes of one torch thread each where the CPU
    has cores for them (each run is seeded, so it trains the same weights in any process and order)."""
    runs = [(m, s) for m in MULTI_SEED for s in range(plan.seeds)] + [(m, 0) for m in ONE_SEED]
    workers = _training_workers(device, len(runs))
    progress = console.is_terminal and workers == 1  # a bar on a terminal for one worker; else the demo's lines only
    # uniform-matched reads featuregate-s0's gate mass: configured once that is done
    matched = runs.index(("uniform-matched", 0)) if ("uniform-matched", 0) in runs else None
    pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=torch.set_num_threads,
                               initargs=(torch.get_num_threads(),)) if workers > 1 else None
    try:
        pending = {i: pool.submit(_train_one, train_config(out, plan, device, *run, progress))
                   for i, run in enumerate(runs) if pool and i != matched}
        for i, (model, seed) in enumerate(runs):
            if not pool:
                r, seconds = _train_one(train_config(out, plan, device, model, seed, progress), corpus)
            else:
                if i == matched:
                    pending[i] = pool.submit(_train_one, train_config(out, plan, device, model, seed, progress))
                r, seconds = pending[i].result()
            mass = f"  gate mass {r.gate_mass:.4f}" if r.gate_mass is not None else ""
            console.print(f"[bold]train[/bold] {i + 1}/{len(runs)}: {model} seed {seed}  Byte-PPL {r.byte_ppl:.4f}"
                          f"{mass}  ({seconds:.0f} s)")
    finally:
        if pool:
            pool.shutdown(cancel_futures=True)  # a run that failed stops those not yet started

    table = training_table([read_json(out / "train" / f"{m}-s{s}" / "metrics.json") for m, s in runs])
    demo = OutDir(out, "demo")
    demo.write_text(out / "table1.md", to_markdown(training_display(table)) + "\n")
    demo.write_text(out / "table1.csv", table.to_csv(index=False))
    console.print(f"Table 1 -> {out / 'table1.md'}")
    return runs


def train_config(out: Path, plan: DemoPlan, device: str, model: str, seed: int, progress: bool) -> TrainConfig:
    """The demo's training run of `model` at `seed`, into out/train/{model}-s{seed}."""
    mudd = model == "mudd"
    steps = {"mudd": plan.mudd_steps, "moe": plan.moe_steps, "early-exit": plan.exit_steps or plan.steps}.get(
        model, plan.steps)
    return TrainConfig(model=model, preset=plan.mudd_preset if mudd else plan.preset, seed=seed,
                       out=str(out / "train" / f"{model}-s{seed}"), device=device, steps=steps,
                       window=plan.window if mudd else None,
                       fixed_depth=plan.fixed_depth if model == "fixeddepth" else None,
                       matched_to=str(out / "train" / "featuregate-s0") if model == "uniform-matched" else None,
                       progress=progress)


def _training_workers(device: str, runs: int) -> int:
    """Processes that train at once: on the CPU, as many as its cores hold at the demo's torch threads."""
    if resolve_device(device).type != "cpu":
        return 1
    return max(1, min(runs, len(os.sched_getaffinity(0)) // torch.get_num_threads()))


def _train_one(cfg: TrainConfig, corpus=None) -> tuple[TrainResult, float]:
    """One training run and its seconds (a worker loads the corpus once)."""
    started = time.perf_counter()
    return train(cfg, corpus=corpus or _embedded()), time.perf_counter() - started


@functools.cache
def _embedded():
    return load_corpus("embedded")


def _audit_all(out: Path, plan: DemoPlan, device: str,
               runs: list[tuple[str, int]]) -> tuple[list[Path], Path | None]:
    """2. The audits' directories, and the causal copy of MoD (None where MoD is not trained): MoD is audited twice,
    its top-k router and the causal predictor of a copy that routes by it."""
    audited = [(f"{m}-s{s}", out / "train" / f"{m}-s{s}", None) for m, s in runs if m in AUDITED]
    causal = out / "causal" / "mod-s0" if ("mod", 0) in runs else None
    if causal is not None:
        if not (causal / "model.safetensors").is_file():
            causal_checkpoint(out / "train" / "mod-s0", causal)
        audited.append(("mod-causal-s0", causal, f"mod-causal {plan.preset}"))
    audits = []
    for name, ckpt, family in audited:
        audit_dir = out / "audit" / name
        console.print(f"[bold]audit[/bold] {name}")
        config = AuditConfig(out=audit_dir, n_eval=plan.n_eval, n_calib=plan.n_calib, window=plan.window,
                             randomizations=plan.randomizations, seed=0, batch_size=plan.batch_size, device=device,
                             family=family, quiet=True, execution=True)
        started = time.perf_counter()
        audit_checkpoint(str(ckpt), "embedded", config)
        console.print(f"  ({time.perf_counter() - started:.0f} s)")
        audits.append(audit_dir)
    return audits, causal
