"""The run directory (docs/RUNDIR.md): creation, append-only JSONL logs, the summary, and the
config record a resume is checked against. Everything in it is its owner's alone: folders 0700,
files 0600.

The config record: The config a run was started with, and what `geofed run --resume` may change (docs/RUNDIR.md).

A run directory can be handed to you, and its config.yaml edited before a resume: `security.tls:
false` would resume in plaintext, a changed model size fails deep inside checkpoint loading. So
the run records its resolved config and the SHA-256 of config.yaml when it starts
(RUN_DIR/config.record.json), and a resume compares: an edited config.yaml, or a `--set`, that
changes a key is refused (exit 2) with the difference by dotted key, unless the operator names
the key with `--allow-config-change KEY` and the key is one that may change mid-run
(SAFE_ON_RESUME). Keys that change what is trained, how regions talk or how they are secured
never change on resume; `security.*` in particular (TLS cannot be turned off).

Anyone who can write the run directory can rewrite the record too; the record stops silent
changes (an edit, a copy from another run, a stray --set), not its owner.
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import json
import math
import os
import secrets
import time
import unicodedata
from datetime import datetime, timezone
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from geofed.regions.checkpoint import PRIVATE_DIR, PRIVATE_FILE, make_private_dirs, read_bounded, write_bytes_atomic
from geofed.regions.inputfiles import InputFileError

from ..config import RunConfig, to_mapping
from ..config.strict import ConfigError, build, parse_yaml_file


def new_run_dir(cfg: RunConfig, out: str | None) -> Path:
    """Create the run directory (0700) and write its config.yaml and config record (0600).

    From the config (run.out_dir) it must be a real folder inside the working directory: no
    component may be a symbolic link (a config may be someone else's file). With --out the
    operator chose the place; only the run directory itself must not be a link."""
    if out:
        key, path = "--out", Path(out)
        check_printable(out, key)
    else:
        key = "run.out_dir"
        check_printable(cfg.run.out_dir, key)
        _refuse_links(Path(cfg.run.out_dir), key)
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        # Two runs started in the same second must not share a directory.
        path = Path(cfg.run.out_dir) / f"{cfg.run.name}-{stamp}-{secrets.token_hex(2)}"
    if path.is_symlink():
        raise ConfigError(key, f"{path} is a symbolic link; a run directory is never reached through one")
    if path.is_dir():
        lock_run_dir(path, key=key)  # a run in progress there is named before anything else is said
    if (path / "rounds.jsonl").exists() or (path / "checkpoints").exists():
        release_run_dir(path)
        raise ConfigError("", f"{path} already holds a run; use --resume {path} to continue it", source=key)
    try:
        make_private_dirs(path.parent)
        os.mkdir(path, PRIVATE_DIR)
    except FileExistsError:
        if path.is_symlink() or not path.is_dir():  # made meanwhile, or a file
            raise ConfigError(key, f"{path} exists and is not a directory") from None
        os.chmod(path, PRIVATE_DIR)  # an existing empty folder given with --out becomes the run's
    except OSError as exc:
        raise ConfigError("", f"cannot create the run directory {path}: {exc.strerror}", source=key) from None
    lock_run_dir(path, key=key)  # before config.yaml: a second run must not overwrite the first's
    write_config(path, cfg)
    return path


LOCK_FILE = "run.lock"
_held: dict[Path, int] = {}  # run directory (resolved) -> the fd holding its lock, in this process


def lock_run_dir(run_dir: Path, *, key: str = "run directory") -> None:
    """Hold RUN_DIR/run.lock (fcntl.flock, exclusive) until release_run_dir or this process ends,
    so two drivers never interleave one run directory's files. Idempotent within a process.
    ConfigError (exit 2) at once, naming the holder's pid, when another process holds it."""
    where = Path(run_dir).resolve()
    if where in _held:
        return
    path = where / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, PRIVATE_FILE)
    except OSError as exc:
        raise ConfigError("", f"cannot open the run lock {path}: {exc.strerror}", source=key) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError("", f"{run_dir} is in use by another geofed run (pid {holder}, holding {LOCK_FILE}); "
                          "wait for it to end or stop it, or choose another run directory", source=key) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[where] = fd


def release_run_dir(run_dir: Path) -> None:
    """Give up the run lock taken by lock_run_dir (no-op when this process does not hold it)."""
    fd = _held.pop(Path(run_dir).resolve(), None)
    if fd is not None:
        os.close(fd)  # closing the file releases the flock; the file stays (its pid is stale, harmless)


def ensure_private_dir(path: Path) -> None:
    """The run directory exists and is 0700 (a Runner started without new_run_dir, or a run
    directory written before the modes were tightened)."""
    make_private_dirs(path)
    if not Path(path).is_symlink():
        os.chmod(path, PRIVATE_DIR)


def check_printable(text: str, key: str) -> None:
    """Control characters (a newline, an escape) in a path would corrupt logs and terminals."""
    bad = next((c for c in text if unicodedata.category(c) == "Cc"), None)
    if bad is not None:
        raise ConfigError(key, f"{text!r} holds the control character U+{ord(bad):04X}; names must be printable")


def _refuse_links(out_dir: Path, key: str) -> None:
    here = Path(".")
    for part in out_dir.parts:
        here = here / part
        if here.is_symlink():
            raise ConfigError(key, f"{here} is a symbolic link (to {os.readlink(here)}); a config may only name a "
                              "real folder inside the working directory; use --out DIR to write elsewhere")


def write_config(run_dir: Path, cfg: RunConfig, *, changes: list | None = None) -> None:
    """config.yaml and the record --resume checks it against (below)."""
    text = yaml.safe_dump(to_mapping(cfg), sort_keys=False).encode()
    write_bytes_atomic(Path(run_dir) / "config.yaml", text)
    write_record(run_dir, cfg, text, changes=changes)


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
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, PRIVATE_FILE)
        os.fchmod(fd, PRIVATE_FILE)  # a log of a run directory written before the modes were tightened
        self._f = open(fd, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(_clean(record), separators=(",", ":")) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


MAX_LOG_BYTES = 1 << 30  # a log line is a few KiB a round and region: 1 GiB is ~100k rounds of 4 regions


def read_run_file(path: Path, *, limit: int) -> bytes:
    """A run directory's file, read as data (a run directory can be someone else's): a regular file
    only (a FIFO would block, /dev/zero never ends), at most `limit` bytes. ConfigError names it."""
    try:
        return read_bounded(Path(path), max_bytes=limit)
    except InputFileError as exc:
        raise ConfigError("", exc.reason, source=str(path)) from None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSON lines file, up to a torn last line (a crash's); [] when the file is missing.
    ConfigError when it is not a regular file or holds more than MAX_LOG_BYTES."""
    if not path.exists() and not path.is_symlink():
        return []
    out = []
    for i, line in enumerate(read_run_file(path, limit=MAX_LOG_BYTES).splitlines(), start=1):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # JSON, UTF-8 (a character cut in two), 100000 brackets
            break  # a torn last line from a crash; everything before it is good
        if not isinstance(record, dict):
            raise ConfigError("", f"line {i}: expected a JSON object, got {type(record).__name__}", source=str(path))
        out.append(record)
    return out


def truncate_jsonl(path: Path, keep: callable) -> None:
    """Rewrite `path` keeping records for which keep(record) is true (resume drops lost rounds)."""
    records = [r for r in read_jsonl(path) if keep(r)]
    write_bytes_atomic(path, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode())


def read_json_file(path: Path, *, limit: int = 4 << 20) -> Any:
    """A small JSON file the run wrote (None when it is missing); ConfigError when it is not a
    regular file, too large or not JSON (a run directory may be someone else's)."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return None
    try:
        return json.loads(read_bounded(path, max_bytes=limit))
    except InputFileError as exc:
        raise ConfigError("", exc.reason, source=str(path)) from None
    except ValueError as exc:
        raise ConfigError("", f"not JSON: {exc}", source=str(path)) from None
    except RecursionError:  # json.loads recurses: 100000 nested brackets
        raise ConfigError("", "not JSON: nested too deep", source=str(path)) from None


def run_dir_config(run_dir: Path) -> RunConfig:
    """RUN_DIR/config.yaml as a RunConfig, read as data: the strict, bounded YAML loader, and a
    plug-in task it names is neither imported nor looked up (``export``, ``report``, ``watch``
    and ``--resume`` never run code a run directory names). ConfigError names the file."""
    path = Path(run_dir) / "config.yaml"
    if not path.exists() and not path.is_symlink():
        raise ConfigError("", "not a run directory (no config.yaml)", source=str(run_dir))
    data = parse_yaml_file(path)
    try:
        return build(RunConfig, data)
    except ConfigError as exc:
        raise exc.with_source(str(path)) from None


def output_dir(run_dir: Path, name: str, *, mode: int = PRIVATE_DIR) -> Path:
    """RUN_DIR/name for what export and report write, made with `mode` when missing; ConfigError
    when it is a symbolic link (or not a folder): whoever planted the link would choose where our
    files go."""
    path = Path(run_dir) / name
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError("", f"cannot create {name}/: {exc.strerror}", source=str(run_dir)) from None
    if path.is_symlink():
        raise ConfigError("", f"{name} is a symbolic link (to {os.readlink(path)}); nothing is written through "
                          "links inside a run directory: remove it, or name the output with --out", source=str(path))
    if not path.is_dir():
        raise ConfigError("", "exists and is not a directory", source=str(path))
    return path


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write `data` as JSON atomically and privately (NaN and infinities become null)."""
    write_bytes_atomic(path, (json.dumps(_clean(data), indent=2) + "\n").encode())


def utc_now() -> str:
    """The current UTC time, ISO 8601 to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Clock:
    """Seconds since the run started; a resumed run continues from the time already spent."""

    def __init__(self, offset: float = 0.0):
        self._t0 = time.monotonic() - offset

    def restart(self, offset: float = 0.0) -> None:
        """From `offset` seconds now: round 0 after set-up, or a resume's time already spent. In
        place, so the coordinator and the event log that hold this clock read the same time."""
        self._t0 = time.monotonic() - offset

    def now(self) -> float:
        return time.monotonic() - self._t0


# ---- the config record (what --resume may change) ----------------------------------------
RECORD_FILE = "config.record.json"

# Keys a resume may change when the operator names them: they bound or observe the run, they do
# not change the model, the data, the exchange or its security.
SAFE_ON_RESUME: dict[str, str] = {
    "run.rounds": "run longer or stop sooner",
    "run.max_steps": "the step budget",
    "run.target": "when to stop (metric and value)",
    "run.eval_every": "how often to evaluate",
    "run.checkpoint_every": "how often to checkpoint",
    "run.keep_checkpoints": "how many checkpoints to keep",
    "run.report": "whether to write report.html",
    "run.trackers": "which experiment trackers get the rounds from now on",
    "run.on_region_failure": "elastic or fail-fast from now on",
    "regions.start_timeout_s": "patience while actors start",
    "regions.placement_timeout_s": "patience while nodes join",
    "regions.heartbeat_timeout_s": "when an unresponsive region is left out",
    "ray.address": "which Ray cluster runs the resumed run",
    "ray.num_cpus": "the size of a local Ray",
    "ray.init_timeout_s": "patience while Ray starts",
    "run.orphan_timeout_s": "how long the regions outlive a driver that dies, from this driver on",
}
NEVER_ON_RESUME = ("security.",)  # TLS cannot be turned off, nor message checks loosened, mid-run


def sha256(data: bytes) -> str:
    """Hex SHA-256 of `data` (the config file's bytes, as the record keeps them)."""
    return hashlib.sha256(data).hexdigest()


def write_record(run_dir: Path, cfg: RunConfig, config_yaml: bytes, *, changes: list | None = None) -> None:
    """Write RUN_DIR/config.record.json: the config file's hash, the parsed config, and the keys
    changed by resumes so far.
    """
    write_json(Path(run_dir) / RECORD_FILE, {"sha256": sha256(config_yaml), "config": _plain(cfg),
                                             "changes": changes or []})


def check_allowed_keys(allow: Sequence[str]) -> None:
    """Every key named with --allow-config-change must be one that may change on resume."""
    for key in allow:
        if key.startswith(NEVER_ON_RESUME):
            raise ConfigError(key, "never changes on resume (TLS cannot be turned off, nor message checks loosened, "
                              "mid-run); start a new run to change it", source="--allow-config-change")
        if key not in SAFE_ON_RESUME:
            raise ConfigError(key, f"is not a key a resume may change (those that may: {', '.join(SAFE_ON_RESUME)})",
                              source="--allow-config-change")


def check_resume(run_dir: Path, config_yaml: bytes, file_cfg: RunConfig, cfg: RunConfig,
                 allow: Sequence[str]) -> dict[str, tuple[Any, Any]]:
    """The changes (dotted key -> (recorded, now)) of the resumed config against the record;
    ConfigError listing them when one is not allowed. `file_cfg` is config.yaml alone, `cfg`
    with the --set overrides."""
    check_allowed_keys(allow)
    run_dir = Path(run_dir)
    path = run_dir / RECORD_FILE
    record = read_json_file(path)
    if record is None:
        raise ConfigError("", f"{path} is missing or unreadable: without the run's record of its config, "
                          "a resume cannot tell whether config.yaml was edited; start a new run",
                          source=str(run_dir / "config.yaml"))
    if not isinstance(record.get("config"), dict) or not isinstance(record.get("sha256"), str):
        raise ConfigError("", "not a config record (needs sha256 and config)", source=str(path))
    try:  # built, not looked up: a plug-in the record names is not imported (a run directory is data)
        recorded = build(RunConfig, copy.deepcopy(record["config"]))
    except ConfigError as exc:
        raise exc.with_source(str(path)) from None
    changes = diff(_plain(recorded), _plain(cfg))
    edited = diff(_plain(recorded), _plain(file_cfg))
    refused = [k for k in changes if not any(k == a or k.startswith(a + ".") for a in allow)]
    if refused:
        lines = [f"{k}: {_show(changes[k][0])} -> {_show(changes[k][1])}"
                 f" ({'config.yaml' if k in edited else '--set'}"
                 f"{'; never changes on resume' if k.startswith(NEVER_ON_RESUME) else ''})" for k in sorted(changes)]
        safe = [k for k in refused if k in SAFE_ON_RESUME]
        hint = (f"To accept, name the key: --allow-config-change {' '.join(safe)}" if safe and len(safe) == len(refused)
                else f"A resume continues the run as it started; keys that may change with --allow-config-change: "
                     f"{', '.join(SAFE_ON_RESUME)}")
        # One line (ConfigError's rule), the changes in key order: "key: old -> new (where)".
        raise ConfigError("", f"differs from the run's record ({RECORD_FILE}, sha256 {record['sha256'][:12]}; "
                          f"config.yaml now {sha256(config_yaml)[:12]}): " + "; ".join(lines) + f". {hint}",
                          source=str(run_dir / "config.yaml"))
    if changes or sha256(config_yaml) != record["sha256"]:
        history = list(record.get("changes") or [])
        if changes:
            history.append({"at": utc_now(), "keys": {k: list(v) for k, v in changes.items()}})
        write_config(run_dir, cfg, changes=history)  # config.yaml now says what the run runs with
    return changes


def diff(old: Any, new: Any, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (old, new) for every leaf that differs; lists compare whole."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: dict[str, tuple[Any, Any]] = {}
        for k in list(old) + [k for k in new if k not in old]:
            out.update(diff(old.get(k), new.get(k), f"{prefix}{k}."))
        return out
    return {} if old == new else {prefix[:-1]: (old, new)}


def _plain(cfg: RunConfig) -> Any:
    return json.loads(json.dumps(to_mapping(cfg)))  # tuples as lists, as the record holds them


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."
