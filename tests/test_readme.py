"""The README is a newcomer's whole path: short, its quick start an audit of a model defined right there (no training
run, no checkpoint) in at most 20 lines, every code block run (tests/test_docs.py's runner), every link alive, every
command it names one that exists."""

import re
import subprocess
import tomllib

from torch import nn

from conftest import ROOT, blocks, run_page

README = ROOT / "README.md"


def test_readme_is_short_and_its_quick_start_fits_in_20_lines():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    python = [b for b in blocks(README) if b.lang == "python"]
    assert len(python) == 1, "one Python example in the README: the quick start"
    assert len(python[0].code.splitlines()) <= 20
    # the commands it names exist: each `make` target is the Makefile's (a dry run prints what it runs), and each
    # `pip install -e` installs this clone with extras its pyproject.toml defines (hf: transformers and accelerate)
    runs = {"demo": "fcaudit demo", "test": "pytest", "docs": "mkdocs build", "fuzz": "fuzzing.py",
            "bench": "make_benchmarks", "test-latest": "pytest", "lock": "uv pip compile"}
    targets = set(re.findall(r"`?make ([a-z][\w-]*)", text))
    assert {"demo", "test"} <= targets
    for target in targets:
        dry = subprocess.run(["make", "-n", "-C", str(ROOT), target], capture_output=True, text=True)
        assert dry.returncode == 0 and runs[target] in dry.stdout, (target, dry.stdout, dry.stderr)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["name"] == "fcaudit" and "build-system" in project
    installs = re.findall(r"pip install -e '?\.(?:\[([\w,]+)\])?'?", text)
    assert "" in installs and "hf" in installs, installs
    extras = project["project"]["optional-dependencies"]
    for extra in filter(None, installs):
        assert extra in extras, extra
    assert {re.split(r"[<>=\[ ]", r)[0] for r in extras["hf"]} >= {"transformers", "accelerate"}


def test_readme_code_runs(tmp_path, monkeypatch):
    """The quick start and the CLI lines run as written, in a fresh directory: the quick start audits a model class
    it defines itself, with no checkpoint to read and no training run."""
    scope = run_page(README, tmp_path, monkeypatch)
    result = scope["result"]
    assert result.replay.passed and result.replay.max_abs_dlogit == 0
    assert (tmp_path / "audits" / "my-lm" / "replay.json").is_file()
    assert set(result.penalties().names) >= {"CrossInput", "TokenShuffle", "StaticProfile", "StructureRemoved"}
    assert (tmp_path / "report" / "report.html").is_file()
    own = {name for name, v in scope.items()
           if isinstance(v, type) and issubclass(v, nn.Module) and v.__module__ == "__docs__"}
    assert result.config["model"]["class"] in own, "the quick start audits the model class it defines"
    assert "checkpoint" not in result.config["model"]


def test_readme_links_resolve():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert local and all((ROOT / link).exists() for link in local), [l for l in local if not (ROOT / l).exists()]


def test_public_names_are_listed_and_importable():
    import fcaudit as fca

    assert {"load", "windows", "audit", "controller_for", "Controller", "summarize", "FcauditError"} <= set(fca.__all__)
    for name in fca.__all__:  # each resolves to a real object, from a fresh attribute lookup
        assert getattr(fca, name) is not None, name
    assert callable(fca.audit) and fca.audit.__module__ == "fcaudit.auditor.driver"
