"""The config a run was started with, and what `geofed run --resume` may change (docs/RUNDIR.md).

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
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import RunConfig, to_mapping
from ..driver.rundir import read_json_file, utc_now, write_json
from .strict import ConfigError, build

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
        from ..driver.rundir import write_config  # config.yaml now says what the run runs with

        history = list(record.get("changes") or [])
        if changes:
            history.append({"at": utc_now(), "keys": {k: list(v) for k, v in changes.items()}})
        write_config(run_dir, cfg, changes=history)
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
