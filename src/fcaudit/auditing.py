"""`fcaudit audit CHECKPOINT`: load a checkpoint, draw its windows, find its controller, run the audit."""

from __future__ import annotations

from pathlib import Path

from fcaudit.audit.group import Group, group_from_env, ignore_sigterm, launched_rank, launched_world, rank_device
from fcaudit.device import as_dtype, resolve_device
from fcaudit.errors import FcauditError
from fcaudit.io import read_json


def family_name(checkpoint: str, ckpt_dir: Path) -> str:
    """Checkpoints of one family differ only by training seed: name them by what was trained, not by path."""
    metrics = ckpt_dir / "metrics.json"
    if metrics.is_file():
        m = read_json(metrics)
        return " ".join(str(m[k]) for k in ("variant", "preset") if m.get(k)) or ckpt_dir.name
    return checkpoint if not Path(checkpoint).exists() else ckpt_dir.name


def audit_checkpoint(checkpoint: str, *, corpus: str, out: Path, n_eval: int, n_calib: int, window: int | None,
                     randomizations: int, seed: int, batch_size: int, device: str = "auto", revision: str | None = None,
                     dtype: str | None = None, tolerance: float = 0.0, dry_run: bool = False, criteria=None,
                     quiet: bool = False, world_size: int | None = None, device_map: str | None = None,
                     offload_folder: Path | None = None, family: str | None = None):
    """Audit one checkpoint directory or hub id on `corpus`; returns the AuditResult (or the AuditPlan of a dry run).

    Under torchrun every rank runs this with the same arguments: each loads the model on its own device
    (cuda:LOCAL_RANK, or the CPU) and runs its share of the audit's work units (fcaudit.audit.group). `world_size` is
    the number of processes a dry run splits the work over (default: the launcher's WORLD_SIZE, else 1); a real run
    checks it. `window` None: the model's context, at most 2048 tokens. `device_map` (instead of `device`): one
    process spreads the model over this machine's devices (fcaudit.placement.parse_device_map). `family`: the name
    `summarize` pools checkpoints by (default: what the checkpoint's metrics.json says it is, else its directory
    name or hub id)."""
    from fcaudit.audit.runner import against_out, audit, plan
    from fcaudit.placement import parse_device_map

    if offload_folder is not None and device_map is None:
        raise FcauditError("--offload-folder holds what a device map puts on disk: pass --device-map too, or drop it")
    if device_map is not None and dry_run and (world_size or launched_world()) > 1:
        raise FcauditError("--device-map spreads one model in one process: a dry run for several processes "
                           "(--world-size) plans a run that would be refused; drop one of them")
    if device_map is not None and device != "auto":
        raise FcauditError(f"--device {device} and --device-map {device_map}: pass one (the map names the devices)")
    if offload_folder is not None and Path(offload_folder).resolve() in (Path(out).resolve(),
                                                                          Path(checkpoint).resolve()):
        raise FcauditError(f"--offload-folder {offload_folder} is the audit's --out or the checkpoint: pass a "
                           "directory of its own (it receives a copy of the offloaded weights)")
    placed = None if device_map is None else {"device_map": parse_device_map(device_map),
                                              "offload_folder": offload_folder}

    torch_device = rank_device(resolve_device(device))
    group = Group() if dry_run else group_from_env(torch_device)
    group.on_failure = ignore_sigterm
    try:
        # an agreed phase: a checkpoint or corpus missing on one node stops every rank with the same line
        model, controller, ev, ca, info = group.run(lambda: _load(
            checkpoint, corpus, n_eval, n_calib, window, seed, torch_device, revision, dtype,
            world_size=world_size, world=None if dry_run else group.world, out=None if dry_run else out,
            randomizations=randomizations, batch_size=batch_size, placed=placed, family=family))
        if dry_run:
            p = plan(model, controller, ev, ca, batch_size=batch_size, randomizations=randomizations,
                     world_size=world_size or launched_world())
            if launched_rank() == 0:
                print(p)
                note = against_out(out, model, controller, ev, ca, p, seed=seed, tolerance=tolerance,
                                   criteria=criteria, model_info=info)
                if note:
                    print(note)
            return p
        return audit(model, controller, ev, ca, randomizations=randomizations, seed=seed, out=out,
                     batch_size=batch_size, tolerance=tolerance, criteria=criteria, model_info=info, quiet=quiet,
                     group=group)
    finally:
        group.close()


def _load(checkpoint, corpus, n_eval, n_calib, window, seed, device, revision, dtype, *, world_size, world, out,
          randomizations, batch_size, placed=None, family=None):
    """(model, controller, eval windows, calibration windows, model info) of a checkpoint on a corpus; bad counts or
    a bad --out fail before anything is loaded."""
    from fcaudit import data, families
    from fcaudit.audit.directory import AuditDir
    from fcaudit.controllers import controller_for
    from fcaudit.hub import resolve
    from fcaudit.models.checkpoint import load_model

    if n_eval < 2:
        raise FcauditError(f"--eval {n_eval}: CrossInput needs a derangement of at least 2 evaluation windows")
    if n_calib < 1:
        raise FcauditError(f"--calib {n_calib}: static profiles need at least 1 calibration window")
    for flag, value, low in (("--randomizations", randomizations, 1), ("--batch-size", batch_size, 1),
                             ("--seed", seed, 0)):
        if value < low:
            raise FcauditError(f"{flag} {value}: pass an integer >= {low}")
    if out is not None:
        AuditDir(out).check(checkpoint)
    if world_size is not None and world_size < 1:
        raise FcauditError(f"--world-size must be >= 1, got {world_size}")
    if world_size is not None and world is not None and world_size != world:
        raise FcauditError(f"--world-size {world_size} but this run has {world} process(es); launch with "
                           f"torchrun --nproc_per_node={world_size} (or drop --world-size, which is for --dry-run)")
    if placed is not None and (world or 1) > 1:
        raise FcauditError(f"--device-map spreads one model over this machine's devices, but torchrun started {world} "
                           "processes, each of which would load it whole: run one process, or drop --device-map")
    torch_dtype = None if dtype is None else as_dtype(dtype)
    ckpt_dir = resolve(checkpoint, revision)
    model, _ = load_model(ckpt_dir, device=device, dtype=torch_dtype, **(placed or {}))
    cap = families.DEFAULT_WINDOW_CAP
    window = window or min(families.context_length(model) or cap, cap)
    tokenizer = None
    if (ckpt_dir / "tokenizer.json").is_file():
        from fcaudit.tokens import load_tokenizer

        tokenizer = load_tokenizer(ckpt_dir)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if tokenizer is None and vocab is not None and vocab != 256:
        raise FcauditError(f"{checkpoint} has a {vocab}-token vocabulary but no tokenizer.json: put the checkpoint's "
                           "tokenizer.json in its directory")
    corp = data.load_corpus(corpus, tokenizer=tokenizer, splits=("validation", "test"))
    ev, ca = data.audit_windows(corp, n_eval, n_calib, window, seed)
    if family is not None and not family.strip():
        raise FcauditError("--family '': pass a name, e.g. --family mixtral-seeds")
    info = {"family": family or family_name(checkpoint, ckpt_dir), "checkpoint": str(checkpoint), "revision": revision,
            "corpus": corp.describe()}
    return model, controller_for(model), ev, ca, info
