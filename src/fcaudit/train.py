"""Training the model families on a byte-level corpus: AdamW, warmup + cosine, clipping, validation, exact resume.

A run directory holds train_config.json (a rerun with another config is refused), the latest training state
ckpt/step-NNNNNN/ (safetensors + JSON, pointed at by latest.json; rerunning resumes from it, bit for bit on the CPU),
the final model (config.json, model.safetensors) and, last, metrics.json: Byte-PPL (exp of the mean NLL per predicted
byte over contiguous test windows from the split's start) and gate mass (mean gate over those tokens and all layers).
"""

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from safetensors.torch import load_file, save_file

from fcaudit import data, families
from fcaudit.config import MAX_BATCH_SIZE, MAX_SEED, MAX_STEPS, MAX_WINDOW, MAX_WINDOWS, check_count
from fcaudit.device import resolve_device
from fcaudit.errors import FcauditError
from fcaudit.io import COMMANDS, LOCK, OutDir, read_json, remove_stale_temps, remove_tree, write_json
from fcaudit.loss import logits_of, token_nll
from fcaudit.models.checkpoint import load_weights, save_weights
from fcaudit.provenance import provenance
from fcaudit.weights import weight_files

# Per-preset defaults of the fields left at None. tiny: tests (seconds); demo: ~1 min on 2 CPU cores.
# The paper does not state its optimizer recipe; the paper presets follow GPT-2/nanoGPT-style values.
TRAIN_PRESETS: dict[str, dict] = {
    "tiny": dict(steps=30, batch_size=8, lr=3e-3, warmup=5, eval_interval=10, eval_windows=8, test_windows=16),
    "demo": dict(steps=240, batch_size=16, lr=2e-3, warmup=24, eval_interval=80, eval_windows=32, test_windows=256),
    "paper-76m": dict(steps=50_000, batch_size=32, lr=6e-4, warmup=2000, eval_interval=1000, eval_windows=256,
                      test_windows=0),
    "paper-504m": dict(steps=100_000, batch_size=64, lr=3e-4, warmup=2000, eval_interval=2000, eval_windows=256,
                       test_windows=0),
}
# Options of some variants only: field -> (CLI flag, the models that take it); the family's `configure` completes them.
VARIANT_OPTIONS = {"matched_to": ("--matched-to", ("uniform-matched",)), "fixed_depth": ("--depth", ("fixeddepth",)),
                   "gate_value": ("--gate-value", ("uniform-fixed", "uniform-matched"))}


@dataclass
class TrainConfig:
    model: str = "featuregate"  # a name some family trains (fcaudit.families.trainable())
    preset: str = "demo"  # tiny | demo | paper-76m | paper-504m (mudd: the presets of muddpythia.BYTE_PRESETS)
    seed: int = 0
    corpus: str = "embedded"
    steps: int | None = None  # None: the preset's default (TRAIN_PRESETS)
    batch_size: int | None = None
    window: int | None = None  # training / evaluation window in tokens; None: the model's block_size
    lr: float | None = None
    min_lr: float | None = None  # None: lr / 10
    warmup: int | None = None
    weight_decay: float = 0.1  # on matrices only (not norms, biases, gate logits)
    grad_clip: float = 1.0
    eval_interval: int | None = None  # validation and training-state checkpoint every this many steps
    eval_windows: int | None = None  # validation windows (seeded, fixed across runs)
    test_windows: int | None = None  # cap on contiguous test windows for Byte-PPL; 0 = all
    device: str = "auto"  # auto | cpu | cuda
    out: str = "runs/train"
    gate_value: float | None = None  # uniform-fixed (default 0.60) / uniform-matched (required, or matched_to)
    matched_to: str | None = None  # uniform-matched: a FeatureGate run dir whose measured gate mass sets gate_value
    fixed_depth: int | None = None  # fixeddepth: number of blocks k
    progress: bool = True

    def __post_init__(self):
        family = families.for_training(self.model)  # an unknown model is a one-line error
        if self.preset not in family.presets:
            raise FcauditError(f"unknown preset {self.preset!r} for {self.model}: use one of {', '.join(family.presets)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise FcauditError(f"unknown device {self.device!r}: use auto, cpu or cuda")
        for k, v in TRAIN_PRESETS.get(self.preset, TRAIN_PRESETS["demo"]).items():
            if getattr(self, k) is None:
                setattr(self, k, v)
        _check_hyperparameters(self)  # before anything is read or written: a bad value never leaves a run dir
        if self.min_lr is None:
            self.min_lr = self.lr / 10
        for name, (flag, models) in VARIANT_OPTIONS.items():
            if getattr(self, name) is not None and self.model not in models:
                raise FcauditError(f"{flag} is for --model {' or '.join(models)}, not {self.model}: drop it")
        if family.configure is not None:
            family.configure(self)

    def identity(self) -> dict:
        """The fields that define the run: device, out and progress may change when it resumes."""
        return {k: v for k, v in asdict(self).items() if k not in ("device", "out", "progress")}


# (field, CLI flag, smallest allowed value, is the smallest value itself allowed, largest: fcaudit.config's limits).
# None fields are left to defaults.
_LIMITS = (("steps", "--steps", 1, True, MAX_STEPS), ("batch_size", "--batch-size", 1, True, MAX_BATCH_SIZE),
           ("lr", "--lr", 0.0, False, None), ("min_lr", "min_lr", 0.0, True, None),
           ("warmup", "warmup", 0, True, MAX_STEPS), ("weight_decay", "weight_decay", 0.0, True, None),
           ("grad_clip", "grad_clip", 0.0, False, None), ("eval_interval", "eval_interval", 1, True, MAX_STEPS),
           ("eval_windows", "eval_windows", 1, True, MAX_WINDOWS), ("test_windows", "test_windows", 0, True,
                                                                    MAX_WINDOWS),
           ("window", "window", 2, True, MAX_WINDOW), ("fixed_depth", "--depth", 1, True, None),
           ("seed", "--seed", 0, True, MAX_SEED))


def _check_hyperparameters(cfg: "TrainConfig") -> None:
    """Finite numbers in range, integers where counts are meant; one line naming the flag otherwise."""
    for name, flag, low, inclusive, high in _LIMITS:
        v = getattr(cfg, name)
        if v is None:
            continue
        counts = isinstance(low, int)
        ok_type = isinstance(v, int) and not isinstance(v, bool) if counts else isinstance(v, (int, float))
        if not ok_type or not math.isfinite(v) or (v < low if inclusive else v <= low):
            want = (f"an integer >= {low}" if counts else f"a finite number {'>=' if inclusive else '>'} {low:g}")
            raise FcauditError(f"{flag} {v!r} is out of range: pass {want}")
        if high is not None:
            check_count(v, flag, low, high)
    if cfg.gate_value is not None and not (isinstance(cfg.gate_value, (int, float)) and 0 < cfg.gate_value < 1):
        raise FcauditError(f"--gate-value {cfg.gate_value!r} is out of range: pass a gate value between 0 and 1")
    if cfg.min_lr is not None and cfg.lr is not None and cfg.min_lr > cfg.lr:
        raise FcauditError(f"min_lr {cfg.min_lr:g} exceeds --lr {cfg.lr:g}: pass a min_lr at most the learning rate")


@dataclass
class TrainResult:
    out: Path
    byte_ppl: float
    gate_mass: float | None
    n_params: int
    metrics: dict = field(default_factory=dict)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to lr over `warmup` steps, then cosine decay to min_lr at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - 1 - cfg.warmup)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))) * (cfg.lr - cfg.min_lr)


def make_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    # Matrices decay; vectors (norms, biases, gate logits) and the family's Family.no_decay do not. Ties count once.
    kept = families.for_training(cfg.model).no_decay
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() >= 2 and not n.startswith(kept) else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def _autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def evaluate(model: nn.Module, family: families.Family, windows: torch.Tensor, batch_size: int,
             device: torch.device) -> dict:
    """Mean NLL per predicted token, Byte-PPL and gate mass over `windows` [N, T]."""
    was_training = model.training
    model.eval()
    nll_sum, n_tok, gate_sum, n_gate = 0.0, 0, 0.0, 0
    for ids in windows.split(batch_size):
        ids = ids.to(device)
        with _autocast(device):  # the gates [L, B, T] of a family with scalar gates (None for its ungated members)
            logits, gates = family.gates(model, ids) if family.gates else (logits_of(model(ids), model, ids), None)
        nll = token_nll(logits, ids).double()
        nll_sum, n_tok = nll_sum + nll.sum().item(), n_tok + nll.numel()
        if gates is not None:
            gate_sum, n_gate = gate_sum + gates.double().sum().item(), n_gate + gates.numel()
    model.train(was_training)
    nll = nll_sum / n_tok
    mass = gate_sum / n_gate if n_gate else family.ungated_mass
    byte_ppl = math.exp(nll) if nll <= 709 else math.inf  # exp overflows above 709; a non-finite NLL stops training
    return {"nll": nll, "byte_ppl": byte_ppl, "gate_mass": mass, "tokens": n_tok, "windows": len(windows)}


def _save_state(out: Path, step: int, model, opt, rng: np.random.Generator, history: list) -> None:
    """Write ckpt/step-NNNNNN/ completely, then point latest.json at it, then drop older states."""
    name = f"ckpt/step-{step:06d}"
    tmp = out / f"ckpt/.tmp-step-{step:06d}"  # none is left: the run removed stale ones and holds the lock
    tmp.mkdir(parents=True)
    save_weights(tmp / "model.safetensors", model)
    opt_state = opt.state_dict()
    save_file({f"{i}.{k}": v.detach().contiguous().cpu() for i, s in opt_state["state"].items() for k, v in s.items()},
              str(tmp / "optimizer.safetensors"))
    cuda = {"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {}
    save_file({"torch": torch.get_rng_state(), **cuda}, str(tmp / "rng.safetensors"))
    write_json(tmp / "state.json", {"step": step, "numpy_rng": rng.bit_generator.state,
                                    "param_groups": opt_state["param_groups"], "history": history})
    remove_tree(out / name)
    tmp.rename(out / name)
    write_json(out / "latest.json", {"step": step, "dir": name})
    for old in (out / "ckpt").glob("step-*"):
        if old.name != Path(name).name:
            remove_tree(old)


def _load_state(out: Path, model, opt, rng: np.random.Generator, device: torch.device) -> tuple[int, list]:
    latest = out / "latest.json"
    if not latest.is_file():
        return 0, []
    ckpt = out / read_json(latest)["dir"]
    if not (ckpt / "state.json").is_file():
        raise FcauditError(f"training state {ckpt} is incomplete: delete {out} (or latest.json) and rerun")
    state = read_json(ckpt / "state.json")
    load_weights(ckpt / "model.safetensors", model, device=device)
    per_param: dict[int, dict] = {}
    for key, t in load_file(str(ckpt / "optimizer.safetensors")).items():
        i, name = key.split(".", 1)
        per_param.setdefault(int(i), {})[name] = t
    opt.load_state_dict({"state": per_param, "param_groups": state["param_groups"]})
    rng_tensors = load_file(str(ckpt / "rng.safetensors"))
    torch.set_rng_state(rng_tensors["torch"])
    if "cuda" in rng_tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng_tensors["cuda"])
    rng.bit_generator.state = state["numpy_rng"]
    return state["step"], state["history"]


def _has_results(out: Path) -> bool:
    """Whether a run dir holds anything trained: a training state or a finished model."""
    return (out / "latest.json").is_file() or (out / "metrics.json").is_file() or any((out / "ckpt").glob("step-*"))


def _check_run_dir(out: Path, cfg: TrainConfig, corpus_fingerprint: str) -> None:
    """Refuse a run dir holding results of another config or corpus content (a resume would train on other data); a
    config file without results (a run stopped before its first checkpoint) is replaced, not blocking the fix."""
    path = out / "train_config.json"
    current = {**cfg.identity(), "corpus_fingerprint": corpus_fingerprint}
    if path.is_file() and _has_results(out):
        try:
            previous = read_json(path)
        except (ValueError, UnicodeDecodeError):
            raise FcauditError(f"{path} is not valid JSON: delete {out} and rerun") from None
        diff = sorted(k for k in set(previous) | set(current) if previous.get(k) != current.get(k))
        if diff:
            raise FcauditError(f"{out} holds a run with a different config ({', '.join(diff)}): use another --out or delete {out}")
    else:
        write_json(path, current)


def _non_finite(what: str, value: float, step: int, cfg: TrainConfig, out: Path, created: bool) -> FcauditError:
    """The error for a diverged run. Without any saved state the run dir is removed again (when this run created
    it), so the corrected command starts clean; otherwise the last good state stays."""
    if _has_results(out):
        kept = read_json(out / "latest.json")["step"] if (out / "latest.json").is_file() else "?"
        return FcauditError(f"{what} became {value} at step {step} (lr {cfg.lr:g}): the last good training state "
                            f"(step {kept}) is kept in {out}; rerun with a smaller --lr and another --out")
    (out / "train_config.json").unlink(missing_ok=True)
    ours = (LOCK, COMMANDS["training run"].marker)
    if created and not any(p.name not in ours for p in out.iterdir()):
        for name in ours:
            (out / name).unlink(missing_ok=True)  # the lock is held by its descriptor, not its name
        out.rmdir()
    return FcauditError(f"{what} became {value} at step {step} (lr {cfg.lr:g}), before any checkpoint: "
                        f"rerun with a smaller --lr")


def train(cfg: TrainConfig, corpus=None) -> TrainResult:
    """Train (or resume, or return the finished run in cfg.out) and report Byte-PPL and gate mass on the test split.
    `corpus`: an already loaded fcaudit.data.Corpus named cfg.corpus (saves reloading it for many runs)."""
    run_dir = OutDir(cfg.out, "training run").check()  # new, empty or a run of ours (fcaudit.io's rule for every --out)
    out = run_dir.root
    device = resolve_device(cfg.device)
    if corpus is None:
        corpus = data.load_corpus(cfg.corpus)
    elif corpus.name != cfg.corpus:
        raise FcauditError(f"corpus {corpus.name!r} was passed for a config naming {cfg.corpus!r}: pass the matching corpus")
    torch.manual_seed(cfg.seed)
    family = families.for_training(cfg.model)
    model = family.build(cfg).to(device)  # ids [B, T] -> logits [B, T, V]
    window, val, test = _windows(cfg, model, corpus)
    rng = np.random.default_rng(cfg.seed)
    opt = make_optimizer(model, cfg, device)  # may still refuse the config: nothing is written before this
    created = not out.exists()
    with run_dir:  # locked: one writer per run directory; released however the process ends
        _check_run_dir(out, cfg, corpus.fingerprint)
        # finished earlier with the same config; a final model that lost its files is saved again from the last
        # training state (the loop below runs no step), as "no weights file ... rerun the training" says
        if (out / "metrics.json").is_file() and (out / "config.json").is_file() and weight_files(out):
            m = read_json(out / "metrics.json")
            return TrainResult(out, m["byte_ppl"], m["gate_mass"], m["n_params"], m)

        for d in (out, out / "ckpt"):  # what an interrupted run left half written
            remove_stale_temps(d)
        for tmp in (out / "ckpt").glob(".tmp-step-*"):
            remove_tree(tmp)
        start, history = _load_state(out, model, opt, rng, device)
        run = _Run(cfg, out, created, model, family, opt, rng, device)
        train_seconds, tokens_seen = run.steps(start, history, corpus.train, val, window)

        result = evaluate(model, family, test, cfg.batch_size, device)
        if not math.isfinite(result["nll"]):
            raise _non_finite("the test NLL", result["nll"], cfg.steps, cfg, out, created)
        n_params = sum(p.numel() for p in model.parameters())
        metrics = {"byte_ppl": result["byte_ppl"], "test_nll": result["nll"], "gate_mass": result["gate_mass"],
                   "test_windows": result["windows"], "test_tokens": result["tokens"], "variant": cfg.model,
                   "preset": cfg.preset, "seed": cfg.seed, "corpus": cfg.corpus, "corpus_fingerprint": corpus.fingerprint,
                   "n_params": n_params, "steps": cfg.steps, "window": window, "device": str(device),
                   "train_seconds_this_session": train_seconds,
                   "train_tokens_per_s_this_session": tokens_seen / train_seconds if tokens_seen else None,
                   "history": history, "config": cfg.identity(), **provenance()}
        family.save(model, out, {k: metrics[k] for k in ("byte_ppl", "gate_mass", "variant", "seed", "corpus", "steps")})
        write_json(out / "metrics.json", metrics)
        return TrainResult(out, metrics["byte_ppl"], metrics["gate_mass"], n_params, metrics)


def _windows(cfg: TrainConfig, model: nn.Module, corpus) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(window, validation ids, test ids), refused before anything is written when the corpus cannot fill them."""
    context = families.context_length(model)
    window = cfg.window or context
    if window > context:
        raise FcauditError(f"window {window} exceeds the model's context of {context} tokens: use a shorter window")
    if getattr(model.config, "vocab_size", corpus.vocab_size) < corpus.vocab_size:
        raise FcauditError(f"corpus {cfg.corpus!r} has {corpus.vocab_size} token ids but the model only {model.config.vocab_size}")
    if len(corpus.validation) < window:
        raise FcauditError(f"corpus {cfg.corpus!r} has a validation split of {len(corpus.validation)} tokens, shorter "
                           f"than one window of {window}: give it more text (its validation split is 5% of a file)")
    n_val = min(cfg.eval_windows, len(corpus.validation) // window)
    val = data.make_windows(corpus.validation, n_val, window, 0, "validation").ids
    return window, val, data.all_windows(corpus.test, window, limit=cfg.test_windows or None)


@dataclass
class _Run:
    """What the training steps share: a non-finite value stops them with `_non_finite`'s message."""

    cfg: TrainConfig
    out: Path
    created: bool
    model: nn.Module
    family: families.Family
    opt: torch.optim.Optimizer
    rng: np.random.Generator
    device: torch.device

    def steps(self, start: int, history: list, train_ids, val: torch.Tensor, window: int) -> tuple[float, int]:
        """Steps start..cfg.steps, validating and saving the training state every eval_interval (into `history`);
        (seconds, tokens seen) of this session. A bar on a terminal, a line per validation in a log."""
        cfg = self.cfg
        self.model.train()
        t0, tokens_seen = time.perf_counter(), 0
        console = Console()  # no bar when the output is a file or a pipe: it would end up as stray lines there
        bar = cfg.progress and (console.is_terminal or console.is_jupyter)
        progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=console, disable=not bar)
        lines = cfg.progress and not bar  # a log file gets a line per validation instead
        if lines and start:
            console.print(f"train {cfg.model} s{cfg.seed}: resuming at step {start} of {cfg.steps}", highlight=False)
        with progress:
            task = progress.add_task(f"train {cfg.model} s{cfg.seed}", total=cfg.steps, completed=start, info="")
            for step in range(start, cfg.steps):
                ids = data.random_batch(train_ids, cfg.batch_size, window, self.rng).to(self.device)
                loss_value = self.step(step, ids)
                tokens_seen += ids.numel()
                done = step + 1
                if done % cfg.eval_interval == 0 or done == cfg.steps:
                    v = evaluate(self.model, self.family, val, cfg.batch_size, self.device)
                    if not math.isfinite(v["nll"]):
                        raise _non_finite("the validation NLL", v["nll"], done, cfg, self.out, self.created)
                    history.append({"step": done, "train_loss": loss_value, "val_nll": v["nll"]})
                    _save_state(self.out, done, self.model, self.opt, self.rng, history)
                    if lines:
                        console.print(f"train {cfg.model} s{cfg.seed}: step {done}/{cfg.steps} loss {loss_value:.3f} "
                                      f"val {v['nll']:.3f} ({time.perf_counter() - t0:.0f} s)", highlight=False)
                progress.update(task, completed=done, info=f"loss {loss_value:.3f}" +
                                (f" val {history[-1]['val_nll']:.3f}" if history else ""))
        return time.perf_counter() - t0, tokens_seen

    def step(self, step: int, ids: torch.Tensor) -> float:
        """One optimizer step on ids at step's learning rate; its loss. A non-finite step stops before it reaches
        the weights."""
        for group in self.opt.param_groups:
            group["lr"] = lr_at(step, self.cfg)
        with _autocast(self.device):
            loss = (self.family.train_loss(self.model, ids) if self.family.train_loss is not None
                    else token_nll(logits_of(self.model(ids), self.model, ids), ids).mean())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        loss_value = loss.item()
        for what, value in (("the training loss", loss_value), ("the gradient norm", grad_norm.item())):
            if not math.isfinite(value):
                raise _non_finite(what, value, step + 1, self.cfg, self.out, self.created)
        self.opt.step()
        return loss_value
