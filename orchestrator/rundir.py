"""The run directory (docs/RUNDIR.md): creation, append-only JSONL logs, the summary."""

from __future__ import annotations

import json
import math
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from geofed.regions.checkpoint import write_bytes_atomic

from .config import RunConfig, to_mapping
from .strict import ConfigError


def new_run_dir(cfg: RunConfig, out: str | None) -> Path:
    if out:
        path = Path(out)
    else:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        path = Path(cfg.run.out_dir) / f"{cfg.run.name}-{stamp}"
    if (path / "rounds.jsonl").exists() or (path / "checkpoints").exists():
        raise ConfigError("", f"{path} already holds a run; use --resume {path} to continue it", source="--out")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError("", f"cannot create the run directory {path}: {exc.strerror}", source="--out") from None
    (path / "config.yaml").write_text(yaml.safe_dump(to_mapping(cfg), sort_keys=False))
    return path


def _clean(value: Any) -> Any:
    """JSON has no NaN/Infinity: write null so every reader can parse the logs."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class JsonlLog:
    """Append-only JSON lines, flushed per record so a killed driver loses at most a line."""

    def __init__(self, path: Path):
        self.path = path
        self._f = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(_clean(record), separators=(",", ":")) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a torn last line from a crash; everything before it is good
    return out


def truncate_jsonl(path: Path, keep: callable) -> None:
    """Rewrite `path` keeping records for which keep(record) is true (resume drops lost rounds)."""
    records = [r for r in read_jsonl(path) if keep(r)]
    write_bytes_atomic(path, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode())


def write_json(path: Path, data: dict[str, Any]) -> None:
    write_bytes_atomic(path, (json.dumps(_clean(data), indent=2) + "\n").encode())


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Clock:
    """Seconds since the run started; a resumed run continues from the time already spent."""

    def __init__(self, offset: float = 0.0):
        self._t0 = time.monotonic() - offset

    def now(self) -> float:
        return time.monotonic() - self._t0


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc; None elsewhere): `geofed run`'s start-up
    time includes the interpreter, imports and the config check that precede the Runner."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
