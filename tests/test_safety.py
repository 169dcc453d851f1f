"""Filesystem and input safety: fcaudit never touches what it did not write, never runs a checkpoint's code, and
refuses what it cannot read safely.

Every row builds its world in the test's own directory (and, for the home directory, a HOME of its own) and runs
one command (tests/harness.py): one line `error: ...`, exit code 2, and every entry of that world as it was afterwards
(no file written, replaced or removed; links as links). No test writes or deletes outside its tmp directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable

import pytest
import torch

from fcaudit.errors import FcauditError
from fcaudit.models.muddpythia import MUDDPythia
from harness import an_audit, cli, fg_ckpt, moe_ckpt, mudd_ckpt, ok, printed, refusal, tree, user_file

AUDIT = ["--eval", "4", "--calib", "4", "--window", "32"]
PWNED = "pwned.txt"  # what a checkpoint's or pickle's code would write into the world: never there


# ---- the world ------------------------------------------------------------------------------------------------

class Evil:
    """A pickle payload: unpickled by full pickle, it would write PWNED beside itself."""

    def __init__(self, where: Path):
        self.where = str(where)

    def __reduce__(self):
        return (Path.write_text, (Path(self.where), "ran"))


def evil_code(d: Path) -> None:
    """config.json asks for the checkpoint's own modeling code, and the code would write PWNED."""
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="evilmoe", auto_map={"AutoConfig": "evil.EvilConfig",
                                               "AutoModelForCausalLM": "evil.EvilForCausalLM"})
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "evil.py").write_text(f"open({str(d.parent / PWNED)!r}, 'w').write('ran')\n")


def pickled_weights(d: Path, payload: bool) -> None:
    """Replace model.safetensors by pytorch_model.bin: plain tensors, or with a pickle payload among them."""
    from safetensors.torch import load_file

    state = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    torch.save({**state, **({"x": Evil(d.parent / PWNED)} if payload else {})}, d / "pytorch_model.bin")


def index_to(d: Path, target: str) -> Path:
    """Weights listed by an index whose every shard is `target` (an absolute path or one outside `d`)."""
    from safetensors.torch import load_file

    keys = list(load_file(str(d / "model.safetensors")))
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: target for k in keys}}))
    return d


def report_dir_of_theirs(t: Path) -> Path:
    """A directory of the user's holding a report.json that lists their data (fcaudit's marker absent)."""
    d = t / "theirs"
    user_file(d, "data.csv", "a,b\n1,2\n")
    (d / "report.json").write_text(json.dumps({"files": ["data.csv", "report.md"]}))
    user_file(d, "report.md", "# my notes\n")
    return d


def summary_of_theirs(t: Path) -> Path:
    d = t / "theirs"
    user_file(d, "summary.json", '{"mine": true}\n')
    user_file(d, "conditions.csv", "x\n1\n")
    return d


def linked(t: Path, run: Path, name: str, target: Path) -> Path:
    """`run`/`name` made a symbolic link to `target` (outside the run directory)."""
    link = run / name
    if link.is_dir() and not link.is_symlink():
        import shutil

        shutil.rmtree(link)
    elif link.exists() or link.is_symlink():
        link.unlink()
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return run


def outside_dir(t: Path) -> Path:
    d = t / "outside"
    user_file(d, "keep.safetensors", "not fcaudit's")
    return d


def lock_link_run(t: Path) -> Path:
    """A new run directory holding only a .lock that links to the user's file."""
    run = t / "run"
    run.mkdir()
    return linked(t, run, ".lock", user_file(t))


def binary_file(t: Path) -> Path:
    f = t / "random.bin"
    f.write_bytes(bytes(range(256)) * 64 + os.urandom(4096))
    return f


# ---- the table ------------------------------------------------------------------------------------------------
Row = tuple[str, Callable[[Path], list], str]

TRAIN = ["train", "--preset", "tiny", "--steps", "2"]
ROWS: list[Row] = [
    # 1, 2: output directories that are not fcaudit's
    ("report-into-a-dir-with-their-report-json", lambda t: ["report", fg_ckpt(t), "--out", report_dir_of_theirs(t)],
     "not an fcaudit report directory"),
    ("summarize-into-root", lambda t: ["summarize", an_audit(t), "--out", "/"], "is the filesystem root"),
    ("report-into-root", lambda t: ["report", fg_ckpt(t), "--out", "/"], "is the filesystem root"),
    ("summarize-into-home", lambda t: ["summarize", an_audit(t), "--out", t / "home"], "is the home directory"),
    ("train-into-home", lambda t: [*TRAIN, "--out", t / "home"], "is the home directory"),
    ("summarize-over-their-summary", lambda t: ["summarize", an_audit(t), "--out", summary_of_theirs(t)],
     "not an fcaudit summary directory"),
    ("execution-into-their-dir", lambda t: ["execution", fg_ckpt(t), "--out", user_file(t / "theirs").parent],
     "not an fcaudit execution results directory"),
    ("demo-into-their-dir", lambda t: ["demo", "--quick", "--out", user_file(t / "theirs").parent],
     "not an fcaudit demo directory"),
    ("audit-into-the-checkpoint", lambda t: ["audit", fg_ckpt(t), *AUDIT, "--out", t / "fg"], "is the checkpoint"),
    ("execution-into-the-checkpoint", lambda t: ["execution", fg_ckpt(t), "--out", t / "fg"], "is the checkpoint"),
    ("audit-inside-the-checkpoint", lambda t: ["audit", fg_ckpt(t), *AUDIT, "--out", t / "fg" / "audit"],
     "is inside the checkpoint"),
    ("summarize-into-an-audit", lambda t: ["summarize", an_audit(t), "--out", t / "audit"], "holds an audit"),
    ("report-into-a-summary-of-another-command", lambda t: ["report", fg_ckpt(t), "--out", an_audit(t)],
     "holds an audit"),
    # 3: a checkpoint's own code, whatever the terminal would answer (the runner feeds "y")
    ("audit-moe-with-its-own-code", lambda t: ["audit", _evil_moe(t), *AUDIT, "--out", t / "a"],
     "asks to run the checkpoint's own code (evil.py"),
    # 6: links inside run directories
    ("audit-lock-is-a-link", lambda t: ["audit", fg_ckpt(t), *AUDIT, "--out", lock_link_run(t)],
     "is a symbolic link inside the audit directory"),
    ("train-lock-is-a-link", lambda t: [*TRAIN, "--out", lock_link_run(t)],
     "is a symbolic link inside the training run directory"),
    ("audit-parts-is-a-link", lambda t: ["audit", fg_ckpt(t), *AUDIT, "--out",
                                         linked(t, _cli_audit(t), "parts", outside_dir(t))],
     "parts is a symbolic link"),
    ("audit-coeffs-is-a-link", lambda t: ["audit", fg_ckpt(t), *AUDIT, "--out",
                                          linked(t, _cli_audit(t), "coeffs", outside_dir(t))],
     "coeffs is a symbolic link"),
    ("audit-records-file-is-a-link", lambda t: ["audit", fg_ckpt(t), *AUDIT, "--out",
                                                _link_a_record(t)], "is a symbolic link inside the audit directory"),
    ("summarize-into-a-summary-with-a-link", lambda t: ["summarize", an_audit(t), "--out", _linked_summary(t)],
     "summary.json is a symbolic link"),
    # 7: sizes in config.json against the weights, before anything is allocated
    ("audit-block-size-1e8", lambda t: ["audit", fg_ckpt(t, block_size=100_000_000), *AUDIT, "--out", t / "a"],
     "wpe.weight: config.json implies [100000000, 32]"),
    ("audit-mudd-block-size-1e8", lambda t: ["audit", mudd_ckpt(t, block_size=100_000_000), *AUDIT,
                                             "--out", t / "a"], "block_size 100000000, more positions"),
    # 8, 9: pickle weights and index shards
    ("audit-moe-pickle-payload", lambda t: ["audit", _moe_pickle(t, payload=True), *AUDIT, "--out", t / "a"],
     "restricted unpickler refused it"),
    ("audit-mudd-pickle-payload", lambda t: ["audit", _mudd_pickle(t), *AUDIT, "--out", t / "a"],
     "restricted unpickler refused it"),
    ("audit-moe-index-to-etc-passwd", lambda t: ["audit", index_to(moe_ckpt(t), "/etc/passwd"), *AUDIT,
                                                 "--out", t / "a"], "which is not inside"),
    ("audit-mudd-index-to-etc-passwd", lambda t: ["audit", index_to(mudd_ckpt(t), "/etc/passwd"), *AUDIT,
                                                  "--out", t / "a"], "which is not inside"),
    ("audit-mudd-index-to-another-checkpoint", lambda t: [
        "audit", index_to(mudd_ckpt(t), str(mudd_ckpt(t, "other") / "model.safetensors")), *AUDIT, "--out", t / "a"],
     "which is not inside"),
    ("audit-moe-index-through-dotdot", lambda t: [
        "audit", index_to(moe_ckpt(t), f"../{moe_ckpt(t, 'other').name}/model.safetensors"), *AUDIT,
        "--out", t / "a"], "which is not inside"),
    ("audit-mudd-index-shard-links-outside", lambda t: ["audit", _shard_link(t), *AUDIT, "--out", t / "a"],
     "which is not inside"),
    # 15: a binary file as the corpus
    ("audit-binary-corpus-file", lambda t: ["audit", fg_ckpt(t), *AUDIT, "--corpus", binary_file(t),
                                            "--out", t / "a"], "is binary"),
    ("train-binary-corpus-file", lambda t: [*TRAIN, "--corpus", binary_file(t), "--out", t / "run"], "is binary"),
]


def _evil_moe(t: Path) -> Path:
    d = moe_ckpt(t)
    evil_code(d)
    return d


def _moe_pickle(t: Path, payload: bool) -> Path:
    d = moe_ckpt(t)
    pickled_weights(d, payload)
    return d


def _mudd_pickle(t: Path) -> Path:
    d = mudd_ckpt(t)
    pickled_weights(d, payload=True)
    return d


def _shard_link(t: Path) -> Path:
    """An index whose shard, named inside the checkpoint, is a link to another checkpoint's weights."""
    d = index_to(mudd_ckpt(t), "model-00001-of-00001.safetensors")
    (d / "model-00001-of-00001.safetensors").symlink_to(mudd_ckpt(t, "other") / "model.safetensors")
    return d


def _cli_audit(t: Path) -> Path:
    """A finished audit of fg_ckpt(t) into t/a by the same command the row runs again."""
    ok(cli("audit", fg_ckpt(t), *AUDIT, "--out", t / "a"))
    return t / "a"


def _link_a_record(t: Path) -> Path:
    run = _cli_audit(t)
    record = next((run / "records").rglob("*.parquet"))
    target = user_file(t, "precious.parquet", "the user's")
    record.unlink()
    record.symlink_to(target)
    return run


def _linked_summary(t: Path) -> Path:
    out = t / "s"
    ok(cli("summarize", an_audit(t), "--out", out))
    return linked(t, out, "summary.json", user_file(t))


@pytest.mark.parametrize("name, build, fragment", ROWS, ids=[r[0] for r in ROWS])
def test_refused_in_one_line_with_exit_2_and_the_world_unchanged(tmp_path, monkeypatch, name, build, fragment):
    import matplotlib

    # matplotlib's cache stays where it was (a HOME of the test's own must not move it into its world)
    monkeypatch.setenv("MPLCONFIGDIR", matplotlib.get_configdir())
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    user_file(tmp_path / "home", ".bashrc", "# theirs\n")
    args = build(tmp_path)
    before, root_before = tree(tmp_path), sorted(os.listdir("/"))
    result = cli(*args, input="y\ny\n")  # a terminal's "yes" to any question asked: none may be
    line = refusal(result)
    assert fragment in line, line
    assert "weights_only=False" not in line and "[y/N]" not in result.output
    assert tree(tmp_path) == before, "the command changed files it did not write"
    assert sorted(os.listdir("/")) == root_before
    assert not (tmp_path / PWNED).exists()


# ---- what still loads, and what the rule keeps doing --------------------------------------------------------

def test_a_native_checkpoint_with_an_auto_map_loads_without_running_its_code(tmp_path):
    """The public MUDDPythia's config.json has an auto_map for its own modeling code: fcaudit's model is the code."""
    from fcaudit.families import load_model

    d = mudd_ckpt(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoModelForCausalLM": "modeling_evil.Evil"}}))
    (d / "modeling_evil.py").write_text(f"open({str(tmp_path / PWNED)!r}, 'w').write('ran')\n")
    model, _ = load_model(d)
    assert isinstance(model, MUDDPythia) and not (tmp_path / PWNED).exists()


def test_a_native_transformers_model_with_an_auto_map_loads_natively(tmp_path):
    """transformers has Mixtral's own class: the auto_map and its evil.py are ignored, never run."""
    from fcaudit.families import load_model

    d = moe_ckpt(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoModelForCausalLM": "evil.Evil"}}))
    (d / "evil.py").write_text(f"open({str(tmp_path / PWNED)!r}, 'w').write('ran')\n")
    model, _ = load_model(d)
    assert type(model).__name__ == "MixtralForCausalLM" and not (tmp_path / PWNED).exists()


def test_plain_pickle_weights_load_through_the_restricted_unpickler(tmp_path):
    """A .bin of plain tensors still loads (a public checkpoint may ship one), in both loaders, with equal logits."""
    from fcaudit.families import load_model

    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    for make in (mudd_ckpt, moe_ckpt):
        d = make(tmp_path)
        ref, _ = load_model(d)
        pickled_weights(d, payload=False)
        got, _ = load_model(d)
        with torch.no_grad():
            a, b = ref(ids), got(ids)
        a, b = (getattr(x, "logits", x) for x in (a, b))
        assert torch.equal(a, b)


def test_reruns_into_their_own_directories_still_work(tmp_path):
    audit = an_audit(tmp_path)
    for _ in range(2):
        ok(cli("summarize", audit, "--out", tmp_path / "s"))
    assert (tmp_path / "s" / ".fcaudit-summary").is_file()
    listed = json.loads((tmp_path / "s" / ".fcaudit-summary").read_text())["files"]
    assert "summary.json" in listed and "conditions.csv" in listed


def test_a_link_planted_after_the_claim_is_refused_at_the_write(tmp_path):
    """The check at the start is not the only one: every write, lock and removal below a claimed directory refuses
    to go through a link that appears later."""
    from fcaudit.io import OutDir, remove_file, remove_tree, write_text

    out = OutDir(tmp_path / "r", "report").claim().root
    outside = outside_dir(tmp_path)
    before = tree(outside)
    (out / "sub").symlink_to(outside)
    with pytest.raises(FcauditError, match="sub is a symbolic link inside the report directory"):
        write_text(out / "sub" / "keep.safetensors", "overwritten")
    with pytest.raises(FcauditError, match="symbolic link"):
        remove_tree(out / "sub")
    with pytest.raises(FcauditError, match="symbolic link"):
        remove_file(out / "sub" / "keep.safetensors")
    assert tree(outside) == before
    run = OutDir(tmp_path / "t", "training run").claim()
    (run.root / ".lock").symlink_to(user_file(tmp_path))
    with pytest.raises(FcauditError, match="symbolic link"):
        run.lock()
    assert (tmp_path / "precious.txt").read_text() == "the user's own file\n"


NESTED = textwrap.dedent("""
    import sys
    from fcaudit.errors import FcauditError
    from fcaudit.io import OutDir, write_text
    demo, outside = sys.argv[1], sys.argv[2]
    for attempt in (lambda: write_text(demo + "/train/keep.safetensors", "overwritten"),
                    lambda: OutDir(demo + "/train/run", "training run").lock()):
        try:
            attempt()
            print("written")
        except FcauditError as e:
            print(str(e).splitlines()[0])
""")


def test_a_process_that_never_claimed_the_directory_is_held_to_its_rule(tmp_path):
    """The claim is the marker on disk, not a registry of the process that made it: another process (a training
    worker, another rank, a nested command) writing below a claimed directory refuses a link planted in it too."""
    from fcaudit.io import OutDir

    demo = OutDir(tmp_path / "demo", "demo").claim().root
    outside = outside_dir(tmp_path)
    before = tree(outside)
    (demo / "train").symlink_to(outside)
    r = subprocess.run([sys.executable, "-c", NESTED, str(demo), str(outside)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and all("train is a symbolic link inside the demo directory" in line for line in lines)
    assert tree(outside) == before


def test_an_out_dir_writes_only_inside_itself(tmp_path):
    from fcaudit.io import OutDir

    out = OutDir(tmp_path / "s", "summary").claim()
    with pytest.raises(ValueError, match="outside the summary directory"):
        out.write_text(tmp_path / "elsewhere.md", "x")
    assert not (tmp_path / "elsewhere.md").exists()
    out.write_text(out.root / "summary.json", "{}")
    assert out.recorded() == [out.root / "summary.json"]


def test_only_recorded_files_are_replaced_or_removed(tmp_path):
    from fcaudit.io import OutDir, remove_file, write_text

    out = OutDir(tmp_path / "r", "report").claim().root
    write_text(out / "ours.md", "x")
    user_file(out, "theirs.md")  # dropped into fcaudit's directory afterwards
    with pytest.raises(FcauditError, match="is not a file fcaudit wrote"):
        write_text(out / "theirs.md", "overwritten")
    assert not remove_file(out / "theirs.md") and (out / "theirs.md").read_text() == "the user's own file\n"
    assert remove_file(out / "ours.md") and not (out / "ours.md").exists()


HIDDEN = textwrap.dedent("""
    import json, sys
    sys.modules["transformers"] = None  # as if installed without the [hf] extra
    sys.modules["accelerate"] = None
    from typer.testing import CliRunner
    from fcaudit.cli import app
    out = []
    for args in json.loads(sys.argv[1]):
        r = CliRunner().invoke(app, args)
        out.append([r.exit_code, r.output])
    print(json.dumps(out))
""")


def test_a_missing_extra_is_named_before_any_work(tmp_path):
    """Without transformers: the quick demo, MoE training and a MoE audit say in one line which extra to install,
    before anything is trained or written."""
    moe = moe_ckpt(tmp_path)
    commands = [["demo", "--quick", "--out", str(tmp_path / "demo")],
                ["train", "--model", "moe", "--preset", "tiny", "--steps", "2", "--out", str(tmp_path / "run")],
                ["audit", str(moe), *AUDIT, "--out", str(tmp_path / "a")]]
    before = tree(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", HIDDEN, json.dumps(commands)], capture_output=True, text=True,
                          check=False, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    for (code, output), args in zip(json.loads(done.stdout.splitlines()[-1]), commands):
        lines = printed(output)
        assert code == 2 and len(lines) == 1, (args, output)
        assert "needs transformers" in lines[0] and "pip install -e '.[hf]' in fcaudit's clone" in lines[0], lines[0]
    assert tree(tmp_path) == before


def test_a_directory_deleted_and_made_anew_is_claimed_afresh(tmp_path):
    """Within one process: what was recorded of a deleted directory is not carried over to its successor."""
    import shutil

    audit = an_audit(tmp_path)
    for _ in range(2):
        ok(cli("summarize", audit, "--out", tmp_path / "s"))
        assert "summary.json" in json.loads((tmp_path / "s" / ".fcaudit-summary").read_text())["files"]
        shutil.rmtree(tmp_path / "s")
