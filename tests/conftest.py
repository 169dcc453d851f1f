"""What several test modules share: the tiny models and audit helpers, synthetic audit directories, and the runner
of the documentation's code blocks. (Test modules import these from here, never from each other.)"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from fcaudit import audit
from fcaudit.auditor import files
from fcaudit.controllers import Controller
from fcaudit.io import write_json
from fcaudit.protocol import Criteria


@pytest.fixture(scope="session", autouse=True)

def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine extra threads only thrash."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def fuzz_world(tmp_path_factory):
    """The fuzzing campaign's world (tests/fuzzing.py): tiny checkpoints and audits, a decoy tree, a run directory."""
    import fuzzing

    return fuzzing.World(tmp_path_factory.mktemp("fuzz"))


# ---- tiny models and audits ------------------------------------------------------------------------------------

V, T = 32, 16


class Gate(nn.Module):
    """Dynamic gate: one sigmoid coefficient per token from the hidden state."""

    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, 1)
        self.calls = 0

    def forward(self, h):
        self.calls += 1
        return torch.sigmoid(self.proj(h)).squeeze(-1)


class StaticGate(nn.Module):
    def __init__(self, value):
        super().__init__()
        self.value = nn.Parameter(torch.tensor(float(value)))

    def forward(self, h):
        return self.value.expand(h.shape[:2])


class Block(nn.Module):
    def __init__(self, d, gate):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(2 * d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.gate = gate

    def forward(self, h):
        mix = h.cumsum(1) / torch.arange(1, h.shape[1] + 1, device=h.device)[:, None]  # causal token mixing
        g = self.gate(h)
        return h + g[..., None] * self.mlp(torch.cat([self.ln(h), mix], -1))


class ToyGated(nn.Module):
    """A tiny gated transformer-like model; `static` gives a LayerStatic twin, `hf` returns an object with .logits."""

    def __init__(self, n_layer=3, d=16, static=False, hf=False, sleep=0.0):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, d)
        self.blocks = nn.ModuleList(Block(d, StaticGate(0.3 + 0.2 * l) if static else Gate(d)) for l in range(n_layer))
        self.head = nn.Linear(d, V)
        self.hf, self.sleep = hf, sleep

    def forward(self, ids):
        if self.sleep:
            time.sleep(self.sleep)
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        logits = self.head(h)
        return SimpleNamespace(logits=logits) if self.hf else logits


def windows(n, seed):
    return torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(seed))


def gated(model):
    return Controller.from_modules(model, "blocks.*.gate", layout="batch token", static_name="LayerMean")


def run(model, ctrl, out, n_eval=8, n_calib=4, R=3, **kw):
    return audit(model, ctrl, windows(n_eval, 0), windows(n_calib, 1), randomizations=R, seed=0, out=out,
                 batch_size=kw.pop("batch_size", 4), quiet=True, **kw)


class Leaky(ToyGated):
    """Its output reads state the controller writes: replay cannot reproduce it."""

    def forward(self, ids):
        self.blocks[0].gate.calls = 0
        logits = super().forward(ids)
        return logits + 1e-3 * self.blocks[0].gate.calls  # 0 when the gate's forward was replaced


class MoELayer(nn.Module):
    def __init__(self, d, n_expert):
        super().__init__()
        self.router = nn.Linear(d, n_expert)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(n_expert))

    def forward(self, h):
        b, t, d = h.shape
        x = h.reshape(b * t, d)  # the router sees flattened tokens: layout "(batch token) expert"
        w = torch.softmax(self.router(x), -1)
        y = sum(w[:, e:e + 1] * expert(x) for e, expert in enumerate(self.experts))
        return h + y.view(b, t, d)


class ToyMoE(nn.Module):
    def __init__(self, d=16, n_expert=4, n_layer=2):
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(V, d)
        self.layers = nn.ModuleList(MoELayer(d, n_expert) for _ in range(n_layer))
        self.head = nn.Linear(d, V)

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class DenseMix(nn.Module):
    """MUDD-like controller of layer i: [stream, batch, token, source] mixing weights over i+2 earlier states."""

    def __init__(self, d, streams, sources):
        super().__init__()
        self.proj = nn.Linear(d, streams * sources)
        self.streams, self.sources = streams, sources

    def forward(self, h):
        w = self.proj(h).view(*h.shape[:2], self.streams, self.sources)
        return w.permute(2, 0, 1, 3) + 1.0 / self.sources


class ToyMudd(nn.Module):
    """Ragged sites: layer i mixes i+2 stored hidden states, 2 streams except 1 at the last layer."""

    def __init__(self, d=16, n_layer=3):
        super().__init__()
        torch.manual_seed(2)
        self.emb = nn.Embedding(V, d)
        self.mlps = nn.ModuleList(nn.Linear(d, d) for _ in range(n_layer))
        self.dynamic_dense = nn.ModuleList(DenseMix(d, 2 if i < n_layer - 1 else 1, i + 2) for i in range(n_layer))
        self.head = nn.Linear(d, V)

    def forward(self, ids):
        states = [self.emb(ids)]
        h = states[0]
        for mlp, mix in zip(self.mlps, self.dynamic_dense):
            h = h + torch.tanh(mlp(h))
            states.append(h)
            dw = mix(h)  # [C, B, T, i+2]
            stack = torch.stack(states, -1)  # [B, T, D, i+2]
            h = sum(torch.einsum("btdk,btk->btd", stack, dw[c]) for c in range(dw.shape[0]))
        return self.head(h)


def randomized_means(result):
    d = result.penalties().to_frame()["statistic"]
    return d


def tiny_early_exit(seed: int = 0, threshold: float = 0.5):
    """An untrained three-block early-exit model whose exit classifiers are spread so that tokens leave at every
    depth (an untrained classifier says about 1/2 everywhere)."""
    from fcaudit.models.early_exit import EarlyExitConfig, EarlyExitGPT

    torch.manual_seed(seed)
    model = EarlyExitGPT(EarlyExitConfig(n_layer=3, n_head=2, d_model=32, block_size=64, exit_threshold=threshold))
    for block in model.blocks:
        if block.exit is not None:
            nn.init.normal_(block.exit.score.weight, std=0.5)
    return model.eval()


# ---- synthetic audit directories (planted penalties) -----------------------------------------------------------

RANDOMIZED = ("CrossInput", "TokenShuffle", "CrossShuffle")
# The paper's FeatureGate 76M condition means (section 4.3), GlobalMean chosen so that retention is 98.70%.
FG = {"CrossInput": 0.000951, "TokenShuffle": 0.001905, "CrossShuffle": 0.001888, "LayerPositionMean": 0.000562,
      "StaticProfile": 0.001287, "StructureRemoved": 0.001287 / 0.013}
MUDD = {"CrossInput": 1.9067, "TokenShuffle": 2.9637, "CrossShuffle": 3.0, "LayerPositionMean": 1.0190,
        "StaticProfile": 1.9798, "StructureRemoved": 7.4237}
FG_LABELS = {"StaticProfile": "LayerMean", "StructureRemoved": "GlobalMean"}
MUDD_LABELS = {"StaticProfile": "StaticMixMean", "StructureRemoved": "SourceUniformMean"}


def make_records(penalties: dict, n_windows=24, R=4, noise=2e-4, seed=0) -> pd.DataFrame:
    """Records whose per-condition mean ΔNLL is exactly the planted penalty (noise centred per condition)."""
    rng = np.random.default_rng(seed)
    base = 2.0 + rng.normal(0, 0.1, n_windows)
    rows = [(e, "Correct", 0, base[e], 63) for e in range(n_windows)]
    for c, p in penalties.items():
        reps = R if c in RANDOMIZED else 1
        eps = rng.normal(0, noise, (n_windows, reps))
        eps -= eps.mean()
        rows += [(e, c, r, base[e] + p + eps[e, r], 63) for e in range(n_windows) for r in range(reps)]
    return pd.DataFrame(rows, columns=["example", "condition", "randomization", "nll", "tokens"])


def write_audit(path: Path, penalties: dict, *, name="FeatureGate tiny", labels=FG_LABELS, seed=0, criteria=None,
                variation=True, **kw) -> Path:
    """An audit directory in the engine's layout (marker, config.json, records/<condition>/*.parquet, replay,
    variation); its controller's static condition is StaticTopK where it ran (a router's), else StaticProfile."""
    from fcaudit.auditor.directory import FORMAT, MARKER, AuditDir, config_hash

    rec = make_records(penalties, seed=seed, **kw).assign(active=np.nan)  # the records' columns (active not planted)
    crit = {**Criteria().to_dict(), **(criteria or {}), "fixed_at": "2026-01-01T00:00:00+00:00"}
    static = "StaticTopK" if "StaticTopK" in penalties else "StaticProfile"
    config = {"format": FORMAT, "seed": seed, "labels": labels, "model": {"family": name, "seed": seed},
              "criteria": crit, "created_at": "2026-01-01T00:00:00+00:00", "randomizations": kw.get("R", 4),
              "batch_size": 8, "conditions": ["Correct", *penalties], "windows": {"n_eval": kw.get("n_windows", 24)},
              "controller": {"static": static}}
    path.mkdir(parents=True, exist_ok=True)
    digest = config_hash(config)
    write_json(path / MARKER, {"format": FORMAT, "config_hash": digest}, hashed=True)
    write_json(path / "config.json", {**config, "config_hash": digest})
    adir = AuditDir(path)
    for (c, r), g in rec.groupby(["condition", "randomization"]):
        (path / "records" / c).mkdir(parents=True, exist_ok=True)
        files.write_columns(adir.records(c, r),  # as the engine writes them: hashed, bound to this audit
                            {**{k: g[k].to_numpy() for k in g.columns}, "condition": c}, adir.binding(c, r))
    write_json(path / "replay.json", adir.bound({"max_abs_dlogit": 0.0, "delta_nll": 0.0, "passed": True,
                                                       "tolerance": 0.0, "findings": []}), hashed=True)
    if variation:
        frac = {"input": 0.004, "layer": 0.9, "token": 0.006, "input:layer": 0.03, "input:token": 0.01,
                "layer:token": 0.04, "input:layer:token": 0.01}
        write_json(path / "variation.json", adir.bound({"decomposition": frac, "decomposed": "scalar", "layers": [
            {"layer": i, "shape": [1, 1], "mean": 0.5 + 0.01 * i, "sd": 0.05, "stream_source_mean": [[0.5]]}
            for i in range(4)]}), hashed=True)
    return path


# ---- the documentation's code blocks ------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
RUN = {"python", "bash"}
NOT_CODE = {"text"}  # outputs
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not run: (.+?) -->\s*$")


@dataclass(frozen=True)

class CodeBlock:
    lang: str
    code: str
    line: int
    skip: str | None  # why it is not run


def blocks(path: Path) -> list[CodeBlock]:
    text = path.read_text()
    found = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = NOT_RUN.search(before)
        found.append(CodeBlock(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1, skip and skip.group(1)))
    return found


def shims(bin_dir: Path) -> dict[str, str]:
    """An environment in which `fcaudit`, `python` and `torchrun` are this interpreter's."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, args in {"fcaudit": "-m fcaudit", "python": "", "torchrun": "-m torch.distributed.run"}.items():
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" {args} "$@"\n')
        shim.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    return env


SHELL = set("|&;<>()$`\\*?[]{}~")  # what only a shell understands: a line with any of it runs in bash


def fcaudit_args(line: str) -> list[str] | None:
    """The arguments of a line that is one plain `fcaudit` command (words and a trailing comment), else None."""
    if re.search(r"\S#", line):  # bash keeps a # inside a word, shlex would start a comment there
        return None
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError:  # an unclosed quote, a continuation backslash
        return None
    plain = words[:1] == ["fcaudit"] and not any(SHELL & set(w) for w in words)
    return words[1:] if plain else None


def run_bash(code: str, where: Path, env: dict[str, str], label: str) -> None:
    """Run a bash block as a user's shell would. A block of plain `fcaudit` lines runs them one by one through the
    Typer app in this process (the same command `fcaudit` runs, without a new interpreter's imports each time); any
    other block (torchrun, diff, a variable, a pipe) runs whole in bash, with `fcaudit` on PATH."""
    lines = [line for line in code.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    commands = [fcaudit_args(line) for line in lines]
    if all(args is not None for args in commands):
        from typer.testing import CliRunner

        from fcaudit.cli import app

        for line, args in zip(lines, commands):
            result = CliRunner(env=env).invoke(app, args, prog_name="fcaudit")
            crashed = result.exception and not isinstance(result.exception, SystemExit)
            trace = "".join(traceback.format_exception(result.exception)) if crashed else ""
            assert result.exit_code == 0, f"{label}: `{line}` exit {result.exit_code}:\n{result.output[-3000:]}{trace}"
        return
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=where, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"{label} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def run_page(path: Path, where: Path, monkeypatch) -> dict:
    """Run every runnable block of `path` in `where`; returns the Python namespace the blocks shared."""
    env = shims(where / ".bin")
    monkeypatch.chdir(where)
    scope: dict = {"__name__": "__docs__"}
    for b in blocks(path):
        if b.skip or b.lang not in RUN:
            continue
        label = f"{path.relative_to(ROOT)}:{b.line}"
        if b.lang == "python":
            exec(compile(b.code, label, "exec"), scope)
        else:
            run_bash(b.code, where, env, label)
    return scope
