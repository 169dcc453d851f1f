"""What produced a result: package versions and the git commit, recorded in every run directory."""

import platform
import subprocess
from functools import cache
from importlib import metadata
from pathlib import Path

_PACKAGES = ("fcaudit", "torch", "numpy", "scipy", "statsmodels", "pandas", "safetensors", "einops")


@cache
def git_hash() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True,
                             timeout=5)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


@cache
def _versions() -> tuple[tuple[str, str | None], ...]:
    """Looked up once per process (each lookup scans the installed distributions)."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return tuple(found.items())


def provenance() -> dict:
    return {"versions": dict(_versions()), "git_hash": git_hash()}
