"""Run the benchmarks and write docs/benchmarks.md: one current table, with the load each ran under.

    python docs/make_benchmarks.py [--only NAME ...] [--out docs/benchmarks.md]

`make bench` runs this. Each benchmark runs in its own process, one after the other; the table gives the lines of its
output that carry its result, the 1-minute load average before and after it, and its wall time; its whole output
follows the table. The page is rewritten whole each time: earlier runs live in git history
(`git log -p -- docs/benchmarks.md`). With `--only`, the named benchmarks are rerun and every other row, with its whole
output, is kept from the page as it was.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Bench:
    name: str
    what: str
    args: tuple[str, ...]
    result: str  # a regex: the output lines that carry the result (else the last line is shown)
    summary: Callable[[str], list[str]] | None = None  # instead of the regex, for output that is not lines


def moe_lines(output: str) -> list[str]:
    """moe_penalties.py prints one JSON document: a line per family with its penalties and replays."""
    families = json.JSONDecoder().raw_decode(output[output.index("{"):])[0]["families"]
    lines = []
    for name, f in families.items():
        pen = {f["labels"].get(c, c): v["mean"] for c, v in f["penalties"].items()}
        shown = ", ".join(f"{label} {mean:.3f}" for label, mean in pen.items())
        lines.append(f"{name}: {shown} nats; replay exact {f['replay']['passed']} (bf16 {f['replay_bf16']['passed']}),"
                     f" route flips {f['replay']['route_flips']}")
    return lines


ZOO_ROW = re.compile(r"^(\S+)\s+controller\s+(audited|refused|bug|not built)\s+[\d.]+s (.*)$")


def zoo_lines(output: str) -> list[str]:
    """hf_zoo.py prints a row per architecture, then its summary: the summary, then each row of an architecture with
    a controller (its kinds and replay, or its refusal cut to a line of the table)."""
    lines = output.splitlines()
    rows = [m.groups() for ln in lines if (m := ZOO_ROW.match(ln))]
    wall = next((i for i, ln in enumerate(lines) if ln.startswith("wall ")), None)
    if not rows or wall is None:
        raise ValueError("not the zoo's table")
    shown = [f"{name}: {text if status == 'audited' else f'{status}: {text[:110]}'}" for name, status, text in rows]
    return [ln.replace("`", "'") for ln in (lines[wall], *lines[wall + 1:], *shown)]  # each line is a code span


BENCHES = (
    Bench("forward_speed", "forward latency, batch 8, demo preset, as ratios to Dense",
          ("benchmarks/forward_speed.py", "--preset", "demo"), r"^\s+(variant|featuregate|uniform|layerstatic)\s"),
    Bench("train_speed", "training throughput and forward latency, as ratios to Dense",
          ("benchmarks/train_speed.py", "--threads", "1"), r"(featuregate|FeatureGate)"),
    Bench("audit_floor", "an audit against a bare loop of the same forward passes (64 + 64 windows, R = 20)",
          ("benchmarks/audit_floor.py",), r"(wall audit|split:)"),
    Bench("peers", "an audit beside the same audit in plain hooks, nnsight", ("benchmarks/peers.py",),
          r"/ |records:|passes:"),
    Bench("audit_memory", "peak resident memory above the start, by number of evaluation windows",
          ("benchmarks/audit_memory.py",), r"^\s*\d+\s"),
    Bench("shard_speed", "one audit at world size 1 and 2 (torchrun, gloo, CPU)",
          ("benchmarks/shard_speed.py",), r"\d\.\d\dx$"),
    Bench("sites_speed", "an audit of an op site (Controller.from_ops) against a bare loop of the same forward passes",
          ("benchmarks/sites_speed.py",), r"(median|min)"),
    Bench("moe_penalties", "briefly trained tiny Hugging Face MoEs through fca.controller_for + fca.audit",
          ("benchmarks/moe_penalties.py",), "", moe_lines),
    Bench("hf_zoo", "every causal LM of the installed transformers, tiny from its config, through `fcaudit audit DIR`",
          ("benchmarks/hf_zoo.py",), "", zoo_lines),
    Bench("hf_decode", "token-by-token decoding of every causal LM with a controller, tiny from its config",
          ("benchmarks/hf_decode.py",), r"(not measured|not built|other|architectures:)"),
)


# benchmarks/ scripts that `make bench` does not run (long, or for a GPU, or checks rather than timings)
OTHERS = ("dry_run_memory", "mix_speed", "compare_audits", "gpu_audit", "torch_modules")


def described(script: str) -> str:
    """The first paragraph of a benchmark script's docstring: how it measures, from the script itself."""
    path = ROOT / "benchmarks" / f"{script}.py"
    doc = ast.get_docstring(ast.parse(path.read_text())) if path.is_file() else None
    return " ".join((doc or "(no description)").split("\n\n")[0].split())


@dataclass
class Run:
    bench: Bench
    rc: int
    seconds: float
    load: tuple[float, float]
    output: str

    def result_lines(self) -> list[str]:
        if self.bench.summary is not None:
            try:
                return self.bench.summary(self.output)
            except (ValueError, KeyError, TypeError):
                pass  # output of another shape: show its lines as for any benchmark
        lines = [ln.rstrip() for ln in self.output.splitlines() if ln.strip()]
        picked = [ln.strip() for ln in lines if self.bench.result and re.search(self.bench.result, ln)]
        return (picked or lines[-1:])[:8]


def run(bench: Bench, python: str) -> Run:
    before = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run([python, *bench.args], cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    return Run(bench, proc.returncode, seconds, (before, os.getloadavg()[0]), proc.stdout + proc.stderr)


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def git_head() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


@dataclass
class Kept:
    """A benchmark's row and whole output as an earlier page has them (`--only` reruns the others)."""

    row: str
    output: list[str]


def kept(text: str) -> dict[str, Kept]:
    """The rows and whole-output sections of an earlier page, by benchmark name (not the rows it did not run)."""
    lines = text.splitlines()
    rows = {m.group(1): ln for ln in lines if (m := re.match(r"^\| `([^`]+)` \|", ln))}
    sections, name = {}, None
    for ln in lines:
        if m := re.match(r"^### (\S+)$", ln):
            name = m.group(1)
            sections[name] = []
        elif name is not None:
            sections[name].append(ln)
    return {n: Kept(row, sections.get(n, [])) for n, row in rows.items() if not row.endswith("| | |")}


def page(runs: list[Run], skipped: list[Bench], earlier: str = "") -> str:
    """The page: the rows of `runs`, in BENCHES order with those of `skipped` kept from the `earlier` page (where it
    has them)."""
    old = kept(earlier)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (f"Written by `make bench` (`docs/make_benchmarks.py`) at commit `{git_head()}`, {when}, on "
              f"{platform.machine()} with {os.cpu_count()} CPU cores and Python {platform.python_version()}. "
              "Each benchmark ran in its own process, one after the other; the load is the 1-minute load average "
              "before and after it. Earlier runs are in git history (`git log -p -- docs/benchmarks.md`).")
    if any(b.name in old for b in skipped):
        header += (f" This run reran {', '.join(f'`{r.bench.name}`' for r in runs)}; the other rows are kept from "
                   "the page as it was (when each ran: git history).")
    out = ["---", "hide:", "  - toc", "---", "", "# Benchmarks", "",  # no contents column: the table needs the width
           header, "", "| benchmark | what it measures | result | load | wall |", "|---|---|---|---|---|"]
    ran = {r.bench.name: r for r in runs}
    order = [*BENCHES, *(r.bench for r in runs if r.bench not in BENCHES)]
    for b in order:
        if (r := ran.get(b.name)) is not None:
            result = "<br>".join(f"`{cell(ln)}`" for ln in r.result_lines()) if r.rc == 0 else f"failed (exit {r.rc})"
            out.append(f"| `{b.name}` | {b.what} | {result} | {r.load[0]:.2f} → {r.load[1]:.2f} | {r.seconds:.0f} s |")
        elif b in skipped:
            out.append(old[b.name].row if b.name in old
                       else f"| `{b.name}` | {b.what} | not run in this table's run (`make bench` runs it) | | |")
    out += ["", "## How each is measured", "",
            *[f"- `{b.name}.py`: {described(b.name)}" for b in BENCHES], "",
            "Other scripts in `benchmarks/`, not run by `make bench`:", "",
            *[f"- `{name}.py`: {described(name)}" for name in OTHERS]]
    out += ["", "## Whole outputs", ""]
    for b in order:
        if (r := ran.get(b.name)) is not None:
            out += [f"### {b.name}", "", f"`python {' '.join(b.args)}` (exit {r.rc})", "", "```text",
                    *[ln.rstrip() for ln in r.output.strip().splitlines()[-40:]], "```", ""]
        elif b in skipped and b.name in old:
            out += [f"### {b.name}", *old[b.name].output, *([""] if old[b.name].output[-1:] != [""] else [])]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=[b.name for b in BENCHES], help="run only these")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    args = p.parse_args(argv)
    chosen = [b for b in BENCHES if not args.only or b.name in args.only]
    runs = []
    for b in chosen:
        print(f"{b.name} ...", flush=True)
        runs.append(run(b, sys.executable))
        print(f"  exit {runs[-1].rc}, {runs[-1].seconds:.0f} s", flush=True)
    earlier = Path(args.out).read_text() if args.only and Path(args.out).is_file() else ""
    Path(args.out).write_text(page(runs, [b for b in BENCHES if b not in chosen], earlier))
    print(f"wrote {args.out}")
    if any(r.rc for r in runs):
        sys.exit(1)


if __name__ == "__main__":
    main()
