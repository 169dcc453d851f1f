"""`fcaudit audit CHECKPOINT`: load a checkpoint directory or hub id on this rank's device, draw its test and
validation windows from a corpus, then audit it (every torchrun rank its share) or, for a dry run, print its plan and
what the real run would do with --out."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import torch

from fcaudit import api, data, families, placement
from fcaudit.auditor import files
from fcaudit.auditor.directory import MARKER, AuditDir
from fcaudit.auditor.driver import against_out, audit
from fcaudit.auditor.group import Group, group_from_env, ignore_sigterm, launched_rank, launched_world, rank_device
from fcaudit.auditor.inputs import Windows, parameter_hash
from fcaudit.auditor.planner import AuditPlan, plan
from fcaudit.auditor.results import AuditResult
from fcaudit.config import AuditConfig
from fcaudit.device import DTYPES, resolve_device
from fcaudit.errors import FcauditError
from fcaudit.execution.measure import Source
from fcaudit.held_warnings import warnings_held
from fcaudit.hub import resolve
from fcaudit.io import read_object
from fcaudit.tokens import load_tokenizer


def audit_checkpoint(checkpoint: str, corpus: str, config: AuditConfig) -> AuditResult | AuditPlan:
    """Audit a checkpoint directory or hub id on `corpus`'s test (config.n_eval) and validation (config.n_calib)
    windows: the AuditResult, or a dry run's AuditPlan (printed by rank 0). Under torchrun every rank runs this,
    loads the model on its own device and runs its share of the work units."""
    if config.offload_folder is not None and Path(config.offload_folder).resolve() in {
            Path(p).resolve() for p in (config.out, checkpoint) if p is not None}:
        raise FcauditError(f"--offload-folder {config.offload_folder} is the audit's --out or the checkpoint: pass a "
                           "directory of its own (it receives a copy of the offloaded weights)")
    if config.dry_run:  # AuditConfig refuses a device map planned for several processes
        config = replace(config, world_size=config.world_size or launched_world())
    device = rank_device(resolve_device(config.device))
    group = Group() if config.dry_run else group_from_env(device)
    group.on_failure = ignore_sigterm
    try:
        # an agreed phase: a checkpoint or corpus missing on one node stops every rank with the same line
        model, controller, (ev, ca), config = group.run(lambda: _load(checkpoint, corpus, config, device, group.world))
        if not config.dry_run:
            result = audit(model, controller, ev, ca, config=config, group=group)
            # every rank done communicating before any tears its group down, else a rank may abort at exit
            group.gather(None)
            return result
        planned = plan(model, controller, ev, ca, config=config, world_size=config.world_size or 1)
        if launched_rank() == 0:
            print(planned)
            windows = Windows.of(ev, ca)
            if note := against_out(model, controller, windows, config, planned):
                print(note)
            try:  # a plan of any size is printed, but the user learns what the real run would refuse or note
                for notice in windows.check():
                    print(notice.line)
            except FcauditError as e:
                print(f"note: the audit itself would stop here: {e}")
        return planned
    finally:
        group.close()


def _load(checkpoint: str, corpus: str, config: AuditConfig, device: torch.device, world: int) -> tuple:
    """(model, controller, (eval, calib) WindowSets, config describing the model); a bad --out or launch fails first."""
    if not config.dry_run:
        AuditDir(config.out).check(checkpoint)
        if config.world_size is not None and config.world_size != world:
            raise FcauditError(f"--world-size {config.world_size} but this run has {world} process(es); launch with "
                               f"torchrun --nproc_per_node={config.world_size} (or drop --world-size, which is for "
                               "--dry-run)")
        if config.device_map is not None and world > 1:
            raise FcauditError(f"--device-map spreads one model over this machine's devices, but torchrun started "
                               f"{world} processes, each of which would load it whole: run one process, or drop "
                               "--device-map")
    with warnings_held():  # a checkpoint refused for its controller: that line alone, not the load's warnings first
        model = api.load(checkpoint, device=device, dtype=config.dtype, revision=config.revision,
                         device_map=None if config.device_map is None else placement.parse_device_map(
                             config.device_map), offload_folder=config.offload_folder)
        controller = families.controller_for(model)
    ckpt_dir = Path(model.fcaudit_meta["checkpoint"])
    cap = families.DEFAULT_WINDOW_CAP
    window = config.window or min(families.context_length(model) or cap, cap)
    corp = data.load_corpus(corpus, tokenizer=_tokenizer(checkpoint, ckpt_dir, model), splits=("validation", "test"))
    info = {"family": config.family or family_name(checkpoint, ckpt_dir), "checkpoint": str(checkpoint),
            "revision": config.revision, "corpus": corp.describe()}
    return (model, controller, data.audit_windows(corp, config.n_eval, config.n_calib, window, config.seed),
            replace(config, model_info=info))


def _tokenizer(checkpoint: str, ckpt_dir: Path, model: torch.nn.Module):
    """The checkpoint's tokenizer.json where its config says the model is tokenized (a vocabulary other than the 256
    bytes, or a tokenizer_class); a byte-level model reads bytes, and a tokenizer.json beside it is not used (a note
    says so): its ids would fit the vocabulary and give numbers for text the model never saw encoded so."""
    vocab, file = getattr(getattr(model, "config", None), "vocab_size", None), ckpt_dir / "tokenizer.json"
    config = ckpt_dir / "config.json"
    declared = config.is_file() and read_object(config, "use the config.json saved with these weights").get(
        "tokenizer_class")
    if declared or (file.is_file() if vocab is None else vocab != data.BYTES):
        if not file.is_file():
            raise FcauditError(f"{checkpoint} has a {vocab}-token vocabulary but no tokenizer.json: put the "
                               "checkpoint's tokenizer.json in its directory")
        return load_tokenizer(ckpt_dir)
    if file.is_file():
        print(f"note: {file} is not used: the model's {data.BYTES}-token vocabulary is bytes and its config names no "
              "tokenizer, so the corpus is read as bytes (set tokenizer_class in config.json if the model is "
              "tokenized)", file=sys.stderr)
    return None


def family_name(checkpoint: str, ckpt_dir: Path) -> str:
    """Checkpoints of one family differ only by training seed: name them by what was trained, not by path."""
    metrics = ckpt_dir / "metrics.json"
    if metrics.is_file():
        m = read_object(metrics, "restore it from the training run, or delete it")
        return " ".join(str(m[k]) for k in ("variant", "preset") if m.get(k)) or ckpt_dir.name
    return checkpoint if not Path(checkpoint).exists() else ckpt_dir.name


def execution_sources(given: Sequence[str]) -> list[Source]:
    """What `fcaudit execution` measures for each argument: a checkpoint as it is, or, for an audit directory (its
    marker), the checkpoint its config.json recorded, in the recorded dtype, checked to be the audited model."""
    return [_audited(str(g)) if _is_audit(g) else Source(str(g), resolve(g)) for g in given]


def _is_audit(given: str) -> bool:
    try:
        return (Path(given) / MARKER).is_file()
    except (OSError, ValueError):  # a name too long, or with a NUL: `resolve` says in one line what is wrong with it
        return False


def _audited(audit: str) -> Source:
    try:
        config = AuditDir(audit).config()
    except files.Damaged as e:
        raise FcauditError(f"{e.path} is damaged ({e.why}): rerun the audit command on {audit}") from None
    recorded = config["model"]
    checkpoint = recorded.get("checkpoint")
    if not isinstance(checkpoint, str):
        raise FcauditError(f"{audit} is an audit of a model given in Python (its config.json names no checkpoint): "
                           "measure that model in Python with fca.execution(model, controller, windows)")
    try:
        path = resolve(checkpoint, recorded.get("revision"))
    except FcauditError as e:
        raise FcauditError(f"{audit} audited the checkpoint {checkpoint}, which is not found from here ({e}): run "
                           "from the directory the audit ran in, or pass the checkpoint where it is now") from None

    def check(model: torch.nn.Module) -> None:
        """Refuse a model that is not the audited one: other weights, or a controller fcaudit now builds otherwise."""
        try:
            built = json.loads(json.dumps(families.controller_for(model).describe()))  # as config.json holds it
        except FcauditError:
            built = {}  # no controller found now: every field the audit recorded differs
        differ = [f"controller {k}" for k in sorted(set(built) | set(config["controller"]))
                  if built.get(k) != config["controller"].get(k)]
        if recorded.get("params_sha256") not in (None, parameter_hash(model)):
            differ.insert(0, "weights (params_sha256)")
        if differ:
            raise FcauditError(f"{checkpoint} is not the model {audit} audited: its {', '.join(differ)} differ from "
                               "the audit's config.json (the checkpoint changed since the audit?); audit it again, "
                               "or pass the checkpoint itself to measure it as it is now")

    dtype = DTYPES.get(recorded.get("dtype"))  # the audit's dtype (a float one; None: the checkpoint's own)
    return Source(checkpoint, path, dtype=dtype, audit=audit, check=check)
