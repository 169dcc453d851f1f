"""An audit directory: its layout, the marker that makes it fcaudit's own, the lock, and its configuration. It holds
.fcaudit-audit (the marker, written first: fcaudit.io's rule), .lock (the writer's fcntl lock), config.json, coeffs/
(the coefficient store), calib/ (calibration sums, reduced into profiles.safetensors), parts/COND/rNNNN/ (replay units
as each process wrote them, merged into records/COND/rNNNN.parquet), replay.json, variation.json and, where the audit
measured its execution (`execution=True`), execution.json.

Every file the engine writes is bound to its audit: it names the config hash it was written for (records and part
files also their condition and randomization), and the one check of each (`read_records`, `read_part`,
`read_bound`, `read_replay`, `read_variation`, `read_execution`: the engine's before it reuses one, the reader's)
refuses another audit's. Which records belong to an audit is its config's conditions x randomizations
(`record_keys`); any other records or part file is a stray (`strays`), which is neither read nor deleted."""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from fcaudit import protocol
from fcaudit.auditor import files
from fcaudit.controllers.findings import Finding
from fcaudit.errors import FcauditError
from fcaudit.io import OutDir, json_sha256, remove_stale_temps, valid_path
from fcaudit.provenance import provenance

MARKER = ".fcaudit-audit"
FORMAT = 2


# What describes an audit's inputs without being them: the path or hub id (and revision) a checkpoint was read from
# (a moved or copied checkpoint, "./ckpt" or "ckpt/", is the same one: params_sha256 says which it is), the corpus
# path (the windows' sha256 says what was read) and the family label it is summarized under.
DESCRIPTIVE = ("checkpoint", "family", "corpus", "revision")


def identity(config: dict) -> dict:
    """What must match for an audit to resume: the configuration without the model's DESCRIPTIVE fields, nor the time
    the criteria were fixed at (config.json as written holds it)."""
    out = dict(config)
    if isinstance(config.get("model"), dict):
        out["model"] = {k: v for k, v in config["model"].items() if k not in DESCRIPTIVE}
    if isinstance(config.get("criteria"), dict):
        out["criteria"] = {k: v for k, v in config["criteria"].items() if k != "fixed_at"}
    return out


def config_hash(config: dict) -> str:
    return json_sha256(identity(config))


def record_keys(config: dict) -> list[tuple[str, int]]:
    """The (condition, randomization) pairs whose records an audit of `config` (config.json's content) holds: its
    conditions, each randomized one `randomizations` times."""
    return [(c, r) for c in config["conditions"]
            for r in range(config["randomizations"] if protocol.REGISTRY[c].randomized else 1)]


# config.json's fields the readers use, with their types: a config.json of other types (another program's) is damaged
_CONFIG_TYPES = {"seed": int, "randomizations": int, "batch_size": int, "windows": dict, "model": dict,
                 "conditions": list, "config_hash": str, "labels": dict, "criteria": dict, "controller": dict}


def _check_config(path: Path, config: dict) -> dict:
    """`config` when its fields have the types and ranges fcaudit writes, else Damaged naming the first that has not."""
    wrong = [k for k, t in _CONFIG_TYPES.items() if not isinstance(config.get(k), t) or isinstance(config[k], bool)]
    if not wrong:
        n, model = config["windows"].get("n_eval"), config["model"]
        named = isinstance(model.get("family"), str) or (isinstance(model.get("class"), str)
                                                         and isinstance(model.get("n_params"), int))
        static = config["controller"].get("static")
        wrong = [k for k, bad in (("windows.n_eval", not isinstance(n, int) or n < 2),
                                  ("model", not named),  # what summaries name its family by
                                  ("randomizations", config["randomizations"] < 1),
                                  ("batch_size", config["batch_size"] < 1),
                                  ("controller.static", not isinstance(static, str) or static not in protocol.REGISTRY))
                 if bad]
        wrong += [f"condition {c!r}" for c in config["conditions"] if not isinstance(c, str)]
        if not wrong and (unknown := [c for c in config["conditions"] if c not in protocol.REGISTRY]):
            raise FcauditError(f"{path} holds records of condition {unknown[0]!r}, which is not registered here: "
                               "register it (fcaudit.protocol.register) before reading this audit")
    if wrong:
        raise files.Damaged(path, f"its {wrong[0]} is not what fcaudit writes")
    return config


def differences(old: dict, new: dict) -> list[str]:
    """The fields in which the identities differ: top-level keys of `new`, and model.KEY for the model's own."""
    old, new = identity(old), identity(new)
    out = []
    for k in sorted(new):
        if old.get(k) == new[k]:
            continue
        if k == "model" and isinstance(old.get(k), dict) and isinstance(new[k], dict):
            out += [f"model.{m}" for m in sorted(set(old[k]) | set(new[k])) if old[k].get(m) != new[k].get(m)]
        else:
            out.append(k)
    return out


class AuditDir:
    def __init__(self, root: str | os.PathLike):
        self.root = valid_path(root, "the audit directory")
        self.out = OutDir(self.root, "audit")  # checks, locks, and writes its JSON files (hashed)
        self._hash: str | None = None  # `binding`'s, read from config.json once
        self.config_path = self.root / "config.json"
        self.coeffs = self.root / "coeffs"
        self.profiles = self.root / "profiles.safetensors"
        self.replay = self.root / "replay.json"
        self.variation = self.root / "variation.json"
        self.execution = self.root / "execution.json"

    def calib_part(self, start: int) -> Path:
        return self.root / "calib" / f"sum_{start:07d}.safetensors"

    def parts(self, condition: str, r: int) -> Path:
        return self.root / "parts" / condition / f"r{r:04d}"

    def part(self, condition: str, r: int, start: int) -> Path:
        """Records of (condition, r) for windows from `start` (one or more consecutive batches of one process)."""
        return self.parts(condition, r) / f"b{start:07d}.safetensors"

    def records(self, condition: str, r: int) -> Path:
        return self.root / "records" / condition / f"r{r:04d}.parquet"

    def write_json(self, path: str | os.PathLike, obj: dict) -> Path:
        """A JSON file of the audit, with the hash its readers check (`files.read_json`)."""
        return self.out.write_json(path, obj, hashed=True)

    # ---- records bound to their audit ------------------------------------------------------------------------------
    def bound(self, meta: dict | None = None) -> dict:
        """`meta` with this audit's config hash: what every file the engine writes carries to name its audit."""
        if self._hash is None:
            self._hash = self.config()["config_hash"]
        return {**(meta or {}), "audit": self._hash}

    def binding(self, condition: str, r: int) -> dict:
        """What a records or part file of (condition, r) carries: its audit and its run."""
        return self.bound({"condition": condition, "randomization": r})

    def _check_audit(self, path: Path, meta) -> dict:
        meta = meta if isinstance(meta, dict) else {}
        ours = self.bound()["audit"]
        if meta.get("audit") is None:
            raise files.Damaged(path, "it names no audit (written by an earlier fcaudit, or by another program)")
        if meta["audit"] != ours:
            raise files.Damaged(path, f"it belongs to another audit (config hash {str(meta['audit'])[:12]}, this "
                                      f"audit's {ours[:12]})")
        return meta

    def read_bound(self, path: Path) -> tuple[dict, dict]:
        """(tensors, meta) of a store chunk, calibration sum or profiles file, checked: its hash and its audit."""
        tensors, meta = files.read_tensors(path)
        return tensors, self._check_audit(path, meta)

    def _check_binding(self, path: Path, meta: dict | None, condition: str, r: int) -> None:
        meta = self._check_audit(path, meta)
        if (meta.get("condition"), meta.get("randomization")) != (condition, r):
            raise files.Damaged(path, f"it holds the records of {meta.get('condition')} r{meta.get('randomization')}, "
                                      f"not of {condition} r{r}")

    def read_records(self, condition: str, r: int, n: int) -> pd.DataFrame:
        """The records file of (condition, r), checked: its hash, its audit, one row per evaluation window of `n`."""
        path = self.records(condition, r)
        frame, meta = files.read_table(path)
        self._check_binding(path, meta, condition, r)
        if missing := [c for c in protocol.RECORD_COLUMNS if c not in frame.columns]:
            raise files.Damaged(path, f"it lacks the records columns {missing}")
        if len(frame) != n or not np.array_equal(frame["example"].to_numpy(), np.arange(n)):
            raise files.Damaged(path, "it does not hold one row per evaluation window")
        return frame

    def read_part(self, path: Path, condition: str, r: int, n: int, batch: int, seen: set[int]) -> dict:
        """A part file of (condition, r), checked: its hash and audit, whole batches of `batch` among `n` windows
        that no part read before it (`seen`, which it adds to) holds, named by its first window."""
        tensors, meta = files.read_tensors(path)
        self._check_binding(path, meta, condition, r)
        example = tensors.get("example")
        if example is None or example.dim() != 1 or example.dtype != torch.int64 or not len(example):
            raise files.Damaged(path, "it names no windows")
        ex = example.numpy()
        starts = np.unique(ex - ex % batch)  # its batches: whole when their sizes add up to its windows (no repeat)
        whole = int((np.minimum(starts + batch, n) - starts).sum()) == len(ex) == len(np.unique(ex))
        if (not whole or ex.min() < 0 or ex.max() >= n or not seen.isdisjoint(ex.tolist())
                or path.name != f"b{ex.min():07d}.safetensors"
                or any(tensors.get(k) is None or len(tensors[k]) != len(ex) for k in ("nll", "active"))):
            raise files.Damaged(path, "its windows are not whole batches of this audit that no other part holds")
        seen.update(ex.tolist())
        return tensors

    def check_strays(self, config: dict) -> None:
        """Refuse, by name, a records or part file that is not this audit's: the reader never reads it and a resume
        never deletes what fcaudit may not have written, so it is the user's to move out."""
        if stray := self.strays(config):
            raise FcauditError(f"{stray[0]} is not one of this audit's records files (its conditions x "
                               f"{config['randomizations']} randomizations{'; and others' if len(stray) > 1 else ''}): "
                               f"move it out of {self.root}")

    def strays(self, config: dict) -> list[Path]:
        """Records and part files that are not this audit's: another condition or randomization, another name."""
        keys = record_keys(config)
        ours = {self.records(c, r) for c, r in keys}
        dirs = {self.parts(c, r) for c, r in keys}
        found = [p for p in (self.root / "records").rglob("*.parquet") if p not in ours]
        found += [p for p in (self.root / "parts").rglob("*.safetensors")
                  if p.parent not in dirs or not (p.name.startswith("b") and p.name[1:8].isdigit())]
        return sorted(p for p in found if not p.name.startswith("."))  # a killed write's temp files are ours

    def is_ours(self) -> bool:
        return (self.root / MARKER).is_file()

    def check(self, checkpoint: str | os.PathLike | None = None) -> None:
        """Before any work: the directory can become this audit's (new, empty, or an fcaudit audit directory, and
        not the audited `checkpoint` nor inside it): fcaudit.io's rule for every output directory."""
        self.out.check(avoid=() if checkpoint is None else (checkpoint,))

    # ---- lock ------------------------------------------------------------------------------------------------------
    def lock(self) -> None:
        """Take the exclusive lock, or fail at once: two processes must never write one audit directory."""
        self.out.lock()

    def unlock(self) -> None:
        self.out.unlock()

    # ---- configuration -------------------------------------------------------------------------------------------
    def open(self, config: dict) -> str:
        """Claim the (locked) directory for `config`: a new audit, a resume of the same configuration, or a refusal.

        Returns "new", "resume", "repaired" (config.json was damaged and is rewritten from the same configuration,
        whose hash the marker keeps) or "remarked" (a resume whose damaged marker is rewritten from config.json). An
        earlier fcaudit's audit is never migrated: it is started anew, and the engine recomputes each of its files
        (bound to another configuration hash, or to none). Removes the temp files of a killed write (the directory is
        ours by the marker).
        """
        digest = config_hash(config)
        if not self.is_ours():  # lock() checked: a new or empty directory
            self.write_json(self.root / MARKER, {"format": FORMAT, "config_hash": None})
        remove_stale_temps(self.root, recursive=True)
        marker = files.quietly(files.read_json, self.root / MARKER, require_hash=True) or {}
        held = marker.get("config_hash")
        current = files.quietly(self._config) or {}
        remarked = False
        if self.earlier(marker) is not None:
            held, current = None, {}
        elif remarked := bool(current.get("config_hash")) and held != current["config_hash"]:
            # the marker repeats an intact config.json's hash: where it does not, the marker is damaged
            held = current["config_hash"]
            self.write_json(self.root / MARKER, marker := {"format": FORMAT, "config_hash": held})
        if held not in (None, digest):
            changed = (differences(current, config) if current.get("config_hash") == held
                       else ["(config.json unreadable)"])
            if not changed:  # the same configuration under an earlier fcaudit's hash: started anew
                held, current = None, {}
            elif self.has_results():
                raise FcauditError(f"{self.root} holds an audit with a different configuration (differs in {changed}); "
                                   "pass a new --out directory or delete the old one")
        if held == digest and current.get("config_hash") == digest:
            if any(current.get("model", {}).get(k) != config["model"].get(k) for k in DESCRIPTIVE):
                # the same checkpoint read from elsewhere (or relabelled): config.json says where it was read now
                self.write_json(self.config_path, {**current, "model": {**current["model"], **{
                    k: config["model"][k] for k in DESCRIPTIVE if k in config["model"]}}})
            return "remarked" if remarked else "resume"
        state = "repaired" if held == digest and self.has_results() else "new"
        if state == "new":
            self.out.remove_file(self.replay)  # a failed replay report of a configuration with no results
            self.out.remove_file(self.execution)  # measured on another configuration's model
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.write_json(self.config_path, {**config, "config_hash": digest, "created_at": now,
                                             "criteria": {**config["criteria"], "fixed_at": now},
                                             "provenance": provenance()})
        self.write_json(self.root / MARKER, {"format": FORMAT, "config_hash": digest})
        self._hash = None
        return state

    def read_replay(self) -> dict:
        """replay.json, checked: its hash, and the types its readers use."""
        replay = self._check_audit(self.replay, files.read_json(self.replay, ("passed",), require_hash=True))
        numbers = all(isinstance(replay.get(k), (int, float, type(None))) for k in ("max_abs_dlogit", "delta_nll"))
        if replay["passed"] is True and "findings" not in replay:
            raise files.Damaged(self.replay, "it lacks the pre-write checks' findings (an earlier fcaudit's)")
        found = replay.get("findings", [])  # a failure report has none
        try:
            findings = isinstance(found, list) and all(Finding.from_json(f) for f in found)
        except ValueError:
            findings = False
        if not isinstance(replay["passed"], bool) or not numbers or not findings:
            raise files.Damaged(self.replay, "its fields are not what fcaudit writes")
        return replay

    def read_variation(self) -> dict:
        """variation.json, checked: its hash, and the types its readers use."""
        var = self._check_audit(self.variation, files.read_json(self.variation, ("layers", "decomposition"),
                                                                 require_hash=True))
        decomposition, layers = var["decomposition"], var["layers"]
        if not (isinstance(decomposition, dict) and all(isinstance(v, (int, float, type(None)))
                                                        for v in decomposition.values())
                and isinstance(layers, list) and all(isinstance(layer, dict) for layer in layers)):
            raise files.Damaged(self.variation, "its fields are not what fcaudit writes")
        return var

    def read_execution(self) -> dict:
        """execution.json, checked: its hash, and either what was measured (decided, executed, variants) or the
        one line saying why it could not be."""
        ex = self._check_audit(self.execution, files.read_json(self.execution, require_hash=True))
        measured = (all(isinstance(ex.get(k), (int, float)) for k in ("decided", "executed"))
                    and isinstance(ex.get("variants"), dict) and isinstance(ex.get("blocks"), list))
        if not (measured or isinstance(ex.get("reason"), str)):
            raise files.Damaged(self.execution, "its fields are not what fcaudit writes")
        return ex

    def has_results(self) -> bool:
        return any(p.suffix in (".parquet", ".safetensors") and not p.name.startswith(".")
                   for d in ("coeffs", "calib", "parts", "records") for p in (self.root / d).rglob("*"))

    def earlier(self, marker: dict | None = None) -> str | None:
        """Why the directory holds an audit of another fcaudit's format (its marker or config.json lacks "format" or
        has another), None when it does not; an unreadable one is damaged, which its own check says."""
        marker = files.quietly(files.read_json, self.root / MARKER) if marker is None else marker
        written = files.quietly(files.read_json, self.config_path) or {}
        other = [d.get("format") for d in (marker, written) if d and d.get("format") != FORMAT]
        if not other:
            return None
        return f"{'no format' if other[0] is None else f'format {other[0]}'}, this fcaudit's is {FORMAT}"

    def _config(self) -> dict:
        return _check_config(self.config_path, files.read_json(self.config_path, keys=tuple(_CONFIG_TYPES)))

    def config(self) -> dict:
        """config.json, checked: its hash, the types its readers use, and its format (an earlier fcaudit's audit is
        refused in one line: the rerun the line names starts it anew, `open`)."""
        if (why := self.earlier()) is not None:
            raise FcauditError(f"{self.root} holds an audit written by another version of fcaudit ({why}); rerun the "
                               f"audit command with --out {self.root} to recompute it")
        return self._config()
