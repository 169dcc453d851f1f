"""The fuzzing campaign: hypothesis strategies for fcaudit's seven input surfaces (checkpoint configs, safetensors
headers and shard indexes, CLI options, the Python API, damaged audit directories, models that misbehave, Hugging
Face checkpoint directories of any architecture) and the one runner that plays an
input and judges its outcome (with tests/harness.py's judges, which the bad-input and safety tests use too).

An input is plain data, a surface and a spec of symbolic choices ("@fg" is a fresh copy of a tiny trained FeatureGate
run, "@fifo" a FIFO in the run directory, ...), so a case the campaign finds is one row of tests/test_fuzz.py's table.
`play(world, surface, spec)` returns an `Outcome`: "ok" (the call succeeded), "refused" (one FcauditError line, or
the CLI's `error: ...` line and exit code 2, or Click's usage error), or a failure: "traceback" (any other exception or
exit code), "noisy" (warning or traceback lines before a refusal), "silent" (an audit directory read or resumed with
records that are not its own, or a message saying "rerun" whose rerun does not lead out), "foreign-write" (a file
outside the run directory changed: the world's decoy tree and templates are watched), and, in the long run, "hang"
(over 60 s) and "rss" (over 2 GB).

Values that pass the checks are drawn small (a valid `--steps` is 1 or 2), values meant to be refused are drawn past
fcaudit's limits: a valid but long run is not a finding. The long run, `make fuzz`:

    python tests/fuzzing.py --inputs 10000 --workers 2 --out fuzz-out

forks one child per input from a worker that has imported torch once; the parent kills a child past the time or
memory limit, and prints the counts per surface.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

from hypothesis import strategies as st

import harness
from harness import FAILURES, Outcome, api_outcome, cli_outcome, last_frames, tree

SURFACES = ("config", "weights", "cli", "api", "audit-dir", "model", "hf")
HANG_S = 60.0
RSS_LIMIT = 2 * 2**30
TESTS = Path(__file__).resolve().parent


# ---- the world: templates, a decoy tree, the run directory ---------------------------------------------------------

class World:
    """One worker's world under `root`: templates/ (tiny checkpoints and audits, built once), decoy/ (a user's files
    outside every run directory: its cwd/ is the current directory, its home/ HOME), and run/, made anew per input."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.templates = self.root / "templates"
        self.decoy = self.root / "decoy"
        self.run = self.root / "run"
        for d in (self.templates, self.decoy / "cwd" / "data", self.decoy / "home", self.decoy / "empty"):
            d.mkdir(parents=True, exist_ok=True)
        (self.decoy / "cwd" / "notes.txt").write_text("the user's notes\n")
        (self.decoy / "cwd" / "data" / "keep.csv").write_text("a,b\n1,2\n")
        (self.decoy / "home" / ".profile").write_text("# the user's profile\n")
        self._copies: dict[str, Path] = {}
        self._built = False

    # -- templates, each built once: tiny untrained checkpoints (their numbers mean nothing; their files are real)
    @cached_property
    def fg(self) -> Path:
        return self._checkpoint("fg", "featuregate")

    @cached_property
    def dense(self) -> Path:
        return self._checkpoint("dense", "dense")

    @cached_property
    def mod(self) -> Path:
        import torch

        from fcaudit.families.mod import save
        from fcaudit.models.mod import MoDGPT, config_for

        torch.manual_seed(0)
        return save(MoDGPT(config_for("tiny", "mod")), self.templates / "mod", {"variant": "mod"})

    def _checkpoint(self, name: str, variant: str) -> Path:
        """A FeatureGate-family checkpoint with the metrics.json a training run writes beside it."""
        import torch

        from fcaudit.io import write_json
        from fcaudit.models.checkpoint import save_checkpoint
        from fcaudit.models.featuregate import FeatureGateGPT, config_for

        torch.manual_seed(0)
        out = save_checkpoint(self.templates / name, FeatureGateGPT(config_for("tiny", variant)), {"variant": variant})
        write_json(out / "metrics.json", {"byte_ppl": 250.0, "gate_mass": 0.5, "variant": variant, "preset": "tiny",
                                          "seed": 0})
        return out

    @cached_property
    def mudd(self) -> Path:
        import torch

        from fcaudit.models.muddpythia import BYTE_PRESETS, MUDDPythia

        torch.manual_seed(0)
        return MUDDPythia(BYTE_PRESETS["tiny"]).save_pretrained(self.templates / "mudd")

    @cached_property
    def moe(self) -> Path:
        from fcaudit.families.hf.tiny import byte_mixtral_config
        from transformers import AutoModelForCausalLM
        import torch

        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(byte_mixtral_config("tiny")).save_pretrained(self.templates / "moe")
        return self.templates / "moe"

    @cached_property
    def hf(self) -> dict[str, Path]:
        """One tiny save_pretrained checkpoint per controller class of the hf surface (HF_CHECKPOINTS)."""
        import torch
        import transformers

        out = {}
        for name, (model_type, config) in HF_CHECKPOINTS.items():
            out[name] = self.templates / f"hf-{name}"
            if not (out[name] / "config.json").is_file():
                cfg = transformers.AutoConfig.for_model(model_type, **{**HF_SMALL, **config})
                torch.manual_seed(0)
                transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out[name])
        return out

    @cached_property
    def model(self):
        import fcaudit as fca

        return fca.load(self.fg, device="cpu")

    @cached_property
    def windows(self) -> dict:
        import fcaudit as fca

        ev, ca = fca.windows("embedded", n_eval=4, n_calib=2, window=16, seed=0)
        ev2, ca2 = fca.windows("embedded", n_eval=4, n_calib=2, window=16, seed=1)
        return {"eval": ev.ids, "calib": ca.ids, "eval2": ev2.ids, "calib2": ca2.ids, "set": (ev, ca)}

    def audit_args(self, which: str = "a") -> dict:
        """The fca.audit call of template audit `which`: a (seed 0), b (seed 1) or c (other windows)."""
        import fcaudit as fca

        w = self.windows
        ev, ca = (w["eval2"], w["calib2"]) if which == "c" else (w["eval"], w["calib"])
        return dict(model=self.model, controller=fca.controller_for(self.model), eval_windows=ev, calib_windows=ca,
                    randomizations=2, seed=1 if which == "b" else 0, batch_size=2, quiet=True)

    def audit(self, which: str) -> Path:
        out = self.templates / f"audit-{which}"
        if not (out / "variation.json").is_file():
            from fcaudit.auditor import audit

            audit(out=out, **self.audit_args(which))
        return out

    @cached_property
    def audit_ckpt(self) -> Path:
        """An audit of the fg checkpoint as `fcaudit audit` writes it: its config.json names the checkpoint."""
        out = self.templates / "audit-ckpt"
        if not (out / "variation.json").is_file():
            from fcaudit.checkpoint_audit import audit_checkpoint
            from fcaudit.config import AuditConfig

            audit_checkpoint(str(self.fg), "embedded", AuditConfig(out=out, n_eval=4, n_calib=2, window=16,
                                                                   randomizations=1, batch_size=2, quiet=True))
        return out

    @cached_property
    def records_a(self):
        from fcaudit.auditor import AuditResult

        return AuditResult.load(self.audit("a")).records

    @cached_property
    def summary(self) -> Path:
        from fcaudit.summary import summarize

        out = self.templates / "summary"
        if not (out / "summary.json").is_file():
            summarize([self.audit("a")], out=out)
        return out

    def build(self) -> None:
        """Every template, before the first input (a forked child builds nothing its parent could keep)."""
        if self._built:
            return
        self._built = True
        for name in ("fg", "dense", "mod", "mudd", "moe", "hf", "model", "windows", "records_a", "summary",
                     "audit_ckpt"):
            getattr(self, name)
        for which in "abc":
            self.audit(which)
        from fcaudit import data

        data.load_corpus("embedded")  # cached for every child

    # -- per input
    def fresh(self) -> None:
        shutil.rmtree(self.run, ignore_errors=True)
        (self.run / "tmp").mkdir(parents=True)
        self._copies = {}

    def copy(self, name: str) -> Path:
        """A fresh copy of template `name` in the run directory (once per input)."""
        if name not in self._copies:
            src = {"fg": lambda: self.fg, "dense": lambda: self.dense, "mod": lambda: self.mod,
                   "mudd": lambda: self.mudd, "moe": lambda: self.moe, "summary": lambda: self.summary,
                   "audit-a": lambda: self.audit("a"), "audit-b": lambda: self.audit("b"),
                   "audit-ckpt": lambda: self.audit_ckpt,
                   **{f"hf-{k}": (lambda k=k: self.hf[k]) for k in HF_CHECKPOINTS}}[name]()
            dst = self.run / name
            shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns(".lock"))
            self._copies[name] = dst
        return self._copies[name]

    def path(self, token: Any) -> Any:
        """A spec's symbolic path ("@fg", "@fifo", ...) as a real one; anything else as it is."""
        if not (isinstance(token, str) and token.startswith("@")):
            return token
        name, run = token[1:], self.run
        special = {
            "missing": lambda: run / "does-not-exist", "out": lambda: run / "out", "out2": lambda: run / "out2",
            "file": lambda: _text(run / "notes.txt"), "binary": lambda: _binary(run / "random.bin"),
            "empty-file": lambda: _text(run / "empty.txt", ""), "fifo": lambda: _fifo(run / "fifo"),
            "dir-fifo": lambda: _fifo(_text(run / "corpus" / "a.txt", "text " * 400).parent / "pipe").parent,
            "devzero": lambda: Path("/dev/zero"), "devnull": lambda: Path("/dev/null"), "root": lambda: Path("/"),
            "proc": lambda: Path("/proc"), "dev": lambda: Path("/dev"),
            "decoy-cwd": lambda: self.decoy / "cwd", "decoy-data": lambda: self.decoy / "cwd" / "data",
            "decoy-file": lambda: self.decoy / "cwd" / "notes.txt", "home": lambda: self.decoy / "home",
            "decoy-ckpt": lambda: self.fg,  # the user's checkpoint, outside the run directory
            "long": lambda: run / ("x" * 300), "long-utf8": lambda: run / "d" / ("é" * 130),
            "nul": lambda: str(run / "a\x00b"), "empty": lambda: "", "dot": lambda: ".",
            "link-decoy": lambda: _link(run / "link", self.decoy / "cwd" / "data"),
            # an --out that is a link to an empty directory, or lies below one: a write would go through it
            "link-empty": lambda: _link(run / "link-empty", self.decoy / "empty"),
            "below-link": lambda: _link(run / "link-up", self.decoy / "empty") / "out",
            # a byte-level checkpoint with a tokenizer.json of its own: the corpus is still read as bytes
            "fg-tokenizer": lambda: _tokenizer(self.copy("fg")),
            "map-bad": lambda: _text(run / "map.json", "{layers: 0"),
            "map-list": lambda: _text(run / "map.json", "[0]"),
            "map-cuda": lambda: _text(run / "map.json", '{"": "cuda:0"}'),
            "corpus-text": lambda: _text(run / "text.txt", "Some text to read. " * 2000),
            "hub-id": lambda: "nobody/no-such-model", "runs": lambda: self.copy("fg").parent,
        }
        if name in special:
            return special[name]()
        return self.copy(name)

    # -- watching what is outside the run directory
    def watched(self) -> dict:
        # a lock taken on a template is opened for writing and truncated to its pid
        return tree(self.decoy, self.templates, skip=frozenset({"__pycache__", ".lock"}))


def _text(path: Path, text: str = "a few words of text\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _binary(path: Path) -> Path:
    path.write_bytes(bytes(range(256)) * 32)
    return path


def _fifo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        os.mkfifo(path)
    return path


def _tokenizer(ckpt: Path) -> Path:
    """`ckpt` with a word-level tokenizer.json of 27 tokens beside its weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join("abcdefghijklmnopqrstuvwxyz")],
                            trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(ckpt / "tokenizer.json"))
    return ckpt


def _link(path: Path, target: Path) -> Path:
    path.symlink_to(target)
    return path


@contextlib.contextmanager
def inside(world: World):
    """The current directory, HOME and the temporary directory of one input: the decoy's cwd, its home, run/tmp."""
    saved = os.getcwd(), dict(os.environ), tempfile.tempdir
    os.chdir(world.decoy / "cwd")
    os.environ.update(HOME=str(world.decoy / "home"), TMPDIR=str(world.run / "tmp"),
                      MPLCONFIGDIR=str(world.root / "cache"), XDG_CACHE_HOME=str(world.root / "cache"))
    tempfile.tempdir = str(world.run / "tmp")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")  # a warning shown once per process would hide in the fast run
            warnings.showwarning = _to_stderr  # as a user sees it (under pytest a recorder would take it)
            yield
    finally:
        os.chdir(saved[0])
        os.environ.clear()
        os.environ.update(saved[1])
        tempfile.tempdir = saved[2]


def _to_stderr(message, category, filename, lineno, file=None, line=None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def play(world: World, surface: str, spec: dict) -> Outcome:
    """Play one input in a fresh run directory; a change outside it is a foreign write whatever the call returned."""
    world.build()
    world.fresh()
    before = world.watched()
    with inside(world):
        try:
            outcome = PLAYERS[surface](world, spec)
        except Exception as e:  # noqa: BLE001 (a harness step itself failing: reported, never hidden)
            outcome = Outcome("traceback", "harness: " + last_frames(e))
    after = world.watched()
    if after != before:
        changed = sorted(set(before) ^ set(after) | {p for p in before if p in after and before[p] != after[p]})
        return Outcome("foreign-write", f"{changed[:3]} ({outcome.kind}: {outcome.detail[:120]})")
    return outcome


def cli(args: list) -> Outcome:
    return cli_outcome(harness.cli(*args))


# ---- surface 1: checkpoint configs ---------------------------------------------------------------------------------

FAMILIES = ("fg", "mod", "mudd", "moe")
KEYS = {
    "fg": ("variant", "n_layer", "n_head", "d_model", "block_size", "vocab_size", "gate_value", "gate_hidden",
           "norm_eps", "model_type", "meta"),
    "mod": ("variant", "n_layer", "n_head", "d_model", "block_size", "vocab_size", "capacity", "route_every",
            "predictor_hidden", "routing", "norm_eps", "model_type", "meta"),
    "mudd": ("block_size", "vocab_size", "n_layer", "n_head", "n_local_heads", "dim", "head_dim", "intermediate_size",
             "rope_base", "rotary_pct", "norm_eps", "torch_dtype", "dense_type", "round64", "model_type", "auto_map"),
    "moe": ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "num_local_experts", "num_experts_per_tok", "vocab_size", "max_position_embeddings", "head_dim",
            "rms_norm_eps", "rope_parameters", "sliding_window", "router_jitter_noise", "dtype", "torch_dtype",
            "model_type", "architectures", "tie_word_embeddings", "auto_map", "text_config"),
}
DELETE = "__delete__"
HUGE = (2**31, 2**63, 10**12, 200_000, 2**64)
JSON_VALUES = st.sampled_from([0, 1, 2, 3, 4, 7, 16, 64, -1, -(2**63), *HUGE, 0.5, 1e-5, -0.0, 1e308,
                               float("nan"), float("inf"), "", "x", "float32", "bfloat16", "int8", "\u0000", None,
                               True, False, [], [1, 2], {}, {"a": 1}, DELETE])
ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**65, 2**65) | st.floats() | st.text(max_size=8),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                    max_size=3), max_leaves=6)
CONFIG_ACTIONS = ("dry-run", "dry-run", "audit", "load", "execution")


@st.composite
def checkpoint_configs(draw) -> dict:
    family = draw(st.sampled_from(FAMILIES))
    keys = st.sampled_from(KEYS[family])
    return {"family": family, "edits": draw(st.lists(st.tuples(keys, JSON_VALUES), min_size=1, max_size=3)),
            "whole": draw(st.none() | st.none() | ANY_JSON),
            "metrics": draw(st.none() | st.none() | st.none() | ANY_JSON | st.just("{not json")),
            "action": draw(st.sampled_from(CONFIG_ACTIONS))}


SMALL = ["--eval", 2, "--calib", 2, "--window", 8, "--randomizations", 1, "--batch-size", 2, "--quiet"]


def load_action(world: World, ckpt: Path, action: str) -> Outcome:
    if action == "load":
        import fcaudit as fca

        return api_outcome(lambda: fca.load(ckpt, device="cpu"))[0]
    if action == "execution":
        return cli(["execution", ckpt, "--out", world.run / "e", "--window", 8, "--batch-size", 1,
                    "--min-run-time", 0.01])
    return cli(["audit", ckpt, *SMALL, "--out", world.run / "a", *(["--dry-run"] if action == "dry-run" else [])])


def play_config(world: World, spec: dict) -> Outcome:
    ckpt = world.copy(spec["family"])
    config = json.loads((ckpt / "config.json").read_text())
    for key, value in spec["edits"]:
        if value == DELETE:
            config.pop(key, None)
        else:
            config[key] = value
    text = json.dumps(config if spec["whole"] is None else spec["whole"])
    (ckpt / "config.json").write_text(text)
    if spec["metrics"] is not None:
        (ckpt / "metrics.json").write_text(spec["metrics"] if spec["metrics"] == "{not json"
                                           else json.dumps(spec["metrics"]))
    return load_action(world, ckpt, spec["action"])


# ---- surface 2: safetensors headers and shard indexes --------------------------------------------------------------

DTYPE_NAMES = st.sampled_from(["F32", "F16", "BF16", "F64", "I64", "I8", "U8", "BOOL", "F8_E4M3", "X", "", 5, None])
SHAPES = st.sampled_from([[], [0], [-1], [1], [2, 2], [2**40], [10**6, 10**6], [2**63], [1, 1, 1, 1, 1, 1, 1, 1],
                          "x", None])
OFFSETS = st.sampled_from([[0, 0], [0, 4], [4, 0], [-1, 4], [0, 2**63], [2**64, 2**64 + 4], [0], "x", None])
SHARD_NAMES = st.sampled_from(["", "a\u0000b.safetensors", "../x.safetensors", "/etc/passwd", "model.safetensors",
                               "sub/", ".", "missing.safetensors", "x" * 300 + ".safetensors", 3, None,
                               "model-00002-of-00002.safetensors"])
PICKLES = ("plain", "legacy", "truncated", "payload", "not-dict", "empty", "tensor-subclass", "protocol-4", "pickle",
           "torchscript")
WEIGHT_OPS = ("header", "metadata", "length", "truncate", "append", "garbage", "index", "index-whole", "pickle")


@st.composite
def weights_files(draw) -> dict:
    op = draw(st.sampled_from(WEIGHT_OPS))
    spec = {"family": draw(st.sampled_from(FAMILIES)), "op": op, "action": draw(st.sampled_from(("dry-run", "load")))}
    if op == "header":
        field_ = draw(st.sampled_from(("dtype", "shape", "data_offsets", "delete", "rename", "add")))
        value = {"dtype": DTYPE_NAMES, "shape": SHAPES, "data_offsets": OFFSETS}.get(field_, st.just(None))
        spec.update(tensor=draw(st.integers(0, 40)), field=field_, value=draw(value))
    elif op == "metadata":
        spec["value"] = draw(st.sampled_from([3, [1], {"a": 1}, {"format": "np"}, {"tied": "{bad"},
                                              {"tied": '{"a.weight": "nonexistent"}'}, {"tied": '["x"]'}, DELETE]))
    elif op == "length":
        spec["value"] = draw(st.sampled_from([0, 1, 7, 2**63, 2**64 - 1, 10**8, -1, 1]))
    elif op in ("truncate", "append"):
        spec["value"] = draw(st.integers(0, 100))  # percent of the file kept / bytes appended
    elif op == "garbage":
        spec["value"] = draw(st.sampled_from(["", "zeros", "random", "json"]))
    elif op == "index":
        spec.update(entry=draw(st.integers(0, 40)), value=draw(SHARD_NAMES))
    elif op == "index-whole":
        spec["value"] = draw(ANY_JSON | st.just("{not json"))
    elif op == "pickle":
        spec["value"] = draw(st.sampled_from(PICKLES))
    return spec


def _safetensors(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_safetensors(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


class _Payload:
    """A pickle payload: unpickled by full pickle, it would write into the decoy tree (a foreign write)."""

    def __init__(self, where: str):
        self.where = where

    def __reduce__(self):
        return (Path.write_text, (Path(self.where), "a checkpoint's code ran"))


def _pickle_weights(world: World, ckpt: Path, kind: str) -> None:
    import torch
    from safetensors.torch import load_file

    st_path = ckpt / "model.safetensors"
    state = load_file(str(st_path))
    st_path.unlink()
    target = ckpt / "pytorch_model.bin"
    obj: Any = state
    if kind == "payload":
        obj = {**state, "x": _Payload(str(world.decoy / "cwd" / "pwned.txt"))}
    elif kind == "not-dict":
        obj = list(state.values())
    elif kind == "empty":
        obj = {}
    elif kind == "tensor-subclass":
        obj = {**state, "x": torch.nn.Parameter(torch.zeros(2))}
    if kind == "pickle":  # plain pickle (protocol 5), as another program writes it
        target.write_bytes(pickle.dumps(obj))
    elif kind == "torchscript":
        with warnings.catch_warnings():  # torch.jit is deprecated: the harness's own warning, not fcaudit's
            warnings.simplefilter("ignore")
            torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(target))
    else:
        torch.save(obj, target, _use_new_zipfile_serialization=kind != "legacy",
                   pickle_protocol=4 if kind == "protocol-4" else 2)
    if kind == "truncated":
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])


def play_weights(world: World, spec: dict) -> Outcome:
    ckpt = world.copy(spec["family"])
    path = ckpt / "model.safetensors"
    op, value = spec["op"], spec.get("value")
    if op in ("header", "metadata"):
        header, data = _safetensors(path)
        names = sorted(k for k in header if k != "__metadata__")
        name = names[spec.get("tensor", 0) % len(names)]
        if op == "metadata":
            if value == DELETE:
                header.pop("__metadata__", None)
            else:
                header["__metadata__"] = value
        elif spec["field"] == "delete":
            del header[name]
        elif spec["field"] == "rename":
            header[name + ".renamed"] = header.pop(name)
        elif spec["field"] == "add":
            header["extra.weight"] = dict(header[name])
        else:
            header[name][spec["field"]] = value
        _write_safetensors(path, header, data)
    elif op == "length":
        raw = path.read_bytes()
        path.write_bytes((value % 2**64).to_bytes(8, "little") + raw[8:])
    elif op == "truncate":
        raw = path.read_bytes()
        path.write_bytes(raw[: len(raw) * value // 100])
    elif op == "append":
        with open(path, "ab") as f:
            f.write(b"\x00" * value)
    elif op == "garbage":
        path.write_bytes({"": b"", "zeros": bytes(4096), "random": bytes(range(256)) * 16,
                          "json": b'{"a": 1}'}[value])
    elif op in ("index", "index-whole"):
        header, data = _safetensors(path)
        names = sorted(k for k in header if k != "__metadata__")
        half = names[: len(names) // 2]
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(path))
        shards = {"model-00001-of-00002.safetensors": half,
                  "model-00002-of-00002.safetensors": [n for n in names if n not in half]}
        for shard, keys in shards.items():
            save_file({k: tensors[k] for k in keys}, str(ckpt / shard), metadata=header.get("__metadata__"))
        path.unlink()
        weight_map = {k: shard for shard, keys in shards.items() for k in keys}
        if op == "index":
            weight_map[names[spec["entry"] % len(names)]] = value
            index = json.dumps({"metadata": {}, "weight_map": weight_map})
        else:
            index = value if value == "{not json" else json.dumps(value)
        (ckpt / "model.safetensors.index.json").write_text(index)
    elif op == "pickle":
        _pickle_weights(world, ckpt, value)
    return load_action(world, ckpt, spec["action"])


# ---- surface 3: CLI options ----------------------------------------------------------------------------------------

BAD_INTS = [0, -1, -(2**63), 2**31, 2**63, 2**64, 10**30, "abc", "1.5", ""]
BAD_FLOATS = ["nan", "inf", "-inf", "-1", "0", "1e308", "1e-320", "abc", ""]
OUTS = ["@out", "@out", "@out", "@empty", "@dot", "@decoy-cwd", "@decoy-data", "@decoy-file", "@root", "@home",
        "@file", "@long", "@long-utf8", "@nul", "@fifo", "@devnull", "@link-decoy", "@proc", "@decoy-ckpt",
        "@link-empty", "@below-link"]
CORPORA = ["embedded", "embedded", "@corpus-text", "@fifo", "@devzero", "@devnull", "@dir-fifo", "@binary",
           "@empty-file", "@missing", "@empty", "@long", "@nul", "@dev", "nosuchcorpus"]
DEVICES = ["cpu", "cpu", "auto", "cuda", "cuda:0", "cuda:-1", "mps", "xla", "meta", "vulkan", "hpu", "xpu", "mtia",
           "privateuseone", "cpu:1", "", "gpu", "ipu", "lazy", "cuda:99999999999999999999"]
CKPTS = ["@fg", "@fg", "@fg", "@dense", "@mod", "@mudd", "@moe", "@missing", "@file", "@root", "@decoy-ckpt",
         "@fg-tokenizer", "@audit-a", "@audit-ckpt", "@hub-id", "@nul", "@long", "@empty", "@fifo", "@devnull",
         "@dot"]
AUDITS = ["@audit-a", "@audit-a", "@audit-b", "@fg", "@missing", "@file", "@root", "@decoy-cwd", "@summary",
          "@nul", "@long", "@empty", "@fifo", "@proc"]
REPORTABLE = ["@audit-a", "@summary", "@runs", "@root", "@proc", "@dev", "@decoy-cwd", "@file", "@missing",
              "@fifo", "@nul", "@long", "@empty", "@devnull"]


def ints(*good: int) -> st.SearchStrategy:
    return st.sampled_from([*good, *good, *BAD_INTS])


def floats(*good: float) -> st.SearchStrategy:
    return st.sampled_from([*good, *good, *BAD_FLOATS])


THREADS = ints(1, 2)
OPTIONS = {
    "train": {"--model": st.sampled_from(["featuregate", "dense", "mod", "mudd", "moe", "fixeddepth", "uniform-fixed",
                                          "uniform-matched", "layerstatic", "xyz", ""]),
              "--preset": st.sampled_from(["tiny", "tiny", "tiny", "demo-x", "", "paper-76m-x"]),
              "--seed": ints(0, 1), "--corpus": st.sampled_from(CORPORA), "--out": st.sampled_from(OUTS),
              "--steps": ints(1, 2), "--batch-size": ints(1, 2), "--lr": floats(1e-3, 3e-3),
              "--gate-value": floats(0.5), "--matched-to": st.sampled_from(["@fg", "@missing", "@file", "@mod"]),
              "--depth": ints(1, 2), "--device": st.sampled_from(DEVICES), "--threads": THREADS},
    "audit": {"--corpus": st.sampled_from(CORPORA), "--out": st.sampled_from(OUTS), "--eval": ints(2, 3, 4),
              "--calib": ints(1, 2), "--window": ints(8, 16), "--randomizations": ints(1, 2), "--seed": ints(0, 3),
              "--batch-size": ints(1, 2, 4), "--device": st.sampled_from(DEVICES),
              "--revision": st.sampled_from(["abc", "", "main"]),
              "--dtype": st.sampled_from(["float32", "bfloat16", "float16", "int8", "", "fp8", "float64"]),
              "--tolerance": floats(0, 1e-3), "--dry-run": st.just(None), "--world-size": ints(1, 2),
              "--device-map": st.sampled_from(["auto", "balanced", "@map-bad", "@map-list", "@map-cuda", "", "x"]),
              "--offload-folder": st.sampled_from(["@out2", "@out", "@decoy-cwd", "@file"]),
              "--family": st.sampled_from(["x", "", " ", "\n", "a" * 300]), "--quiet": st.just(None),
              "--threads": THREADS},
    "summarize": {"--out": st.sampled_from(OUTS), "--allow-partial": st.just(None), "--threads": THREADS},
    "execution": {"--out": st.sampled_from(OUTS), "--batch-size": ints(1, 2), "--window": ints(8, 16),
                  "--threshold": floats(0.3, 0.5), "--corpus": st.sampled_from(CORPORA),
                  "--threshold-windows": ints(1, 2), "--min-run-time": floats(0.01, 0.02),
                  "--threads": THREADS, "--device": st.sampled_from(DEVICES)},
    "report": {"--out": st.sampled_from(OUTS), "--allow-partial": st.just(None), "--threads": THREADS},
    "demo": {"--out": st.sampled_from(["@empty", "@dot", "@decoy-cwd", "@root", "@file", "@long", "@nul", "@fifo",
                                       "@home", "@devnull", "@link-empty", "@below-link"]),
             "--device": st.sampled_from(["mps", "xla", "cuda:99", "", "gpu", "meta"]),
             "--threads": st.sampled_from(BAD_INTS)},
}
POSITIONAL = {"audit": (CKPTS, 1, 1), "summarize": (AUDITS, 1, 3), "execution": (CKPTS, 1, 2),
              "report": (REPORTABLE, 1, 3), "train": ([], 0, 0), "demo": ([], 0, 0)}
BASE = {"train": ["--preset", "tiny", "--steps", 1, "--batch-size", 2, "--out", "@out"],
        "audit": [*SMALL, "--out", "@out"], "execution": ["--window", 8, "--batch-size", 1, "--min-run-time", 0.01,
                                                          "--out", "@out"],
        "summarize": ["--out", "@out"], "report": ["--out", "@out"], "demo": ["--quick"]}


@st.composite
def cli_options(draw) -> dict:
    command = draw(st.sampled_from(tuple(OPTIONS)))
    names = draw(st.lists(st.sampled_from(sorted(OPTIONS[command])), min_size=1, max_size=4, unique=True))
    if command == "demo":  # a valid demo runs for 20 s: one option from its must-refuse lists at least
        names = names or ["--out"]
    options = [[n, draw(OPTIONS[command][n])] for n in names]
    pool, low, high = POSITIONAL[command]
    positional = draw(st.lists(st.sampled_from(pool), min_size=low, max_size=high)) if pool else []
    return {"command": command, "positional": positional, "options": options}


def play_cli(world: World, spec: dict) -> Outcome:
    given = {name for name, _ in spec["options"]}
    base, args = BASE[spec["command"]], []
    i = 0
    while i < len(base):  # the base arguments, less those the input sets itself
        flag = base[i]
        takes = i + 1 < len(base) and not str(base[i + 1]).startswith("--")
        if flag not in given:
            args += base[i:i + 1 + takes]
        i += 1 + takes
    for name, value in spec["options"]:
        args += [name] if value is None else [name, value]
    return cli([spec["command"], *map(world.path, spec["positional"]), *map(world.path, args)])


# ---- surface 4: the Python API -------------------------------------------------------------------------------------

WINDOWS = ["valid", "valid", "valid", "none", "flat", "ragged", "float", "bool", "1d", "3d", "empty", "negative",
           "big-id", "str", "numpy", "windowset", "one", "long", "dict", "list-of-tensors", "nested-empty"]
COUNTS = [1, 2, 0, -1, 2.5, "2", None, True, 10**9, 2**64, float("nan")]
API_CALLS = ("audit", "audit", "plan", "windows", "load", "result", "controller", "summarize", "report", "criteria",
             "config")
API_VALUES = st.sampled_from([None, 0, 1, -1, 2**64, 1.5, float("nan"), float("inf"), "", "x", True, [], [1], {},
                              {"a": 1}, b"x", "@out", "@file", "@missing", "@nul", "@long", "@root", "@decoy-cwd"])


@st.composite
def api_calls(draw) -> dict:
    call = draw(st.sampled_from(API_CALLS))
    pick = lambda pool: draw(st.sampled_from(pool))  # noqa: E731
    if call in ("audit", "plan"):
        kw = {"eval_windows": pick(WINDOWS), "calib_windows": pick(WINDOWS)}
        for name, pool in (("randomizations", COUNTS), ("seed", [0, 1, -1, 2**64, 1.5, None, "0"]),
                           ("batch_size", COUNTS), ("out", ["@out", "@out", None, "@file", "@decoy-cwd", "", "@root",
                                                            "@nul", "@long", 3]),
                           ("tolerance", [0, 1e-3, -1, float("nan"), float("inf"), "0", None]),
                           ("criteria", [None, {}, {"small_upper": "x"}, {"confidence": 2}, [1], "x",
                                         {"small_upper": float("nan")}, {"retention_lower": -1}]),
                           ("model_info", [None, {}, {"family": 3}, [1], "x", {"family": ""}, {"checkpoint": None}]),
                           ("loss_fn", [None, "x", "scalar", "nan", "wrong-shape"]),
                           ("controller", ["valid", "valid", "x", None, "other-model"]),
                           ("world_size", [1, 2, 0, -1, 2**64, "x", None])):
            if draw(st.booleans()):
                kw[name] = pick(pool)
        if call == "audit":  # fca.plan takes fca.audit's settings and the processes it plans for
            kw.pop("world_size", None)
    elif call == "windows":
        kw = {"corpus": pick(["embedded", "embedded", "@corpus-text", "@fifo", "@devzero", "@dir-fifo", "@binary",
                              "@missing", "", 3, None, "@nul", "@long"]),
              "n_eval": pick([2, 4, *COUNTS]), "n_calib": pick([1, 2, *COUNTS]), "window": pick([8, 16, *COUNTS]),
              "seed": pick([0, -1, 2**64, None]), "tokenizer": pick([None, None, "x", "@missing", 3, "@file"])}
    elif call == "load":
        kw = {"path": pick(["@fg", "@mod", "@missing", "@file", "", 3, None, "@audit-a", "@nul", "@long", "@root",
                            "@hub-id"]),
              "device": pick(["auto", "cpu", "cuda", "mps", "", 3, None, "meta"]),
              "dtype": pick([None, "float32", "int8", 3, "bf16", "x"]), "revision": pick([None, "x", 3]),
              "device_map": pick([None, None, "auto", {}, 3, "x", {"": "cpu"}, {"": "cuda:0"}])}
    elif call == "result":
        kw = {"path": pick(["@audit-a", "@fg", "@missing", "@file", "", None, 3, "@root", "@nul", "@summary"]),
              "allow_partial": pick([True, False, "x", None])}
    elif call == "controller":
        kw = {"pattern": pick(["blocks.*.gate", "", "*", "nope.*", 3, None, "blocks.**", "blocks.*.gate.*", "["]),
              "layout": pick(["batch token", "", "batch", "x y z", 3, None, "(batch token)", "batch token 1",
                              "batch token token"]),
              "call": pick([None, 0, 1, -1, 99, "x", 2**64])}
    elif call == "summarize":
        kw = {"audits": draw(st.lists(st.sampled_from(["result-a", "result-b", "@audit-a", "@audit-b", "x", None, 3,
                                                       "@fg", "@missing"]), max_size=3)),
              "out": pick([None, "@out", "@file", "@decoy-cwd"]), "allow_partial": pick([False, True, "x"])}
    elif call == "report":
        kw = {"inputs": draw(st.lists(st.sampled_from(["@audit-a", "@summary", "@missing", "@root", None, 3, "@file",
                                                       "@nul"]), max_size=2)),
              "out": pick(["@out", "@file", "@decoy-cwd", "", None, "@nul", 3])}
    else:  # criteria, config
        names = (["small_upper", "retention_lower", "confidence"] if call == "criteria" else
                 ["n_eval", "n_calib", "window", "randomizations", "seed", "batch_size", "tolerance", "out", "device",
                  "dtype", "family", "world_size", "criteria", "loss_fn"])
        kw = {n: draw(API_VALUES) for n in draw(st.lists(st.sampled_from(names), max_size=3, unique=True))}
    return {"call": call, "kwargs": kw}


def _windows(world: World, name: str, which: str = "eval"):
    import numpy as np
    import torch

    ids = world.windows[which if which == "eval" else "calib"]
    return {
        "valid": lambda: ids, "none": lambda: None, "flat": lambda: ids[0].tolist(),
        "ragged": lambda: [ids[0].tolist(), ids[1, :5].tolist()], "float": lambda: ids.float(),
        "bool": lambda: ids > 100, "1d": lambda: ids[0], "3d": lambda: ids[None], "empty": lambda: ids[:0],
        "negative": lambda: ids - 300, "big-id": lambda: ids + 10**6, "str": lambda: "embedded",
        "numpy": lambda: ids.numpy(), "windowset": lambda: world.windows["set"][0 if which == "eval" else 1],
        "one": lambda: ids[:1], "long": lambda: torch.zeros(2, 10**5, dtype=torch.long), "dict": lambda: {"ids": ids},
        "list-of-tensors": lambda: list(ids), "nested-empty": lambda: [[]], "object": lambda: np.array([object()]),
        "duplicated": lambda: ids[:1].repeat(4, 1),
        "eval-shifted": lambda: torch.roll(world.windows["eval"][:2], -1, dims=1),  # a calibration set's near copies
    }[name]()


def _loss(name):
    import torch

    return {None: None, "x": "x", "scalar": lambda out, ids: out.float().mean(),
            "nan": lambda out, ids: torch.full((ids.shape[0],), float("nan")),
            "wrong-shape": lambda out, ids: torch.zeros(ids.shape[0] + 1)}[name]


ODD_MODELS = ("int-gate", "bool-gate", "hidden-first", "masked-entry", "nan-under-crossinput", "fails-late")


def _odd_model(world: World, name: str) -> tuple:
    """(model, controller): a tiny gated LM, written as a user would, that misbehaves as `name` says (issue 48)."""
    import torch
    from torch import nn

    import fcaudit as fca

    late = world.windows["eval"][2]  # "fails-late" raises on the batch that holds this window

    class Gate(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.floor, self.score = nn.Linear(d, 1), nn.Linear(d, 1)

        def forward(self, h):
            g = (self.floor(h) + nn.functional.softplus(self.score(h))).squeeze(-1)
            return {"int-gate": (g > 0.7).long(), "bool-gate": g > 0.7}.get(name, g)

    class LM(nn.Module):
        def __init__(self, d=16):
            super().__init__()
            torch.manual_seed(0)
            self.embed, self.head, self.wide = nn.Embedding(256, d), nn.Linear(d, 256), nn.Linear(d, 2 * d)
            self.mlps = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
            self.gates = nn.ModuleList(Gate(d) for _ in range(2))

        def forward(self, ids):
            if name == "fails-late" and any(torch.equal(row, late) for row in ids):
                raise IndexError("index 300 is out of bounds for dimension 0 with size 256")
            h = self.embed(ids)
            for mlp, gate in zip(self.mlps, self.gates):
                g = gate(h)
                if name == "nan-under-crossinput":  # the root of what lies above a floor that only its own gate keeps
                    g = (g - gate.floor(h).squeeze(-1)).sqrt()
                h = h + g.unsqueeze(-1) * mlp(h)
            logits = self.head(h)
            if name == "masked-entry":  # byte 0 never predicted
                logits = logits.masked_fill(torch.arange(256) == 0, float("-inf"))
            return (self.wide(h), logits) if name == "hidden-first" else logits

    model = LM().eval()
    return model, fca.Controller.from_modules(model, "gates.*", layout="batch token")


def play_api(world: World, spec: dict) -> Outcome:
    import fcaudit as fca
    from fcaudit.auditor import AuditResult

    call, kw = spec["call"], dict(spec["kwargs"])
    model = world.model
    if call in ("audit", "plan"):
        kw["eval_windows"] = _windows(world, kw["eval_windows"], "eval")
        kw["calib_windows"] = _windows(world, kw["calib_windows"], "calib")
        ctrl = kw.pop("controller", "valid")
        if "model" in kw:  # a model of its own, with its controller
            model, odd = _odd_model(world, kw.pop("model"))
        ctrl = {"valid": lambda: fca.controller_for(model), "x": lambda: "x", None: lambda: None,
                "other-model": lambda: fca.controller_for(fca.load(world.fg, device="cpu")),
                "own": lambda: odd}[ctrl]()
        if "loss_fn" in kw:
            kw["loss_fn"] = _loss(kw["loss_fn"])
        if "out" in kw:
            kw["out"] = world.path(kw["out"])
        if call == "audit":
            kw.setdefault("out", world.run / "out")
            kw.setdefault("randomizations", 1)
            outcome, result = api_outcome(lambda: fca.audit(model, ctrl, quiet=True, **kw))
            if result is not None and spec.get("remove"):  # its directory removed before its records are read
                shutil.rmtree(result.path)
            if result is not None:  # a result it returns must read back
                outcome = api_outcome(lambda: result.penalties())[0]
            return outcome
        return api_outcome(lambda: fca.plan(model, ctrl, **kw))[0]
    kw = {k: world.path(v) for k, v in kw.items()}
    if call == "windows":
        return api_outcome(lambda: fca.windows(**kw))[0]
    if call == "load":
        return api_outcome(lambda: fca.load(kw.pop("path"), **kw))[0]
    if call == "result":
        def read():
            r = AuditResult.load(kw["path"], allow_partial=kw["allow_partial"])
            return r.penalties(), r.factor_effects(), r.retention(), repr(r)
        return api_outcome(read)[0]
    if call == "controller":
        return api_outcome(lambda: fca.Controller.from_modules(model, kw["pattern"], kw["layout"], call=kw["call"]))[0]
    if call == "summarize":
        audits = [AuditResult.load(world.audit(a[-1])) if isinstance(a, str) and a.startswith("result-")
                  else world.path(a) for a in spec["kwargs"]["audits"]]
        return api_outcome(lambda: str(fca.summarize(audits, out=kw["out"], allow_partial=kw["allow_partial"])))[0]
    if call == "report":
        return api_outcome(lambda: fca.build_report([world.path(i) for i in spec["kwargs"]["inputs"]], kw["out"]))[0]
    if call == "criteria":
        return api_outcome(lambda: fca.Criteria(**kw))[0]
    return api_outcome(lambda: fca.AuditConfig(**kw))[0]


# ---- surface 5: damaged audit directories --------------------------------------------------------------------------

AUDIT_FILES = (".fcaudit-audit", "config.json", "replay.json", "variation.json", "profiles.safetensors",
               "coeffs/chunk_0000000.safetensors", "coeffs/chunk_0000002.safetensors",
               "records/Correct/r0000.parquet", "records/CrossInput/r0001.parquet",
               "records/TokenShuffle/r0000.parquet",
               "records/StaticProfile/r0000.parquet", "records/CrossShuffle/r0001.parquet.sha256",
               "records/StructureRemoved/r0000.parquet.sha256", "records", "records/CrossInput", "coeffs")
DAMAGE = ("delete", "truncate", "flip", "append", "foreign-b", "foreign-c", "stray-r", "stray-bare", "stray-cond",
          "dir", "link", "json", "json-rehash", "parts", "parts-foreign", "parts-bare", "empty", "unbound", "moved")
READERS = ("load", "load", "partial", "summarize", "report", "resume", "resume")
JSON_KEYS = ("randomizations", "windows", "conditions", "seed", "labels", "criteria", "model", "config_hash",
             "format", "passed", "max_abs_dlogit", "layers", "decomposition", "notices", "routing")


@st.composite
def damaged_audits(draw) -> dict:
    ops = []
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(DAMAGE))
        target = draw(st.sampled_from(AUDIT_FILES))
        arg: Any = draw(st.integers(0, 99))
        if op in ("json", "json-rehash"):
            target = draw(st.sampled_from([".fcaudit-audit", "config.json", "replay.json", "variation.json"]))
            arg = [draw(st.sampled_from(JSON_KEYS)), draw(JSON_VALUES)]
        elif op in ("stray-r", "stray-bare", "stray-cond", "parts", "parts-foreign", "parts-bare"):
            target = draw(st.sampled_from([f for f in AUDIT_FILES if f.endswith(".parquet")]))
        ops.append([op, target, arg])
    return {"ops": ops, "reader": draw(st.sampled_from(READERS))}


def _part_files(world: World, adir: Path, records: Path, source: Path, bound: Path | None) -> None:
    """The records of `source` (a records file) as two part files of `adir`, bound to the audit in `bound` (as
    its engine would have written them) or to none."""
    import torch

    from fcaudit.auditor import files
    from fcaudit.auditor.directory import AuditDir

    frame = files.quietly(files.read_frame, source)
    if frame is None:  # damaged by an earlier op: nothing to split
        return
    condition, r = records.parent.name, int(records.stem[1:])
    d, binder = AuditDir(adir), AuditDir(bound) if bound is not None else None
    for rows in (slice(0, 2), slice(2, None)):
        part = frame.iloc[rows]
        tensors = {"example": torch.from_numpy(part["example"].to_numpy().copy()),
                   "nll": torch.from_numpy(part["nll"].to_numpy().copy()),
                   "active": torch.from_numpy(part["active"].to_numpy().copy())}
        meta = files.quietly(binder.binding, condition, r) if binder is not None else {}
        if meta is None:  # its config.json damaged by an earlier op: no audit to bind to
            return
        files.write_tensors(d.part(condition, r, int(part["example"].iloc[0])), tensors, meta)


def damage(world: World, adir: Path, op: str, target: str, arg: Any) -> None:
    from fcaudit.auditor import files
    from fcaudit.io import write_json

    path = adir / target
    if op in ("json", "json-rehash"):
        if not path.is_file() or path.is_symlink():
            return
        try:
            obj = json.loads(path.read_text())
        except ValueError:
            return
        if not isinstance(obj, dict):
            return
        key, value = arg
        if value == DELETE:
            obj.pop(key, None)
        else:
            obj[key] = value
        if op == "json-rehash":  # a forged edit: its hash recomputed
            write_json(path, obj, hashed=True)
        else:
            path.write_text(json.dumps(obj))
        return
    if op in ("stray-r", "stray-bare", "stray-cond", "parts", "parts-foreign", "parts-bare"):
        if not path.is_file() or path.is_symlink() or path.parent.is_symlink():
            return
        if op == "stray-r":
            dst = path.with_name(f"r{arg + 2:04d}.parquet")
        elif op == "stray-bare":
            dst = path.with_name(f"r{arg:04d}.bare.parquet" if arg % 2 else f"r{arg + 2:04d}.parquet")
        else:
            dst = adir / "records" / "Bogus" / "r0000.parquet"
        if op.startswith("parts"):
            other = world.audit("b")
            source = (other / target) if op == "parts-foreign" else path
            if source.is_file():
                _part_files(world, adir, path, source, {"parts": adir, "parts-foreign": other}.get(op))
                if arg % 2:
                    path.unlink()  # the records file not merged yet
            return
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, dst)
        if op != "stray-bare":
            shutil.copy(files.sidecar(path), files.sidecar(dst))
        return
    if not path.exists() or path.is_symlink() or any(p.is_symlink() for p in path.parents):
        return  # an earlier link: the harness never writes through it
    if op == "delete":
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    elif path.is_dir():
        return
    elif op == "truncate":
        raw = path.read_bytes()
        path.write_bytes(raw[: len(raw) * arg // 100])
    elif op == "flip":
        raw = bytearray(path.read_bytes())
        if raw:
            raw[arg * len(raw) // 100] ^= 1 << (arg % 8)
            path.write_bytes(bytes(raw))
    elif op == "append":
        with open(path, "ab") as f:
            f.write(b"x" * (arg + 1))
    elif op == "unbound" and path.suffix == ".parquet":  # rewritten as an fcaudit before the binding wrote it
        frame = files.quietly(files.read_frame, path)
        if frame is not None:
            files.write_columns(path, {k: v.to_numpy() for k, v in frame.items()})
    elif op == "moved" and path.suffix == ".parquet":  # another run's records of this audit, in this run's place
        other = adir / "records" / "StructureRemoved" / "r0000.parquet"
        if other != path and other.is_file() and not other.is_symlink():
            shutil.copy(other, path)
            shutil.copy(files.sidecar(other), files.sidecar(path))
    elif op in ("foreign-b", "foreign-c"):
        other = world.audit(op[-1]) / target
        if other.is_file():
            shutil.copy(other, path)
            if path.suffix == ".parquet":
                shutil.copy(files.sidecar(other), files.sidecar(path))
    elif op == "dir":
        path.unlink()
        path.mkdir()
    elif op == "link":
        path.unlink()
        path.symlink_to(world.decoy / "cwd" / "notes.txt")
    elif op == "empty":
        path.write_bytes(b"")


def same_records(world: World, records, partial: bool = False) -> bool:
    """Whether these records are template audit a's (all of them, or with `partial` a subset), bit for bit."""
    import pandas as pd

    ours = world.records_a
    if not partial:
        try:
            pd.testing.assert_frame_equal(records.reset_index(drop=True), ours.reset_index(drop=True),
                                          check_exact=True)
            return True
        except AssertionError:
            return False
    keys = ["condition", "randomization", "example"]
    merged = records.merge(ours, on=keys, how="left", suffixes=("", "_a"), indicator=True)
    return bool((merged["_merge"] == "both").all() and (merged["nll"].to_numpy() == merged["nll_a"].to_numpy()).all())


def read_audit(world: World, adir: Path, reader: str) -> Outcome:
    from fcaudit.auditor import AuditResult, audit

    if reader in ("load", "partial"):
        outcome, result = api_outcome(lambda: AuditResult.load(adir, allow_partial=reader == "partial"))
        if result is None:
            return outcome
        outcome, records = api_outcome(lambda: result.records)
        if records is not None and not same_records(world, records, partial=result.partial):
            return Outcome("silent", f"{adir.name} read with records that are not its own (partial={result.partial})")
        if records is not None:
            outcome = api_outcome(lambda: (result.penalties(), result.factor_effects(), result.retention()))[0]
        return outcome
    if reader == "resume":
        outcome, result = api_outcome(lambda: audit(out=adir, **world.audit_args("a")))
        if result is not None and not same_records(world, result.records):
            return Outcome("silent", "the resumed audit's records differ from an uninterrupted one's")
        return outcome
    command = [reader, adir, "--out", world.run / f"out-{reader}"]
    return cli(command)


def play_audit_dir(world: World, spec: dict) -> Outcome:
    adir = world.copy("audit-a")
    for op, target, arg in spec["ops"]:
        damage(world, adir, op, target, arg)
    first = outcome = read_audit(world, adir, spec["reader"])
    seen = []
    # a refusal that says what to do (rerun; remove or move a file it names) must lead out, to the audit read back
    # with its own records; a refusal naming another fix (a new --out) ends here
    while outcome.kind == "refused" and (step := instruction(outcome.detail, adir)) is not None:
        if outcome.detail in seen:
            return Outcome("silent", f"'{first.detail[:150]}' leads back to '{outcome.detail[:150]}'")
        seen.append(outcome.detail)
        if step != "rerun":
            shutil.rmtree(step) if step.is_dir() and not step.is_symlink() else step.unlink()
        rerun = read_audit(world, adir, "resume")
        outcome = read_audit(world, adir, spec["reader"]) if rerun.kind == "ok" else rerun
    return outcome if outcome.failed or not seen else first


# ---- surface 6: models that misbehave -----------------------------------------------------------------------------

# What a generated model does wrong, and what fcaudit must then do: a model whose numbers cannot be trusted (its
# coefficients depend on the other windows of its batch, its state changes between passes, its logits turn NaN only
# under an intervention, the evaluation windows repeat) is refused; an integer or bool gate is refused or audited as
# the same gate emitted in float; logits behind a hidden state are found, or the audit refused; a vocabulary entry
# masked with -inf (finite NLL) is audited. An "ok" where a refusal was due is silent; a refusal of a well-behaved
# model is an over-refusal.
REFUSED_FOR = ("coupled", "state", "nan_under", "duplicates")


@st.composite
def misbehaving_models(draw) -> dict:
    pick = lambda pool: draw(st.sampled_from(pool))  # noqa: E731
    return {"gate": pick(["float", "float", "int", "bool", "float64"]), "coupled": pick([False, False, True]),
            "state": pick([None, None, "flag", "buffer"]), "flip_after": pick([3, 12, 40]),
            "nan_under": pick([False, False, True]), "output": pick(["logits", "logits", "hidden-first", "dict",
                                                                     "neg-inf"]),
            "duplicates": pick([False, False, True]), "batch_size": pick([1, 2, 4]), "seed": pick([0, 1])}


def misbehaving_model(spec: dict):
    """A tiny gated LM that misbehaves as `spec` says, written as a user would write one."""
    import torch
    from torch import nn

    class Gate(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.score = nn.Linear(d, 1)

        def forward(self, h):
            s = self.score(h).squeeze(-1)
            if spec["coupled"]:  # the top half of every score in the batch, windows and tokens together
                on = s >= s.flatten().median()
            else:
                on = torch.sigmoid(s)
            if spec["gate"] in ("int", "bool", "step"):  # 0/1 decisions, as int64, bool or (its twin) float32
                on = on > 0.5 if on.is_floating_point() else on
            return on.to({"int": torch.int64, "bool": torch.bool, "float64": torch.float64}.get(spec["gate"],
                                                                                             torch.float32))

    class LM(nn.Module):
        def __init__(self, d=8, vocab=256, n=2):
            super().__init__()
            torch.manual_seed(spec["seed"])
            self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
            self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                      for _ in range(n))
            self.gates = nn.ModuleList(Gate(d) for _ in range(n))
            self.calls, self.first_max = 0, None
            self.register_buffer("maxabs", torch.zeros(()))

        def forward(self, ids):
            self.calls += 1
            h = self.emb(ids)
            if spec["state"] == "flag" and self.calls > spec["flip_after"]:
                h = h * 1.5
            if spec["state"] == "buffer":  # a fake-quant observer left on in eval
                self.maxabs = torch.maximum(self.maxabs, h.detach().abs().max())
                self.first_max = float(self.maxabs) if self.first_max is None else self.first_max
                scale = self.maxabs / 127
                h = torch.round(h / scale) * scale
            for mlp, gate in zip(self.mlps, self.gates):
                g = gate(h)
                if spec["nan_under"] and not torch.equal(Gate.forward(gate, h), g):  # its own gate recomputed
                    h = h * float("nan")  # beside the site: a replayed value other than its own gives NaN
                h = h + g.to(h.dtype).unsqueeze(-1) * mlp(h)
            logits = self.head(h)
            if spec["output"] == "neg-inf":
                logits = logits.clone()
                logits[..., 0] = float("-inf")
            return {"hidden-first": lambda: (h, logits), "dict": lambda: {"logits": logits}}.get(
                spec["output"], lambda: logits)()

    return LM().eval()


def _audit_model(world: World, spec: dict, out: Path):
    import fcaudit as fca

    model = misbehaving_model(spec)
    ev, ca = world.windows["eval"], world.windows["calib"]
    if spec["duplicates"]:
        ev = ev[[0, 0, 1, 2]]
    ctrl = fca.Controller.from_modules(model, "gates.*", layout="batch token")
    return (*api_outcome(lambda: fca.audit(model, ctrl, ev, ca, randomizations=1, batch_size=spec["batch_size"],
                                           out=out, quiet=True)), model)


def _changed(spec: dict, model) -> bool:
    """Whether the model's state changed between two of the audit's forward passes (a flag flipped within them, an
    observer that grew after its first pass); one that never did was a fixed model all along."""
    if spec["state"] == "flag":
        return model.calls > spec["flip_after"]
    return spec["state"] == "buffer" and model.first_max is not None and float(model.maxabs) != model.first_max


def play_model(world: World, spec: dict) -> Outcome:
    import torch

    from fcaudit.loss import token_nll

    outcome, result, model = _audit_model(world, spec, world.run / "out")
    if outcome.kind == "ok":  # a result must read back
        outcome, penalties = api_outcome(result.penalties)
    # a batch of one window is a batch no other window shares: a coupling over the batch never acts within the audit
    due = [m for m in REFUSED_FOR if (_changed(spec, model) if m == "state" else
                                      spec[m] and spec["batch_size"] > 1 if m == "coupled" else spec[m])]
    if outcome.kind != "ok":
        if outcome.kind == "refused" and not due and spec["gate"] in ("float", "float64") \
                and spec["output"] != "hidden-first":
            return Outcome("silent", f"over-refused a well-behaved model: {outcome.detail}")
        return outcome
    if due:
        return Outcome("silent", f"audited a model that {', '.join(due)}: {penalties}")
    if spec["gate"] in ("int", "bool"):  # audited: it must be the same gate's audit in float
        twin, twin_result, _ = _audit_model(world, {**spec, "gate": "step"}, world.run / "twin")
        if twin.kind == "ok":
            mine, theirs = penalties.statistic, twin_result.penalties().statistic
            if not torch.allclose(torch.as_tensor(mine), torch.as_tensor(theirs), atol=1e-6, equal_nan=True):
                return Outcome("silent", f"a {spec['gate']} gate's penalties {mine} differ from its float twin's {theirs}")
    if spec["output"] == "hidden-first":  # the NLL must be the logits', not the hidden state's
        model = misbehaving_model(spec)
        with torch.inference_mode():  # batch by batch as the audit ran them (a coupled model's logits need it)
            nll = torch.cat([token_nll(model(ids)[1], ids).mean(1).double()
                             for ids in world.windows["eval"].split(spec["batch_size"])])
        correct = result.records.query("condition == 'Correct'").sort_values("example")["nll"].to_numpy()
        if not torch.allclose(torch.as_tensor(correct), nll, atol=1e-6):
            return Outcome("silent", f"scored the hidden state as logits (Correct NLL {correct.mean():.4f}, "
                                     f"the logits' {float(nll.mean()):.4f})")
    return outcome


def instruction(message: str, adir: Path) -> str | Path | None:
    """What a refusal tells the user to do in the audit directory: "rerun", or a path in it to remove or move out
    (then rerun); None for any other fix."""
    if "remove it" in message or "move it out" in message:
        named = [w.strip("',;:()") for w in message.split() if w.strip("',;:()").startswith(str(adir))]
        if named and (Path(named[0]).exists() or Path(named[0]).is_symlink()) and Path(named[0]) != adir:
            return Path(named[0])
    return "rerun" if "rerun the audit" in message else None


# ---- surface 7: Hugging Face checkpoint directories ----------------------------------------------------------------

# Tiny save_pretrained checkpoints, one per class of controller fcaudit finds in a transformers model: a recipe's
# module site (Mamba's x_proj), a recipe's op sites (Bamba's Mamba-2 scan), MoE routers beside op sites (a hybrid),
# none at all (Llama: refused), and the recurrent gates (RWKV's receptance, RG-LRU's gates).
HF_SMALL = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, pad_token_id=None, bos_token_id=None,
                eos_token_id=None)
_HF_ATTENTION = dict(num_attention_heads=2, num_key_value_heads=2, intermediate_size=64)
_HF_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=8)
HF_CHECKPOINTS = {
    "mamba": ("mamba", dict(state_size=8, time_step_rank=4)),
    "bamba": ("bamba", dict(**_HF_ATTENTION, **_HF_MAMBA2, attn_layer_indices=[1])),
    "hybrid": ("granitemoehybrid", dict(**_HF_ATTENTION, **_HF_MAMBA2, num_local_experts=4, num_experts_per_tok=2,
                                        shared_intermediate_size=32, layer_types=["mamba", "attention"])),
    "llama": ("llama", _HF_ATTENTION),
    "rwkv": ("rwkv", dict(attention_hidden_size=32, intermediate_size=64, context_length=64)),
    "rglru": ("recurrent_gemma", dict(num_attention_heads=2, num_key_value_heads=1, intermediate_size=64, lru_width=32,
                                      attention_window_size=16, block_types=["recurrent", "attention"])),
}
_HF_COMMON = ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "dtype", "tie_word_embeddings",
              "transformers_version", "use_cache", "pad_token_id", "bos_token_id")
HF_KEYS = {
    "mamba": ("state_size", "time_step_rank", "conv_kernel", "expand", "use_conv_bias", "layer_norm_epsilon",
              "residual_in_fp32", "use_mambapy", "time_step_min"),
    "bamba": ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_chunk_size", "mamba_n_groups", "mamba_expand",
              "mamba_d_conv", "attn_layer_indices", "num_attention_heads", "num_key_value_heads",
              "max_position_embeddings", "rope_parameters", "time_step_limit"),
    "hybrid": ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_chunk_size", "layer_types",
               "num_local_experts", "num_experts_per_tok", "shared_intermediate_size", "num_attention_heads",
               "num_key_value_heads", "rope_parameters", "embedding_multiplier"),
    "llama": ("num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_parameters",
              "rms_norm_eps", "attention_bias"),
    "rwkv": ("attention_hidden_size", "context_length", "rescale_every", "layer_norm_epsilon"),
    "rglru": ("lru_width", "attention_window_size", "block_types", "conv1d_width", "num_attention_heads",
              "num_key_value_heads", "head_dim", "logits_soft_cap", "rope_parameters"),
}
# the sizes (layer counts, state sizes, heads) and switches (biases, tied embeddings) that shape each one's weights
HF_SIZES = {
    "mamba": ("num_hidden_layers", "state_size", "time_step_rank", "conv_kernel", "expand"),
    "bamba": ("num_hidden_layers", "mamba_n_heads", "mamba_d_state", "mamba_d_head", "mamba_n_groups",
              "mamba_chunk_size", "num_key_value_heads"),
    "hybrid": ("num_hidden_layers", "mamba_n_heads", "mamba_d_state", "num_local_experts", "num_experts_per_tok",
               "shared_intermediate_size"),
    "llama": ("num_hidden_layers", "num_key_value_heads", "head_dim", "intermediate_size"),
    "rwkv": ("num_hidden_layers", "attention_hidden_size", "context_length"),
    "rglru": ("num_hidden_layers", "lru_width", "attention_window_size", "conv1d_width", "head_dim"),
}
HF_SWITCHES = {
    "mamba": ("use_conv_bias", "use_bias", "tie_word_embeddings"),
    "bamba": ("mamba_conv_bias", "mamba_proj_bias", "attention_bias", "mlp_bias", "tie_word_embeddings"),
    "hybrid": ("mamba_conv_bias", "mamba_proj_bias", "attention_bias", "tie_word_embeddings"),
    "llama": ("attention_bias", "mlp_bias", "tie_word_embeddings"),
    "rwkv": ("tie_word_embeddings",),
    "rglru": ("attention_bias", "tie_word_embeddings"),
}
# model types transformers knows (causal LMs, and classes AutoModelForCausalLM has no head for) and ones it does not
HF_MODEL_TYPES = ("llama", "mamba", "mamba2", "bamba", "rwkv", "recurrent_gemma", "mixtral", "gpt2", "falcon_mamba",
                  "jamba", "zamba", "bert", "t5", "whisper", "clip", "vit", "qwen3_next", "featuregate", "mod",
                  "nosuchmodel", "", "MAMBA", "llama ")
HF_LISTS = st.sampled_from([[], ["attention"], ["attention"] * 3, ["mamba", "mamba"], ["mamba"] * 5,
                            ["recurrent"] * 3, ["full_attention", "linear_attention"], [0], [5], [1, 1], [-1],
                            ["x", "y"], "attention", [None, None]])
HF_VALUES = st.one_of(JSON_VALUES, st.sampled_from([1, 3, 5, 8, 12, 32, 33, 48, 10**5, 2**20]), HF_LISTS)
HF_CONFIG = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(_HF_COMMON), HF_VALUES),
    st.tuples(st.just("model_type"), st.just("model_type"), st.sampled_from(HF_MODEL_TYPES)),
    st.tuples(st.just("set"), st.just("architectures"),
              st.sampled_from([["LlamaForCausalLM"], ["BertForMaskedLM"], ["MambaModel"], ["NoSuchForCausalLM"], [],
                               "MambaForCausalLM", [3], None])),
    st.tuples(st.just("set"), st.sampled_from(["auto_map", "trust_remote_code"]),
              st.sampled_from([{"AutoModelForCausalLM": "modeling_x.XForCausalLM"},
                               {"AutoConfig": "configuration_x.XConfig",
                                "AutoModelForCausalLM": "other/repo--modeling_x.XForCausalLM"},
                               {"AutoModelForCausalLM": ["modeling_x.XForCausalLM", None]}, "modeling_x.X", [], True,
                               3])))
HF_WEIGHT_OPS = st.one_of(
    st.tuples(st.sampled_from(["remove", "rename"]), st.integers(0, 40), st.none()),
    st.tuples(st.just("shape"), st.integers(0, 40), st.sampled_from(["row-", "row+", "transpose", "flat", "scalar",
                                                                       "empty"])),
    st.tuples(st.just("dtype"), st.integers(0, 40), st.sampled_from(["float16", "bfloat16", "float64", "int64",
                                                                       "int8", "bool", "uint8"])),
    st.tuples(st.just("all-dtype"), st.just(0), st.sampled_from(["float16", "bfloat16", "float64"])))
HF_COMMANDS = ("audit", "dry-run", "dry-run", "execution", "api", "api")
# a Mamba-2 scan's chunk (the torch scan pads a window to it, holding [head, chunk, chunk] tensors): within the
# window, beyond it (a pass costs a chunk's time), and so large that one window's pass would take gigabytes
HF_CHUNKS = st.sampled_from([4, 16, 256, 4096, 16384, 65536])


@st.composite
def hf_checkpoints(draw) -> dict:
    name = draw(st.sampled_from(tuple(HF_CHECKPOINTS)))
    own = st.tuples(st.just("set"), st.sampled_from(HF_KEYS[name]), HF_VALUES)
    delete = st.tuples(st.just("set"), st.sampled_from(_HF_COMMON + HF_KEYS[name] + ("model_type",)),
                       st.just(DELETE))
    size = st.tuples(st.just("set"), st.sampled_from(HF_SIZES[name]), st.sampled_from([0, 1, 3, 4, 6, -1, 2**40]))
    switch = st.tuples(st.just("set"), st.sampled_from(HF_SWITCHES[name]), st.booleans())
    mutations = [own, size, switch, delete, HF_CONFIG]
    if "mamba_chunk_size" in HF_KEYS[name]:
        mutations.append(st.tuples(st.just("set"), st.just("mamba_chunk_size"), HF_CHUNKS))
    config = draw(st.lists(st.one_of(mutations), max_size=3))
    weights = draw(st.lists(HF_WEIGHT_OPS, max_size=2))
    if not config and not weights:  # the checkpoint as saved: a run of it is a valid (and longer) audit
        weights = [draw(HF_WEIGHT_OPS)] if draw(st.booleans()) else []
    return {"ckpt": name, "config": [list(c) for c in config], "weights": [list(w) for w in weights],
            "command": draw(st.sampled_from(HF_COMMANDS))}


def _reshaped(t, how: str):
    """`t` with a shape its weight does not have: a row less or more, transposed, flattened, a scalar, empty."""
    import torch

    flat = t.flatten()
    if how == "row-":
        return t[:-1] if t.dim() else t.reshape(1)
    if how == "row+":
        return torch.cat([t, t[:1]]) if t.dim() else flat.repeat(2)
    scalar = flat[0].clone() if flat.numel() else torch.zeros((), dtype=t.dtype)  # of an emptied one too
    return {"transpose": lambda: t.T.contiguous(), "flat": lambda: flat, "scalar": lambda: scalar,
            "empty": lambda: flat[:0]}[how]()


def _hf_weights(ckpt: Path, ops: list) -> None:
    """`ops` applied to model.safetensors, rewritten as a valid file (its tensors' names, shapes or dtypes changed)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = ckpt / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for op, i, arg in ops:
        names = sorted(tensors)
        name = names[i % len(names)]
        t = tensors[name]
        if op == "remove":
            del tensors[name]
        elif op == "rename":
            tensors[name + "_renamed"] = tensors.pop(name)
        elif op == "shape":
            tensors[name] = _reshaped(t, arg)
        elif op == "dtype":
            tensors[name] = t.to(getattr(torch, arg))
        else:
            tensors = {k: v.to(getattr(torch, arg)) for k, v in tensors.items()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)


def _hf_command(world: World, ckpt: Path, command: str) -> tuple[Outcome, list[str]]:
    """The command's outcome and the lines transformers logged at WARNING or above while it ran (in the API: while
    the call it ended at ran; a call that returned has said what it said)."""
    if command != "api":
        with _logged("transformers") as said:  # its loggers write to the terminal, past the harness's capture
            return load_action(world, ckpt, command), said
    import fcaudit as fca

    with _logged("transformers") as said:
        outcome, model = api_outcome(lambda: fca.load(ckpt, device="cpu"))
    if model is None:
        return outcome, said
    with _logged("transformers") as said:
        outcome, result = api_outcome(lambda: fca.audit(model, fca.controller_for(model), world.windows["eval"],
                                                        world.windows["calib"], randomizations=1, batch_size=2,
                                                        out=world.run / "a", quiet=True))
        if result is not None:
            outcome = api_outcome(result.penalties)[0]
    return outcome, said


def _unread(ckpt: Path) -> list[str]:
    """The stored tensors that the model fcaudit loads does not hold as stored: left unread (transformers'
    "unexpected" keys, less those its model class declares ignorable), or read as other values (a tied copy)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import fcaudit as fca

    _, info = AutoModelForCausalLM.from_pretrained(ckpt, output_loading_info=True, trust_remote_code=False)
    held = fca.load(ckpt, device="cpu").state_dict()
    stored = load_file(str(ckpt / "model.safetensors"))
    other = [k for k, v in stored.items() if k in held and not torch.equal(v.to(held[k].dtype), held[k])]
    return sorted(info.get("unexpected_keys") or []) + other


@contextlib.contextmanager
def _logged(name: str):
    """The lines logger `name` and its children say at WARNING or above, as a user's terminal shows them."""
    import logging

    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    handler, logger = Keep(logging.WARNING), logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield said
    finally:
        logger.removeHandler(handler)


def play_hf(world: World, spec: dict) -> Outcome:
    """A changed copy of one tiny checkpoint given to a command. Beyond the common judges: a refusal printed after
    transformers' logged warnings is noisy, and an audit of a Llama, or of a model that does not hold every stored
    tensor as stored (a layer or a bias its config.json leaves out), is silent."""
    ckpt = world.copy(f"hf-{spec['ckpt']}")
    config = json.loads((ckpt / "config.json").read_text())
    for _, key, value in spec["config"]:
        if value == DELETE:
            config.pop(key, None)
        else:
            config[key] = value
    (ckpt / "config.json").write_text(json.dumps(config))
    if spec["weights"]:
        _hf_weights(ckpt, spec["weights"])
    outcome, said = _hf_command(world, ckpt, spec["command"])
    if outcome.kind == "refused" and said:
        return Outcome("noisy", f"{said[0][:150]} | before: {outcome.detail[:150]}")
    if outcome.kind != "ok":
        return outcome
    if spec["ckpt"] == "llama" and config.get("model_type") == "llama":
        return Outcome("silent", "audited a Llama, which has no controller")
    _, unread = api_outcome(lambda: _unread(ckpt))
    if unread:
        return Outcome("silent", f"{len(unread)} stored tensors are not in the audited model as stored (e.g. "
                                 f"{unread[0]})")
    return outcome


PLAYERS: dict[str, Callable[[World, dict], Outcome]] = {
    "config": play_config, "weights": play_weights, "cli": play_cli, "api": play_api, "audit-dir": play_audit_dir,
    "model": play_model, "hf": play_hf}
STRATEGIES: dict[str, Callable[[], st.SearchStrategy]] = {
    "config": checkpoint_configs, "weights": weights_files, "cli": cli_options, "api": api_calls,
    "audit-dir": damaged_audits, "model": misbehaving_models, "hf": hf_checkpoints}


# ---- the long run: forked children, limits, counts -----------------------------------------------------------------

def rss(pid: int) -> int:
    """The resident memory of process `pid` in bytes (Linux's /proc), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


def forked(world: World, surface: str, spec: dict, timeout: float = HANG_S, rss_limit: int = RSS_LIMIT) -> Outcome:
    """`play` in a forked child, killed past `timeout` seconds (a hang) or `rss_limit` bytes resident (rss)."""
    result = world.root / "result.pkl"
    result.unlink(missing_ok=True)
    pid = os.fork()
    if pid == 0:  # the child: play, leave the outcome in a file, and exit without running the parent's atexit
        code = 0
        try:
            outcome = play(world, surface, spec)
            result.write_bytes(pickle.dumps(outcome))
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    start, peak = time.monotonic(), 0
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            peak = max(peak, usage.ru_maxrss * 1024)
            break
        peak = max(peak, rss(pid))
        over = peak > rss_limit
        if over or time.monotonic() - start > timeout:
            os.kill(pid, signal.SIGKILL)
            os.wait4(pid, 0)
            world.fresh()
            return Outcome("rss" if over else "hang", f"{peak / 2**30:.2f} GiB, {time.monotonic() - start:.0f} s")
        time.sleep(0.02)
    if peak > rss_limit:
        return Outcome("rss", f"{peak / 2**30:.2f} GiB")
    if not result.is_file():
        return Outcome("traceback", f"the child died (status {status})")
    return pickle.loads(result.read_bytes())


def worker(surface: str, n: int, seed: int, root: Path, log: Path, hang_s: float = HANG_S) -> dict:
    """Run `n` inputs of `surface` (hypothesis draws them, seeded), each in a forked child; counts and findings."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    import torch

    torch.set_num_threads(1)
    world = World(root)
    world.build()
    counts = dict.fromkeys(("inputs", "ok", "refused", *FAILURES), 0)

    @hypothesis_seed(seed)
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate], suppress_health_check=list(
        HealthCheck))
    @given(STRATEGIES[surface]())
    def one(spec):
        outcome = forked(world, surface, spec, timeout=hang_s)
        counts["inputs"] += 1
        counts[outcome.kind] += 1
        if outcome.failed:
            with open(log, "a") as f:
                f.write(json.dumps({"surface": surface, "kind": outcome.kind, "detail": outcome.detail,
                                    "spec": spec}, default=repr) + "\n")

    one()
    return counts


def campaign(inputs: int, workers: int, out: Path, surfaces: tuple[str, ...], chunk: int, seed: int,
             hang_s: float = HANG_S) -> int:
    """Split `inputs` over the surfaces and into worker jobs of `chunk` inputs, `workers` at a time; print the table."""
    out.mkdir(parents=True, exist_ok=True)
    per = inputs // len(surfaces)
    jobs = [(s, min(chunk, per - k), seed + k) for s in surfaces for k in range(0, per, chunk)]
    # transformers loads weights on worker threads unless told not to: in a forked child their torch ops may meet the
    # parent's thread pool ("Invalid thread pool!"), a harness artifact no user's process has
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", PYTHONWARNINGS="default", HF_DEACTIVATE_ASYNC_LOAD="1")
    running: list[tuple[subprocess.Popen, Path]] = []
    results: list[dict] = []
    t0 = time.monotonic()
    while jobs or running:
        while jobs and len(running) < workers:
            surface, n, s = jobs.pop(0)
            root = out / f"w-{surface}-{s}"
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            env_job = dict(env, HF_HOME=str(root / "hf"), MPLCONFIGDIR=str(root / "mpl"),
                           XDG_CACHE_HOME=str(root / "cache"))
            cmd = [sys.executable, __file__, "--worker", surface, "--inputs", str(n), "--seed", str(s),
                   "--out", str(root), "--hang-s", str(hang_s)]
            with open(root / "worker.log", "w") as log:  # what children print outside their captured output
                running.append((subprocess.Popen(cmd, env=env_job, stdout=log, stderr=subprocess.STDOUT), root))
        for proc, root in list(running):
            if proc.poll() is None:
                continue
            running.remove((proc, root))
            if proc.returncode != 0 or not (root / "counts.json").is_file():
                tail = (root / "worker.log").read_text()[-2000:]
                print(f"worker {root.name} failed ({proc.returncode}): {tail}", file=sys.stderr)
                return 2
            results.append({"surface": root.name.split("-", 1)[1].rsplit("-", 1)[0],
                            **json.loads((root / "counts.json").read_text())})
            with open(out / "found.jsonl", "a") as f:
                f.write((root / "found.jsonl").read_text() if (root / "found.jsonl").is_file() else "")
            shutil.rmtree(root / "run", ignore_errors=True)
            print(f"{root.name}: {results[-1]} ({time.monotonic() - t0:.0f} s)", flush=True)
        time.sleep(0.5)
    columns = ("inputs", "ok", "refused", *FAILURES)
    total = dict.fromkeys(columns, 0)
    print(f"\n{'surface':<10} " + " ".join(f"{c:>13}" for c in columns))
    for surface in surfaces:
        row = {c: sum(r[c] for r in results if r["surface"] == surface) for c in columns}
        total = {c: total[c] + row[c] for c in columns}
        print(f"{surface:<10} " + " ".join(f"{row[c]:>13}" for c in columns))
    print(f"{'all':<10} " + " ".join(f"{total[c]:>13}" for c in columns))
    print(f"wall time {time.monotonic() - t0:.0f} s; findings: {out / 'found.jsonl'}")
    (out / "counts.json").write_text(json.dumps({"total": total, "runs": results}, indent=1))
    return 1 if any(total[c] for c in FAILURES) else 0


def main() -> int:
    p = argparse.ArgumentParser(description="fcaudit's fuzzing campaign (tests/fuzzing.py)")
    p.add_argument("--inputs", type=int, default=10_000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("fuzz-out"))
    p.add_argument("--surfaces", default=",".join(SURFACES))
    p.add_argument("--chunk", type=int, default=500, help="inputs per worker process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hang-s", type=float, default=HANG_S, help="seconds after which an input counts as a hang")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.out = args.out.absolute()  # inputs run from other working directories (a decoy cwd) must find it
    if args.worker:
        counts = worker(args.worker, args.inputs, args.seed, args.out, args.out / "found.jsonl", args.hang_s)
        (args.out / "counts.json").write_text(json.dumps(counts))
        return 0
    return campaign(args.inputs, args.workers, args.out, tuple(args.surfaces.split(",")), args.chunk, args.seed,
                    args.hang_s)


if __name__ == "__main__":
    sys.path.insert(0, str(TESTS.parent / "src"))
    sys.exit(main())
