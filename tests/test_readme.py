"""The README is a newcomer's whole path: short, its quick start an audit of a model defined right there (no training
run, no checkpoint) in at most 20 lines, every code block run (tests/test_docs.py's runner), every link alive."""

import re

from conftest import ROOT, blocks, run_page

README = ROOT / "README.md"


def test_readme_is_short_and_its_quick_start_fits_in_20_lines():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    python = [b for b in blocks(README) if b.lang == "python"]
    assert len(python) == 1, "one Python example in the README: the quick start"
    code = python[0].code
    assert len(code.splitlines()) <= 20
    assert "class " in code and "nn.Module" in code, "the quick start defines its own model"
    assert "fca.load" not in code and "fcaudit train" not in code, "no checkpoint, no training run"
    for needed in ("make demo", "make test", "pip install -e .", "pip install -e '.[hf]'", "the full demo took"):
        assert needed in text


def test_readme_code_runs(tmp_path, monkeypatch):
    """The quick start and the CLI lines run as written, in a fresh directory."""
    scope = run_page(README, tmp_path, monkeypatch)
    result = scope["result"]
    assert result.replay.passed and result.replay.max_abs_dlogit == 0
    assert (tmp_path / "audits" / "my-lm" / "replay.json").is_file()
    assert set(result.penalties().names) >= {"CrossInput", "TokenShuffle", "StaticProfile", "StructureRemoved"}
    assert (tmp_path / "report" / "report.html").is_file()


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
