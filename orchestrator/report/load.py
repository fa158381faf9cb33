"""Read a run directory (docs/RUNDIR.md) into plain Python data for the plots and the HTML.

Only the presence of at least one of the run's record files is required: a run still in
progress has no summary.json yet, a run without evaluation has no ``eval``, a run without
emulation has no ``configured_*``; all of those still make a report. What is present must be
well formed: a line that is not JSON, or a ``round`` that is not an integer, is a bug in the
writer or a damaged file, and the error names the file, the line and the key.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geofed.regions.algorithm_traits import TRAITS, AlgorithmTraits
from geofed.regions.checkpoint import read_bounded
from geofed.regions.inputfiles import InputFileError

from ..config.strict import ConfigError, parse_yaml_file

RECORD_FILES = ("metrics.jsonl", "rounds.jsonl", "summary.json")
# The containers the report walks (.items(), .get(), iteration), by file: a run directory can be
# someone else's, and a list where a mapping belongs was an AttributeError traceback. null is
# allowed (the report reads it as absent).
SHAPES = {
    "metrics.jsonl": {"codecs": dict, "eval": dict, "transfers": list, "links": dict, "refusals": dict},
    "rounds.jsonl": {"codecs": dict, "links": dict, "eval_avg": dict, "evals_earlier": list, "alive": list},
    "summary.json": {"config": dict, "eval": dict, "target": dict, "faults": dict, "refusals": dict, "links": dict,
                     "utilization_per_region": dict, "eval_per_region": dict, "placement": dict, "egress": dict,
                     "interrupted": dict, "reports": dict},
}
_NESTED = {("refusals", "by_reason"): dict, ("refusals", "clipped"): dict}
MAX_LINE_BYTES = 16 << 20  # one round of one region is a few KiB; a huge line is a damaged file
MAX_LOG_BYTES = 1 << 30  # a log file: ~100k rounds of 4 regions (orchestrator/driver/rundir.py's cap)
MAX_JSON_BYTES = 64 << 20  # summary.json: the run's totals, a few KiB to a few MiB with many links


class RunDirError(ConfigError):
    """RUN_DIR is not a readable run directory. A ConfigError, so `geofed` exits 2 on it."""

    def __init__(self, run_dir: str | Path, message: str):
        super().__init__("", message, source=str(run_dir))


@dataclass(frozen=True)
class RoundRow:
    """One round as the report sees it: from rounds.jsonl, filled in from metrics.jsonl."""

    round: int
    t_start: float | None
    t_end: float | None
    H: float | None
    codecs: dict[str, str]
    reason: str
    mean_train_loss: float | None
    utilization: float | None
    bytes_sent: float  # this round's bytes, all regions
    consensus_distance: float | None
    links: dict[str, dict[str, float]]
    # The run's evaluation of its synchronised (gossip: averaged) model, what summary.json reports;
    # with overlap it is of an earlier round (eval_round) and was made at eval_t.
    eval_metric: str | None = None
    eval_value: float | None = None
    eval_round: int | None = None
    eval_t: float | None = None
    # Evaluations of earlier rounds' models reported in this round too (a flush under overlap):
    # (eval_round, value, eval_t) each.
    evals_earlier: tuple[tuple[int, float, float | None], ...] = ()


@dataclass
class Run:
    """A run directory read back for the report: config, summary, metrics, rounds and events, with
    warnings for what was missing or torn (a run may still be going, or have crashed).
    """

    path: Path
    name: str
    config: dict[str, Any]
    summary: dict[str, Any]
    metrics: list[dict[str, Any]]  # one per (round, region), sorted by round then region order
    rounds: list[RoundRow]
    events: list[dict[str, Any]]
    regions: list[str]
    warnings: list[str] = field(default_factory=list)

    @property
    def algorithm(self) -> str | None:
        """sync.algorithm, from summary.json's config or config.yaml."""
        sc = self.summary.get("config") if isinstance(self.summary.get("config"), dict) else {}
        sync = self.config.get("sync") if isinstance(self.config.get("sync"), dict) else {}
        return sc.get("algorithm") or sync.get("algorithm")

    @property
    def traits(self) -> AlgorithmTraits | None:
        """What the run's algorithm can do; None when no algorithm is recorded or this geofed does
        not know its name (a report loads any run directory)."""
        name = self.algorithm
        return TRAITS.get(name) if isinstance(name, str) else None

    @property
    def has_eval(self) -> bool:
        return any(isinstance(m.get("eval"), dict) for m in self.metrics) or isinstance(self.summary.get("eval"), dict)

    def link_order(self, links) -> list[str]:
        """Directed links sorted by sender then receiver in the config's region order."""
        rank = {r: i for i, r in enumerate(self.regions)}

        def key(k: str):
            a, b = link_pairs(k) or (k, "")
            return (rank.get(a, len(rank)), a, rank.get(b, len(rank)), b)

        return sorted(links, key=key)

    def series(self, key: str) -> dict[str, list[tuple[int, float | None, float]]]:
        """region -> [(round, t_end, value)] for a numeric per-region metric, skipping gaps."""
        out: dict[str, list[tuple[int, float | None, float]]] = {r: [] for r in self.regions}
        for m in self.metrics:
            v = num(m.get(key))
            if v is not None:
                out[m["region"]].append((m["round"], num(m.get("t_end")), v))
        return out

    def eval_series(self) -> tuple[str, dict[str, list[tuple[int, float | None, float]]]]:
        """(metric name, region -> [(round, t_end, value)]) over the rounds where eval ran."""
        name = ""
        out: dict[str, list[tuple[int, float | None, float]]] = {r: [] for r in self.regions}
        for m in self.metrics:
            ev = m.get("eval")
            if isinstance(ev, dict) and num(ev.get("value")) is not None:
                name = name or str(ev.get("metric", "eval"))
                out[m["region"]].append((m["round"], num(m.get("t_end")), num(ev["value"])))
        return name, out


def num(v: Any) -> float | None:
    """A finite float, or None for missing, null, NaN and infinities (a diverged loss)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def load_run(run_dir: str | Path) -> Run:
    """Read a run directory (any of its record files suffices); RunDirError when it is not one.
    A torn last line is skipped with a warning; a round logged twice (a resume redid it) keeps its later record.
    """
    path = Path(run_dir)
    if not path.exists():
        raise RunDirError(path, "no such run directory")
    if not path.is_dir():
        raise RunDirError(path, "not a directory; expected a run directory (docs/RUNDIR.md)")
    if not any((path / f).is_file() for f in RECORD_FILES):
        raise RunDirError(path, f"not a run directory: none of {', '.join(RECORD_FILES)} is there (see docs/RUNDIR.md)")
    warnings: list[str] = []
    summary = _read_json(path, "summary.json")
    if not summary:
        warnings.append("summary.json is missing (run still in progress, or it crashed): figures come from the per-round files")
    metrics = _dedupe(_read_jsonl(path, "metrics.jsonl", ("round", "region"), warnings), ("round", "region"))
    raw_rounds = _dedupe(_read_jsonl(path, "rounds.jsonl", ("round",), warnings), ("round",))
    events = _read_jsonl(path, "events.jsonl", (), warnings)
    config = _read_config(path, summary)
    regions = _region_order(config, summary, metrics)
    rank = {r: i for i, r in enumerate(regions)}
    metrics.sort(key=lambda m: (m["round"], rank[m["region"]]))
    rounds = _round_rows(raw_rounds, metrics)
    name = str(summary.get("run") or path.name)
    return Run(path=path, name=name, config=config, summary=summary, metrics=metrics, rounds=rounds,
               events=events, regions=regions, warnings=warnings)


def _read_bytes(path: Path, name: str, limit: int) -> bytes | None:
    """RUN_DIR/name read as data (a run directory can be someone else's): None when missing, else a
    regular file of at most `limit` bytes (a FIFO would block, /dev/zero never ends)."""
    f = path / name
    if not f.exists() and not f.is_symlink():
        return None
    try:
        return read_bounded(f, max_bytes=limit)
    except InputFileError as exc:
        raise RunDirError(path, f"{name}: {exc.reason}") from None


def _read_json(path: Path, name: str) -> dict[str, Any]:
    raw = _read_bytes(path, name, MAX_JSON_BYTES)
    if raw is None:
        return {}
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunDirError(path, f"{name}: invalid JSON: {exc}") from None
    except RecursionError:  # json.loads recurses: 100000 nested brackets
        raise RunDirError(path, f"{name}: invalid JSON: nested too deep") from None
    if not isinstance(data, dict):
        raise RunDirError(path, f"{name}: expected a JSON object, got {type(data).__name__}")
    _check_shapes(path, name, data)
    return data


def _check_shapes(path: Path, where: str, obj: dict[str, Any]) -> None:
    """RunDirError naming the key when a container the report walks has another type."""
    name = where.split(":")[0]
    want = {(k,): t for k, t in SHAPES.get(name, {}).items()} | (_NESTED if name == "summary.json" else {})
    for keys, tp in want.items():
        value = obj.get(keys[0])
        if len(keys) == 2:
            value = value.get(keys[1]) if isinstance(value, dict) else None
        if value is not None and not isinstance(value, tp):
            kind = "a JSON object" if tp is dict else "a list"
            raise RunDirError(path, f"{where}: {'.'.join(keys)}: expected {kind}, got {type(value).__name__}")


def _read_jsonl(path: Path, name: str, required: tuple[str, ...], warnings: list[str]) -> list[dict[str, Any]]:
    raw = _read_bytes(path, name, MAX_LOG_BYTES)
    if raw is None:
        return []
    lines = raw.split(b"\n")
    out = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        last_unterminated = i == len(lines) and not raw.endswith(b"\n")
        try:
            if len(line) > MAX_LINE_BYTES:
                raise ValueError(f"line is {len(line)} bytes, more than {MAX_LINE_BYTES}")
            obj = _loads(line)
        except (UnicodeDecodeError, ValueError) as exc:
            # The writer appends while the run goes on: a last line without its newline is a
            # record caught mid-write (or cut by a crash), not damage.
            if last_unterminated:
                warnings.append(f"{name}:{i}: skipped an unfinished last line")
                continue
            raise RunDirError(path, f"{name}:{i}: invalid JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise RunDirError(path, f"{name}:{i}: expected a JSON object, got {type(obj).__name__}")
        _check_keys(path, name, i, obj, required)
        _check_shapes(path, f"{name}:{i}", obj)
        out.append(obj)
    return out


def _loads(line: bytes) -> Any:
    """json.loads, with the RecursionError of deep nesting (100000 brackets) a ValueError like any damage."""
    try:
        return json.loads(line)
    except RecursionError:
        raise ValueError("nested too deep") from None


def _check_keys(path: Path, name: str, line: int, obj: dict[str, Any], required: tuple[str, ...]) -> None:
    for key in required:
        if key not in obj:
            raise RunDirError(path, f"{name}:{line}: required key {key!r} is missing")
    if "round" in required and (isinstance(obj["round"], bool) or not isinstance(obj["round"], int) or obj["round"] < 0):
        raise RunDirError(path, f"{name}:{line}: round: expected an integer >= 0, got {obj['round']!r}")
    if "region" in required and not isinstance(obj["region"], str):
        raise RunDirError(path, f"{name}:{line}: region: expected a string, got {obj['region']!r}")
    for key in ("t_start", "t_end", "H", "train_loss", "mean_train_loss", "bytes_sent", "bytes_received", "utilization"):
        v = obj.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise RunDirError(path, f"{name}:{line}: {key}: expected a number, got {v!r}")


def _dedupe(records: list[dict[str, Any]], keys: tuple[str, ...]) -> list[dict[str, Any]]:
    # A resumed run re-does the rounds after its last checkpoint; the later record is the one
    # the run continued from.
    by_key = {tuple(r[k] for k in keys): r for r in records}
    return list(by_key.values())


def _read_config(path: Path, summary: dict[str, Any]) -> dict[str, Any]:
    f = path / "config.yaml"
    if not f.exists() and not f.is_symlink():
        return {}
    # The strict loader: aliases (a 1 KB bomb expands to GBs), nesting past MAX_DEPTH, tags and
    # duplicate keys are one ConfigError naming the file; nothing it names is imported.
    return parse_yaml_file(f)


def _region_order(config: dict[str, Any], summary: dict[str, Any], metrics: list[dict[str, Any]]) -> list[str]:
    """Regions in the config's order (the order people wrote them), then any others seen."""
    names = ((config.get("regions") or {}).get("names") or []) if isinstance(config.get("regions"), dict) else []
    order: list[str] = [str(n) for n in names]
    extra: Iterable[str] = [m["region"] for m in metrics] + list(summary.get("utilization_per_region") or {})
    for r in extra:
        if r not in order:
            order.append(r)
    return order


def _round_rows(raw_rounds: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> list[RoundRow]:
    by_round: dict[int, list[dict[str, Any]]] = {}
    for m in metrics:
        by_round.setdefault(m["round"], []).append(m)
    coord = {r["round"]: r for r in raw_rounds}
    rows = []
    for rnd in sorted(set(coord) | set(by_round)):
        c, ms = coord.get(rnd, {}), by_round.get(rnd, [])
        rows.append(RoundRow(
            round=rnd,
            t_start=_first(num(c.get("t_start")), _agg(ms, "t_start", min)),
            t_end=_first(num(c.get("t_end")), _agg(ms, "t_end", max)),
            H=_first(num(c.get("H")), _agg(ms, "H", max)),
            codecs=_codecs(c, ms),
            reason=str(c.get("reason") or ""),
            mean_train_loss=_first(num(c.get("mean_train_loss")), _agg(ms, "train_loss", _mean)),
            utilization=_first(num(c.get("utilization")), _agg(ms, "utilization", _mean)),
            bytes_sent=_first(num(c.get("bytes_sent")), _agg(ms, "bytes_sent", sum)) or 0.0,
            consensus_distance=num(c.get("consensus_distance")),
            links={k: v for k, v in (c.get("links") or {}).items() if isinstance(v, dict)},
            **_eval_fields(c),
        ))
    return rows


def _eval_fields(coord: dict[str, Any]) -> dict[str, Any]:
    ev = coord.get("eval_avg")
    if not isinstance(ev, dict) or num(ev.get("value")) is None:
        return {}
    rnd = coord.get("eval_round")
    earlier = tuple((e["round"], num(e["value"]), num(e.get("t"))) for e in coord.get("evals_earlier") or []
                    if isinstance(e, dict) and isinstance(e.get("round"), int) and num(e.get("value")) is not None)
    return {"eval_metric": str(ev.get("metric", "eval")), "eval_value": num(ev["value"]),
            "eval_round": rnd if isinstance(rnd, int) and not isinstance(rnd, bool) else coord["round"],
            "eval_t": _first(num(coord.get("eval_t")), num(coord.get("t_end"))), "evals_earlier": earlier}


def _codecs(coord: dict[str, Any], ms: list[dict[str, Any]]) -> dict[str, str]:
    # An empty map from the coordinator (a fixed policy decides no per-link codecs) says less
    # than the regions' own records of what they sent with.
    if isinstance(coord.get("codecs"), dict) and coord["codecs"]:
        return {str(k): str(v) for k, v in coord["codecs"].items()}
    out = {}
    for m in ms:
        for peer, codec in (m.get("codecs") or {}).items():
            out[f"{m['region']}->{peer}"] = str(codec)
    return out


def _first(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)


def _agg(ms: list[dict[str, Any]], key: str, fn) -> float | None:
    vals = [v for v in (num(m.get(key)) for m in ms) if v is not None]
    return float(fn(vals)) if vals else None


def _mean(vals: list[float]) -> float:
    return sum(vals) / len(vals)


def link_pairs(name: str) -> tuple[str, str] | None:
    """'a->b' -> ('a', 'b'); None for a key that is not a directed link."""
    src, sep, dst = name.partition("->")
    return (src, dst) if sep and src and dst else None
