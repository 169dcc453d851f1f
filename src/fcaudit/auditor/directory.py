"""An audit directory: its layout, the marker that makes it fcaudit's own, the lock, and its configuration. It holds
.fcaudit-audit (the marker, written first: fcaudit.io's rule), .lock (the writer's fcntl lock), config.json, coeffs/
(the coefficient store), calib/ (calibration sums, reduced into profiles.safetensors), parts/COND/rNNNN/ (replay units
as each process wrote them, merged into records/COND/rNNNN.parquet), replay.json and variation.json."""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path

from fcaudit.auditor import files
from fcaudit.errors import FcauditError
from fcaudit.io import confine, lock_dir, prepare_out, remove_file, remove_stale_temps
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
    return files.json_sha256(identity(config))


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
        self.root = Path(root)
        self._lock_fd: int | None = None
        confine(self.root, "audit")  # every rank's writes and removals below it never go through a link
        self.config_path = self.root / "config.json"
        self.coeffs = self.root / "coeffs"
        self.profiles = self.root / "profiles.safetensors"
        self.replay = self.root / "replay.json"
        self.variation = self.root / "variation.json"

    def calib_part(self, start: int) -> Path:
        return self.root / "calib" / f"sum_{start:07d}.safetensors"

    def parts(self, condition: str, r: int) -> Path:
        return self.root / "parts" / condition / f"r{r:04d}"

    def part(self, condition: str, r: int, start: int) -> Path:
        """Records of (condition, r) for windows from `start` (one or more consecutive batches of one process)."""
        return self.parts(condition, r) / f"b{start:07d}.safetensors"

    def records(self, condition: str, r: int) -> Path:
        return self.root / "records" / condition / f"r{r:04d}.parquet"

    def is_ours(self) -> bool:
        return (self.root / MARKER).is_file()

    def check(self, checkpoint: str | os.PathLike | None = None) -> None:
        """Before any work: the directory can become this audit's (new, empty, or an fcaudit audit directory, and
        not the audited `checkpoint` nor inside it): fcaudit.io's rule for every output directory."""
        prepare_out(self.root, "audit", avoid=() if checkpoint is None else (checkpoint,))

    # ---- lock ------------------------------------------------------------------------------------------------------
    def lock(self) -> None:
        """Take the exclusive lock, or fail at once: two processes must never write one audit directory."""
        self.check()
        self._lock_fd = lock_dir(self.root, "audit")

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = None

    # ---- configuration -------------------------------------------------------------------------------------------
    def open(self, config: dict) -> str:
        """Claim the (locked) directory for `config`: a new audit, a resume of the same configuration, or a refusal.

        Returns "new", "resume" or "repaired" (config.json was damaged and is rewritten from the same configuration,
        whose hash the marker keeps). Removes the temp files of a killed write (the directory is ours by the marker).
        """
        digest = config_hash(config)
        if not self.is_ours():  # lock() checked that the directory was new or empty
            files.write_json(self.root / MARKER, {"format": FORMAT, "config_hash": None})
        remove_stale_temps(self.root, recursive=True)
        marker = files.quietly(files.read_json, self.root / MARKER) or {}
        held = marker.get("config_hash")
        current = files.quietly(files.read_json, self.config_path) or {}
        if held not in (None, digest):
            changed = (differences(current, config) if current.get("config_hash") == held
                       else ["(config.json unreadable)"])
            if not changed:  # the same configuration under an earlier hash (fcaudit hashed DESCRIPTIVE fields too)
                held, current = digest, {**current, "config_hash": digest}
                files.write_json(self.config_path, current)
                files.write_json(self.root / MARKER, {**marker, "config_hash": digest})
            elif self.has_results():
                raise FcauditError(f"{self.root} holds an audit with a different configuration (differs in {changed}); "
                                   "pass a new --out directory or delete the old one")
        if held == digest and current.get("config_hash") == digest:
            if any(current.get("model", {}).get(k) != config["model"].get(k) for k in DESCRIPTIVE):
                # the same checkpoint read from elsewhere (or relabelled): config.json says where it was read now
                files.write_json(self.config_path, {**current, "model": {**current["model"], **{
                    k: config["model"][k] for k in DESCRIPTIVE if k in config["model"]}}})
            return "resume"
        state = "repaired" if held == digest and self.has_results() else "new"
        if state == "new":
            remove_file(self.replay)  # a failed replay report of a configuration with no results
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        files.write_json(self.config_path, {**config, "config_hash": digest, "created_at": now,
                                             "criteria": {**config["criteria"], "fixed_at": now},
                                             "provenance": provenance()})
        files.write_json(self.root / MARKER, {"format": FORMAT, "config_hash": digest})
        return state

    def has_results(self) -> bool:
        return any(p.suffix in (".parquet", ".safetensors") and not p.name.startswith(".")
                   for d in ("coeffs", "calib", "parts", "records") for p in (self.root / d).rglob("*"))

    def config(self) -> dict:
        return files.read_json(self.config_path, keys=("seed", "randomizations", "windows", "model"))
