"""The set-up installs what the project tested: constraints.txt pins every dependency, and the environment the suite
runs in holds exactly those versions (`make test`); `make test-latest` runs the same suite on the newest releases."""

import os
import re
import tomllib
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import ROOT


def _locked() -> dict[str, str]:
    pins = re.findall(r"^([A-Za-z0-9_.-]+)==([^\s;]+)", (ROOT / "constraints.txt").read_text(), re.M)
    return {canonicalize_name(name): version for name, version in pins}


def _declared(extras: tuple[str, ...] | None = None) -> set[str]:
    """The dependencies pyproject.toml declares, with those of `extras` (None: every extra)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    chosen = project["optional-dependencies"] if extras is None else {e: project["optional-dependencies"][e]
                                                                       for e in extras}
    reqs = project["dependencies"] + [r for extra in chosen.values() for r in extra]
    return {canonicalize_name(Requirement(r).name) for r in reqs} - {"fcaudit"}


def test_the_lock_pins_every_declared_dependency_and_the_makefile_installs_with_it():
    locked = _locked()
    assert _declared() <= set(locked), sorted(_declared() - set(locked))
    makefile = (ROOT / "Makefile").read_text()
    installs = [line for line in makefile.splitlines() if "$(BIN)/pip install" in line and "uv" not in line]
    assert installs and all("-c $(LOCK)" in line for line in installs), installs


@pytest.mark.skipif(bool(os.environ.get("FCAUDIT_UNLOCKED")), reason="make test-latest: the newest releases")
def test_the_environment_holds_the_locked_versions():
    locked, wrong = _locked(), {}
    for dist in metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        version = dist.version.split("+")[0]  # torch's CPU build is 2.13.0+cpu
        if name in locked and version != locked[name]:
            wrong[name] = (version, locked[name])
    missing = sorted(n for n in _declared(("test", "hf", "docs")) if n not in {canonicalize_name(d.metadata["Name"])
                                                         for d in metadata.distributions()})
    assert not wrong and not missing, (f"installed, locked: {wrong}; not installed: {missing}; run `make setup` (or "
                                       "`pip install -c constraints.txt -e '.[test,hf,docs]'`)")
