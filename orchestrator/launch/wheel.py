"""The geofed wheel a launch plan ships: built from the checkout this geofed runs from, so that
every node installs exactly this code and never a name resolved on a package index."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from ..config.strict import ConfigError

KEY = "launch.setup.package"


def checkout_root() -> Path:
    """The source tree of the running geofed (pyproject.toml naming `geofed`); ConfigError when
    geofed is installed from a wheel (no tree to build from)."""
    import geofed.orchestrator as orch

    root = Path(orch.__file__).resolve().parents[1]
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file() or 'name = "geofed"' not in pyproject.read_text(encoding="utf-8"):
        raise ConfigError(KEY, f"geofed here is not installed from a checkout ({root} has no geofed pyproject.toml), "
                          "so no wheel can be built for the plan: set it to a wheel path or URL, or a git URL")
    return root


def build_wheel(out_dir: Path, name: str) -> Path:
    """Build the checkout's wheel into `out_dir` as `name`: offline with the build tools installed
    here, else with pip's isolated build (which fetches setuptools); ConfigError when neither works."""
    root = checkout_root()
    errors = []
    for isolation in (["--no-build-isolation"], []):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", *isolation, "-w", tmp, str(root)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            built = Path(tmp) / name
            if done.returncode == 0 and built.is_file():
                target = Path(out_dir) / name
                target.write_bytes(built.read_bytes())
                return target
            tail = (done.stderr.strip().splitlines() or ["no wheel named " + name])[-1]
            errors.append(f"pip wheel {' '.join(isolation) or '(isolated)'}: {tail}")
    raise ConfigError(KEY, f"could not build the geofed wheel from {root} ({'; '.join(errors)}); set it to a wheel "
                      "path or URL, or a git URL")
