"""The size of src/: lines by kind (code, docstring, comment, blank), and by the merge that last touched them.

The second table is `git blame` of every line of src/, each line credited to the merge into the first-parent history
that brought its last change (a branch name), to "since BASE" for a commit made on the main line, or to "BASE" when
it is unchanged since BASE. It shows how much of today's code dates from work on one concern (a feature branch) and
how much is older code. Blame credits a line to its last change, so a feature branch that reformatted an old line
owns it: read the split as approximate.
Usage: python benchmarks/code_size.py [--base 1821d22] [--by-file]
"""

from __future__ import annotations

import argparse
import ast
import collections
import io
import re
import subprocess
import tokenize
from pathlib import Path


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def kinds(source: str) -> collections.Counter:
    """Lines of one module by kind: a docstring of a module, class or function; a comment line; blank; code."""
    doc = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body and \
                isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
                isinstance(body[0].value.value, str):
            doc.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = source.splitlines()
    comments = {t.start[0] for t in tokenize.generate_tokens(io.StringIO(source).readline)
                if t.type == tokenize.COMMENT and lines[t.start[0] - 1].lstrip().startswith("#")}
    return collections.Counter("blank" if not line.strip() else "docstring" if i in doc else
                               "comment" if i in comments else "code" for i, line in enumerate(lines, 1))


def owners(base: str) -> dict[str, str]:
    """Each commit since `base` -> the merge branch that brought it into the first-parent history."""
    out: dict[str, str] = {}
    for line in git("log", "--first-parent", "--format=%H %P|%s", f"{base}..HEAD").splitlines():
        hashes, subject = line.split("|", 1)
        commit, *parents = hashes.split()
        if len(parents) > 1:
            name = re.search(r"Merge (?:branch )?'?([\w./-]+)", subject)
            name = name.group(1) if name else "a merge"
            for c in [commit, *git("rev-list", f"{parents[0]}..{parents[1]}").split()]:
                out.setdefault(c, name)
        else:
            out.setdefault(commit, f"since {base}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="1821d22")
    p.add_argument("--by-file", action="store_true")
    a = p.parse_args()
    files = [f for f in git("ls-files", "src").split() if f.endswith((".py", ".cpp"))]
    total = collections.Counter()
    for f in files:
        counted = kinds(Path(f).read_text()) if f.endswith(".py") else collections.Counter(
            code=len(Path(f).read_text().splitlines()))
        total += counted
        if a.by_file:
            print(f"{sum(counted.values()):6d}  {f}")
    print(f"src/ now: {sum(total.values())} lines: " + ", ".join(f"{k} {total[k]}" for k in
                                                                 ("code", "docstring", "comment", "blank")))
    base_files = [f for f in git("ls-tree", "-r", "--name-only", a.base, "src").split() if f.endswith((".py", ".cpp"))]
    print(f"src/ at {a.base}: {sum(len(git('show', f'{a.base}:{f}').splitlines()) for f in base_files)} lines")
    old, owner, by = set(git("rev-list", a.base).split()), owners(a.base), collections.Counter()
    for f in files:
        for line in git("blame", "--line-porcelain", f).splitlines():
            if re.match(r"[0-9a-f]{40} ", line):
                commit = line.split()[0]
                by[a.base if commit in old else owner.get(commit, "?")] += 1
    print("last changed by:")
    for name, n in by.most_common():
        print(f"{n:6d}  {name}")


if __name__ == "__main__":
    main()
