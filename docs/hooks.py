"""MkDocs hooks: the reference pages are generated at build time, so they cannot drift from the code.

- `<!-- cli-reference -->` becomes the Markdown of every `fcaudit` command, from the Typer app itself (typer's own
  docs generator, run in process: no PATH lookup of a `typer` executable).
- `<!-- api-reference -->` becomes one mkdocstrings block per name of `fcaudit.__all__` (the result objects among
  them), at the module where that name is defined now, plus the plan `fca.plan` returns.
"""

from __future__ import annotations

import inspect

CLI = "<!-- cli-reference -->"
API = "<!-- api-reference -->"
RETURNED = ("fcaudit.auditor.planner.AuditPlan",)
# classes whose page lists the methods they share with others (AuditResult's and FamilyResult's from Results)
INHERITED = ("fcaudit.auditor.results.AuditResult", "fcaudit.summary.FamilyResult")


def cli_markdown() -> str:
    import click
    import typer
    from typer.cli import get_docs_for_click

    from fcaudit.cli import app

    command = typer.main.get_command(app)
    return get_docs_for_click(obj=command, ctx=click.Context(command), name="fcaudit", indent=1)


def defined_at(name: str) -> str | None:
    """The dotted path mkdocstrings reads `fcaudit.<name>` from: the function or class, not the lazy re-export."""
    import fcaudit

    obj = getattr(fcaudit, name)
    if inspect.ismodule(obj) and callable(obj):  # fca.execution: a subpackage called as its function of that name
        obj = getattr(obj, name)
    if not (inspect.isclass(obj) or inspect.isfunction(obj)):
        return None
    return f"{obj.__module__}.{obj.__qualname__}"


def api_markdown() -> str:
    import fcaudit

    paths = [p for p in (defined_at(n) for n in fcaudit.__all__ if n != "__version__") if p]
    paths += [p for p in RETURNED if p not in paths]
    return "\n\n".join(f"::: {p}\n    options:\n      heading_level: 2"
                       + ("\n      inherited_members: true" if p in INHERITED else "") for p in paths) + "\n"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if CLI in markdown:
        markdown = markdown.replace(CLI, cli_markdown())
    if API in markdown:
        markdown = markdown.replace(API, api_markdown())
    return markdown
