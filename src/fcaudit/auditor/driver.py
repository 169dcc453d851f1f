"""Algorithm 1 (Frozen-Controller Audit) from the user's side: check the inputs, probe the model, fix the
configuration, lock the audit directory (every rank seeing rank 0's, all with one configuration), run the engine's
work units and return the results. Finished units are verified when reused and each draw is keyed by (seed,
randomization, example), so rerunning a call resumes an interrupted audit with an uninterrupted one's records."""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from torch import nn

from fcaudit import placement, protocol
from fcaudit.auditor import files
from fcaudit.auditor.directory import FORMAT, MARKER, AuditDir, config_hash, differences
from fcaudit.auditor.engine import Engine, check_scores, running
from fcaudit.auditor.files import tensor_sha256
from fcaudit.auditor.group import Group, launched_world
from fcaudit.auditor.inputs import (Windows, check_controller, check_ids, check_targets, evaluating, first_forward,
                                    parameter_hash, vocab_size)
from fcaudit.auditor.planner import AuditPlan
from fcaudit.auditor.results import AuditResult, Replay
from fcaudit.auditor.state import ModelState
from fcaudit.auditor.store import check_finite
from fcaudit.config import AuditConfig, with_settings
from fcaudit.controllers.checks import pre_write_checks
from fcaudit.controllers.controller import Controller
from fcaudit.controllers.flow_checks import CAUSALITY_WINDOWS
from fcaudit.errors import FcauditError
from fcaudit.io import Locked


def _config(model: nn.Module, controller: Controller, windows: Windows, config: AuditConfig, coeff_dtype: str) -> dict:
    """config.json's content: the settings, the windows, the model and its controller."""
    ev, ca = windows.ev, windows.ca
    described = {"n_eval": int(ev.shape[0]), "n_calib": int(ca.shape[0]), "window": int(ev.shape[1]),
                 "eval_sha256": tensor_sha256(ev), "calib_sha256": tensor_sha256(ca)}
    described |= {f"{name}_split": s.split for name, s in (("eval", windows.ev_set), ("calib", windows.ca_set))
                  if getattr(s, "split", None) is not None}
    model_desc = {**(config.model_info or {}), "class": type(model).__name__,
                  "n_params": sum(p.numel() for p in model.parameters()), "params_sha256": parameter_hash(model),
                  "dtype": next((str(p.dtype).replace("torch.", "") for p in model.parameters()), None),
                  "device_type": placement.input_device(model).type, "coeff_dtype": coeff_dtype}
    return {"format": FORMAT, **config.to_json(), "conditions": list(protocol.for_controller(controller.info)),
            "windows": described, "model": model_desc, "controller": controller.describe(),
            "labels": controller.labels}


def _lock_and_open(adir: AuditDir, config: dict, group: Group) -> str:
    try:
        adir.lock()
    except Locked as e:
        if group.world == 1 and launched_world() > 1:  # every torchrun rank running the whole audit on its own
            raise FcauditError(f"{e}; under torchrun pass group=fcaudit.auditor.group_from_env() so the ranks share "
                               "one audit") from None
        raise
    state = adir.open(config)
    adir.check_strays(config)  # before any work: the reader would refuse the finished audit for it
    return state


def _prepare(model: nn.Module, controller: Controller, windows: Windows, config: AuditConfig, world: int) -> tuple:
    """Check the inputs, probe the first batch and fix the configuration: (probe, config.json's content, the checks'
    findings: notices only, a refusal is raised, the model's state before the checks). The probe, the first batch's
    capture (coefficients with their decoding, logits, NLL), is stage 1's for that batch."""
    if config.out is None and world > 1:
        raise FcauditError(f"{world} processes share this audit but no out directory was given; pass out= (a "
                           "directory every rank sees)")
    check_controller(model, controller)
    notes = windows.check()
    check_ids(model, windows.ev, windows.ca)
    # probed before anything is written; the capture also holds what every replay of this rank decodes with
    first = windows.ev[:config.batch_size].to(placement.input_device(model))
    probe = first_forward(model, controller, first, config.loss_fn, decoding=True)
    coeffs, logits, nll = probe
    check_finite(coeffs, "the first evaluation batch", [s.path for s in controller.sites])
    check_scores(logits, nll, "the first evaluation batch")
    if config.loss_fn is None:  # the next-token NLL indexes the logits by every window's targets
        check_targets(windows, logits.shape[-1])
    state = ModelState.of(model, probe)  # compared after stage 1 and at the end
    probed = windows.ev[:CAUSALITY_WINDOWS].to(first.device)  # the causality check's windows, batch by batch
    with running("the first evaluation batch, in the checks before anything is written",
                 "fix it and run the audit again (nothing was written)"):
        findings = pre_write_checks(model, controller, first, probe, vocab_size(model) or int(first.max()) + 1,
                                    probed)
    if findings and findings[0].refusal:  # refusals first: they name the cause
        state.check_tensors(model, "during the checks")  # unless the model changed itself: then that is the cause
        raise FcauditError(findings[0].line)
    findings += notes
    saved = _config(model, controller, windows, config, str(coeffs[0].dtype).replace("torch.", ""))
    return probe, saved, findings, state


SHARED_CHECK = ".fcaudit-ranks"  # rank 0's token in the audit directory, removed once every rank has read it
SHARED_WAIT = (0.0, 0.5, 1, 2, 4, 8, 16, 30)  # seconds between looks: an NFS client caches "not found" up to ~60 s


def check_shared(adir: AuditDir, group: Group) -> None:
    """Every rank must see rank 0's audit directory (a node-local --out would split the audit's files, found only
    when the merge misses them): each reads rank 0's token there, looking again for about a minute."""
    token = group.gather(secrets.token_hex(8))[0]  # rank 0's, on every rank
    path = adir.root / SHARED_CHECK

    def read() -> None:
        seen = None
        for wait in SHARED_WAIT:
            time.sleep(wait)
            if adir.root.is_dir():
                os.listdir(adir.root)  # refreshes a network filesystem's view of the directory
            seen = path.read_text() if path.is_file() else None
            if seen == token:
                return
        raise FcauditError(f"rank {group.rank} does not see rank 0's audit directory at {adir.root} ("
                           f"{'its check file is missing' if seen is None else 'another audit is there'}): --out "
                           "must be one directory that every rank shares (a network filesystem), at one path")
    try:
        group.run(lambda: adir.out.write_text(path, token), main_only=True)
        group.run(read)
    finally:
        if group.is_main:
            path.unlink(missing_ok=True)


def check_same(configs: list[dict]) -> None:
    """Every rank must audit the same model, windows and settings (e.g. the same checkpoint on every node)."""
    first = config_hash(configs[0])
    if (odd := next((k for k, c in enumerate(configs) if config_hash(c) != first), None)) is not None:
        raise FcauditError(f"rank {odd} has another audit configuration than rank 0 (differs in "
                           f"{differences(configs[0], configs[odd])}); give every node the same checkpoint and corpus")


def _checked(model: nn.Module, controller: Controller, given: tuple, config: AuditConfig, group: Group) -> tuple:
    """The given (eval, calib) windows checked, the model probed and the configuration fixed, every rank agreeing:
    (windows, (probe, the model's state), config.json's content, findings, `config` with its out directory); rank 0
    prints the notices."""
    # an agreed phase: bad input on any rank stops every rank with its one-line error
    windows = group.run(lambda: Windows.of(*given))
    probe, saved, findings, state = group.run(lambda: _prepare(model, controller, windows, config, group.world))
    if (lines := [f.line for f in findings if f.line]) and group.is_main:  # even when quiet: it may mean the
        Console(stderr=True, highlight=False).print("\n".join(lines), soft_wrap=True)  # results measure nothing
    if config.out is None:
        config = replace(config, out=Path(tempfile.mkdtemp(prefix="fcaudit-audit-")))
    return windows, (probe, state), saved, findings, config


def audit(model: nn.Module, controller: Controller, eval_windows, calib_windows, *, config: AuditConfig | None = None,
          group: Group | None = None, **settings) -> AuditResult:
    """Run (or resume) a Frozen-Controller Audit of `model`; its results are also written to `out`.

    One run of the unmodified model caches every site's coefficients, replaying them must reproduce the logits
    exactly, static profiles come from the calibration windows only, then each condition is replayed. The same
    call on the same `out` resumes; another configuration there, bad input or a failed replay raise FcauditError.

    Parameters
    ----------
    model
        Called as `model(ids)` on int64 ids [batch, token]; returns logits [batch, token, vocab] or an output with them.
    controller
        Its sites: `fca.Controller.from_modules(...)` or `fca.controller_for(model)`.
    eval_windows, calib_windows : torch.Tensor or fcaudit.data.WindowSet
        Token ids [N, T] (an int tensor) or the WindowSets of `fca.windows`.
    config : fcaudit.AuditConfig, optional
        The settings in one object.
    group
        The processes sharing the work units (default: this one); under torchrun, `auditor.group_from_env(device)`.
    **settings
        `out`, `randomizations`, `seed`, `batch_size`, `tolerance`, `criteria`, `loss_fn`, `model_info`, `quiet`,
        `execution`:
        the fields of `fcaudit.AuditConfig`, documented there (`AuditConfig(**settings)`); given with `config`, they
        replace its fields.

    Returns
    -------
    AuditResult
        The audit's directory read back.

    Examples
    --------
    An untrained two-layer byte-level LM whose residual updates are scaled by input-dependent gates (the sites):

    >>> import tempfile
    >>> class GatedLM(nn.Module):
    ...     def __init__(self, d=16):
    ...         super().__init__()
    ...         self.embed, self.head = nn.Embedding(256, d), nn.Linear(d, 256)
    ...         self.mlps = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
    ...         self.gates = nn.ModuleList(
    ...             nn.Sequential(nn.Linear(d, 1), nn.Sigmoid(), nn.Flatten(-2)) for _ in range(2))
    ...     def forward(self, ids):  # ids [batch, token] -> logits [batch, token, 256]
    ...         h = self.embed(ids)
    ...         for mlp, gate in zip(self.mlps, self.gates):
    ...             h = h + gate(h).unsqueeze(-1) * mlp(h)  # gate(h): [batch, token]
    ...         return self.head(h)
    >>> model = GatedLM().eval()
    >>> ctrl = fca.Controller.from_modules(model, "gates.*", layout="batch token")
    >>> eval_w, calib_w = fca.windows("embedded", n_eval=4, n_calib=4, window=16)
    >>> out = tempfile.mkdtemp()
    >>> result = fca.audit(model, ctrl, eval_w, calib_w, randomizations=1, out=out, quiet=True)
    >>> result.replay.passed, result.replay.max_abs_dlogit
    (True, 0.0)
    >>> result.penalties()  # an untrained model's numbers mean nothing: the calls are the point
    PenaltiesResult: mean ΔNLL vs Correct per condition ..., 95% paired-window bootstrap intervals over 4 windows
      condition ...ΔNLL...interval...
      Cross-input ...
      StaticProfile ...
      GlobalMean ...

    The examples of `fca.AuditResult`, `fca.plan`, `fca.summarize` and `fca.build_report` continue this one.
    """
    config = with_settings(config, settings)
    group = group or Group()
    with evaluating(model):
        windows, (probe, model_state), saved, findings, config = _checked(
            model, controller, (eval_windows, calib_windows), config, group)
        adir = AuditDir(config.out)
        group.run(lambda: check_same(group.gather(saved)))
        try:
            # rank 0 alone locks and configures the directory in an agreed phase: a held lock or a refused
            # configuration stops every rank with its error instead of leaving the others at the next barrier
            state = group.run(lambda: _lock_and_open(adir, saved, group), main_only=True)
            if group.world > 1:
                check_shared(adir, group)
            # replay.json keeps the findings (rewritten by every run: a resume says them again)
            engine = Engine(model, controller, (windows.ev, windows.ca), config, group, probe, findings,
                            model_state)
            del probe  # the engine holds it until the first batch's capture, then lets it go
            if state == "repaired":
                engine.redone.append("config.json (rewritten: the marker holds its hash)")
            if state == "remarked":
                engine.redone.append(f"{MARKER} (damaged or cut short: rewritten with config.json's hash)")
            engine.run()
        except files.Damaged as e:  # a file this run wrote and verified, changed by something else while it ran
            raise FcauditError(f"{e.path} changed while the audit ran ({e.why}): rerun the command, it recomputes "
                               "that file") from None
        finally:
            adir.unlock()
    # the engine wrote and verified every records file: AuditResult.load would read them all again
    written = adir.config()
    result = AuditResult(adir.root, written, Replay.from_json(files.read_json(adir.replay)))
    if not config.quiet and group.is_main:
        print(result)
    return result


def against_out(model: nn.Module, controller: Controller, windows: Windows, config: AuditConfig,
                planned: AuditPlan) -> str | None:
    """For a dry run: a note on whether the real run would resume or refuse the audit `config.out` holds, if any."""
    adir = AuditDir(config.out)
    current = files.quietly(files.read_json, adir.config_path) if adir.is_ours() else None
    if current is None or not adir.has_results():
        return None
    if (why := adir.earlier()) is not None:
        return f"note: {config.out} holds an audit written by another version of fcaudit ({why}): the real run " \
               "starts it anew there"
    if changed := differences(current, _config(model, controller, windows, config, planned.coeff_dtype)):
        return f"note: {config.out} holds an audit with another configuration (differs in {changed}): the real run " \
               "would refuse it; pass a new --out"
    return f"note: {config.out} holds this audit: the real run resumes it"
