"""The documentation is tested like code: every code block of the README and the docs pages runs, the site builds in
strict mode (a broken link or API reference fails), and the troubleshooting page quotes messages the code has.

A page's blocks run in order in one fresh directory: Python blocks share one namespace; a bash block of plain
`fcaudit` lines runs them through the CLI's Typer app in this process, any other runs in bash with `fcaudit`,
`python` and `torchrun` on PATH (conftest.run_bash). A block that cannot run here (it installs packages, needs the hub
or a GPU, or takes minutes) says why on the line before it: `<!-- not run: REASON -->`. ```text blocks are
outputs and are not run.
"""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest

from conftest import DOCS, NOT_CODE, PAGES, ROOT, RUN, blocks, fcaudit_args, run_bash, run_page, shims


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_is_run_or_says_why_not(page):
    for b in blocks(page):
        assert b.lang in RUN | NOT_CODE, f"{page.name}:{b.line}: fence '{b.lang}' is neither run nor an output"
        assert not (b.skip and b.lang in NOT_CODE), f"{page.name}:{b.line}: an output needs no not-run marker"
        if b.skip:
            assert len(b.skip) > 10, f"{page.name}:{b.line}: say why the block is not run"


# The sharding page runs torchrun: slow, like the other torchrun tests (test_sharding's two-rank audit is the smoke
# test)
SLOW_PAGES = {"sharding.md"}


@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW_PAGES else p
                                  for p in PAGES if p.name != "README.md" and any(
                                      not b.skip and b.lang in RUN for b in blocks(p))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_page_code_runs(page, tmp_path, monkeypatch):
    run_page(page, tmp_path, monkeypatch)


def test_runner_takes_only_plain_fcaudit_lines_in_process(tmp_path, monkeypatch):
    """What a shell would read otherwise (a pipe, a variable, a glob, an env prefix, a quote left open, another
    program) goes to bash; an fcaudit line that fails in process fails the page with its error line."""
    assert fcaudit_args("fcaudit audit runs/a --out 'my dir'  # why") == ["audit", "runs/a", "--out", "my dir"]
    for line in ("fcaudit audit a | tee log", "fcaudit audit $RUN", "fcaudit report runs/*", "X=1 fcaudit audit a",
                 "fcaudit audit a && echo ok", "fcaudit audit 'a", "fcaudit audit a#b", "torchrun -m fcaudit audit a"):
        assert fcaudit_args(line) is None, line
    monkeypatch.chdir(tmp_path)
    env = shims(tmp_path / ".bin")
    run_bash("fcaudit --help | grep 'Frozen-Controller Auditing' >/dev/null", tmp_path, env, "piped")  # in bash
    with pytest.raises(AssertionError, match="no checkpoint directory nowhere"):
        run_bash("fcaudit --help\nfcaudit audit nowhere --out a", tmp_path, env, "failing")


def test_docs_site_builds_strict(tmp_path, monkeypatch, caplog):
    """`mkdocs build --strict`, in this process (fcaudit, which the hooks import, is loaded already)."""
    missing = [m for m in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")
               if importlib.util.find_spec(m.split(".")[0]) is None
               or (m.count(".") and importlib.util.find_spec(m) is None)]
    if missing:
        pytest.skip(f"the docs extra is not installed ({', '.join(missing)}): pip install -e '.[docs]'")
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort

    monkeypatch.chdir(tmp_path)
    try:
        build(load_config(str(ROOT / "mkdocs.yml"), strict=True, site_dir=str(tmp_path / "site")))
    except Abort as e:  # strict: any warning (a broken link, an API name mkdocstrings cannot find) stops the build
        pytest.fail(f"{e}\n{caplog.text[-5000:]}")
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    import fcaudit

    for name in set(fcaudit.__all__) - {"__version__"}:
        assert re.search(rf'id="fcaudit\.[\w.]*\b{name}"', api), f"the API reference lacks {name}"
    for command in ("train", "audit", "summarize", "execution", "report", "demo"):
        assert f"fcaudit {command}" in cli, f"the CLI reference lacks `fcaudit {command}`"
    assert "api-reference" not in api and "cli-reference" not in cli


def source_text() -> str:
    return "\n".join(p.read_text() for p in sorted((ROOT / "src" / "fcaudit").rglob("*.py")))


def test_troubleshooting_quotes_messages_the_code_has():
    """Each quoted message start on the troubleshooting page (the table's first column) is text of an FcauditError
    in the source, so the page follows the code: a reworded message fails here until the page says it too."""
    page = (DOCS / "troubleshooting.md").read_text()
    quoted = re.findall(r"^\| `([^`]+)`", page, flags=re.M)
    assert len(quoted) >= 30
    src = source_text()
    missing = [q for q in quoted if not all(part in src for part in q.split("…") if part.strip())]
    assert not missing, f"messages on the troubleshooting page that the source no longer has: {missing}"


def test_benchmarks_page_is_the_table_make_bench_writes(tmp_path):
    """docs/make_benchmarks.py writes one table, with each run's load and its whole output below (here with a stand-in
    benchmark that prints a result line)."""
    sys.path.insert(0, str(DOCS))
    try:
        import make_benchmarks as mb
    finally:
        sys.path.remove(str(DOCS))
    fake = mb.Bench("fake", "a stand-in", ("-c", "print('header'); print('  featuregate 1.5 x Dense')"),
                    r"featuregate")
    run = mb.run(fake, sys.executable)
    text = mb.page([run], [mb.BENCHES[0]])
    assert run.rc == 0 and run.result_lines() == ["featuregate 1.5 x Dense"]
    assert "| `fake` | a stand-in | `featuregate 1.5 x Dense` |" in text
    assert "not run in this table's run" in text and "## Whole outputs" in text
    # the page in the docs is that table: make bench's header and a row for each benchmark it runs, in its order
    table = [line for line in (DOCS / "benchmarks.md").read_text().splitlines() if line.startswith("| ")]
    assert table[0] == next(line for line in text.splitlines() if line.startswith("| "))
    assert [row.split("`")[1] for row in table[1:]] == [b.name for b in mb.BENCHES]


def test_make_benchmarks_only_reruns_the_named_and_keeps_every_other_row_and_output(tmp_path, monkeypatch):
    """`--only NAME` reruns that benchmark; the other rows of the page, with their whole outputs, stay as they were."""
    sys.path.insert(0, str(DOCS))
    try:
        import make_benchmarks as mb
    finally:
        sys.path.remove(str(DOCS))
    first, second = mb.BENCHES[0], mb.BENCHES[1]
    outputs = {first.name: "old result line\n", second.name: "new result line\n"}
    monkeypatch.setattr(mb, "run", lambda b, python: mb.Run(b, 0, 1.0, (0.5, 0.5), outputs.get(b.name, "x\n")))
    page = tmp_path / "benchmarks.md"
    mb.main(["--only", first.name, second.name, "--out", str(page)])
    outputs = {first.name: "changed\n", second.name: "newer result line\n"}
    mb.main(["--only", second.name, "--out", str(page)])
    text = page.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == [b.name for b in mb.BENCHES]
    assert "`old result line`" in rows[0] and "`newer result line`" in rows[1] and "changed" not in text
    assert "not run in this table's run" in rows[2]
    outputs_part = text.split("## Whole outputs")[1]
    assert outputs_part.index(f"### {first.name}") < outputs_part.index("old result line") < outputs_part.index(
        f"### {second.name}") < outputs_part.index("newer result line")
    assert f"This run reran `{second.name}`; the other rows are kept" in text


def documented() -> list:
    """The objects whose docstrings are the API reference: the names of `fcaudit.__all__` (a module's member of that
    name where a name is a module), and the methods AuditResult and FamilyResult share (`Results`)."""
    import fcaudit as fca
    from fcaudit.stats.results import Results

    objects = []
    for name in sorted(set(fca.__all__) - {"__version__"}):
        obj = getattr(fca, name)
        objects.append(getattr(obj, name, obj) if isinstance(obj, type(fca)) else obj)
    return objects + [Results]


# Examples that continue another name's (as the reference page says in each): they use what that one built. The
# audit's example builds the model, windows and `result` the results' examples read; load's trains the checkpoint
# controller_for reads; Family's builds the family register registers.
CONTINUES = {name: "audit" for name in ("AuditResult", "plan", "summarize", "build_report", "PenaltiesResult",
                                        "FactorEffectsResult", "RetentionResult", "VariationResult", "Replay", "Finding", "Results",
                                        "FamilyResult", "Summary")}
CONTINUES |= {"controller_for": "load", "register": "Family", "execution": "audit", "ExecutionResult": "audit"}


def test_docstring_examples_run(tmp_path, monkeypatch):
    """The examples in the public names' docstrings (`>>>`, scipy's style) run as doctests, in a fresh directory with
    `fca`, `torch` and `nn` imported. A class's examples and its methods' share one namespace, the class's first
    (as the reference page shows them), so a method's example uses what the class example built; CONTINUES names
    the examples that continue another name's."""
    import doctest

    import torch

    import fcaudit as fca

    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS
                                                                    | doctest.NORMALIZE_WHITESPACE)
    namespaces: dict[str, dict] = {}
    tests = []
    for obj in sorted(documented(), key=lambda o: o.__name__ in CONTINUES):  # what others continue runs first
        name = obj.__name__
        globs = namespaces.setdefault(CONTINUES.get(name, name), {"fca": fca, "torch": torch, "nn": torch.nn})
        for t in finder.find(obj, globs={}):  # sorted by name: the class's own docstring first
            if t.examples:
                t.globs = globs
                tests.append(t)
    missing = [obj.__name__ for obj in documented() if not any(t.name.split(".")[0] == obj.__name__ for t in tests)]
    assert not missing, f"public names without a docstring example: {missing}"
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    for t in tests:
        runner.run(t, clear_globs=False)
    assert runner.failures == 0, f"{runner.failures} docstring example(s) failed (see the output above)"
