"""`geofed watch RUN_DIR`: a live table of a run, from its files alone (rounds.jsonl, events.jsonl,
config.yaml, summary.json), so it works from any terminal that can read the run directory, while
the run goes on or after it ended. Exits when summary.json appears (docs/watch.md).

Every string taken from the run directory is shown as plain text (rich.text.Text, never markup)
with control characters removed, every number is checked before arithmetic, and every file is
read as a regular file within a cap: a run directory can be someone else's (issue 36, N11).
"""

from __future__ import annotations

import json
import math
import os
import time
import unicodedata
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from geofed.regions.inputfiles import InputFileError, open_regular

from .config.strict import ConfigError, parse_yaml_file

MAX_LOG_BYTES = 1 << 30  # orchestrator/driver/rundir.py's cap on a run's log
MAX_SUMMARY_BYTES = 64 << 20
MAX_SHOWN = 200  # characters of one string from the run directory in a cell


class JsonlTail:
    """Reads a JSON lines file incrementally: each read() returns the records of the complete lines
    appended since the last (a line still being written waits for its newline). Only JSON objects
    are kept (anything else in a line is damage a live view skips). ConfigError when the file is
    not a regular file or grows past MAX_LOG_BYTES: a run directory can be someone else's."""

    def __init__(self, path: Path):
        self.path, self.offset, self.records = path, 0, []

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists() and not self.path.is_symlink():
            return self.records
        try:
            with open_regular(self.path, max_bytes=MAX_LOG_BYTES) as f:
                size = os.fstat(f.fileno()).st_size
                if size <= self.offset:
                    return self.records
                f.seek(self.offset)
                data = f.read(size - self.offset)
        except InputFileError as exc:
            raise ConfigError("", exc.reason, source=str(self.path)) from None
        end = data.rfind(b"\n") + 1
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):  # json.loads recurses: 100000 brackets are a RecursionError
                continue  # a damaged line: the report names it; a live view skips it
            if isinstance(record, dict):
                self.records.append(record)
        self.offset += end
        return self.records


def shown(value: Any) -> Text:
    """A string from the run directory as plain text for the terminal: never rich markup (``[/]``
    raised MarkupError), without control or format characters (ESC and OSC sequences, bidi
    overrides would reach the terminal), and cut to MAX_SHOWN characters."""
    text = value if isinstance(value, str) else str(value)
    text = "".join(c for c in text[: MAX_SHOWN * 2] if not unicodedata.category(c).startswith("C"))
    return Text(text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 1] + "…")


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _number(value: Any) -> float | None:
    """A finite number from the run directory, else None (a string, a bool, 1e999, a 400-digit int)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        out = float(value)
    except OverflowError:
        return None
    return out if math.isfinite(out) else None


def _count(value: Any) -> int | None:
    """A round number from the run directory: an int in a range arithmetic on it can take."""
    return value if isinstance(value, int) and not isinstance(value, bool) and -1 <= value < 1 << 53 else None


class RunView:
    """What `geofed watch` knows of one run directory, refreshed by poll()."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.rounds = JsonlTail(run_dir / "rounds.jsonl")
        self.events = JsonlTail(run_dir / "events.jsonl")
        self.total = _total_rounds(run_dir)
        self.summary: dict[str, Any] | None = None
        self.last_change = time.monotonic()

    def poll(self) -> None:
        """Read what was appended since the last poll, and summary.json once it exists."""
        before = len(self.rounds.records) + len(self.events.records)
        self.rounds.read()
        self.events.read()
        if len(self.rounds.records) + len(self.events.records) != before:
            self.last_change = time.monotonic()
        path = self.run_dir / "summary.json"
        if self.summary is None and (path.exists() or path.is_symlink()):
            try:
                with open_regular(path, max_bytes=MAX_SUMMARY_BYTES) as f:
                    summary = json.loads(f.read(MAX_SUMMARY_BYTES + 1))
            except InputFileError as exc:
                raise ConfigError("", exc.reason, source=str(path)) from None
            except RecursionError:
                raise ConfigError("", "not JSON: nested too deep", source=str(path)) from None
            except ValueError:
                return  # written atomically; a parse error means another writer: retry
            if not isinstance(summary, dict):
                raise ConfigError("", f"expected a JSON object, got {type(summary).__name__}", source=str(path))
            self.summary = summary

    @property
    def done(self) -> bool:
        return self.summary is not None

    def render(self) -> Group:
        """The status table and the per-link table."""
        return Group(self._status(), self._links())

    def _state(self) -> Text:
        if self.summary is not None:
            stop = _dict(self.summary.get("interrupted")) if self.summary.get("interrupted") else None
            if stop is None:
                return Text("finished")
            return shown(f"stopped by {stop.get('signal', '?')} after round {stop.get('last_round', '?')}")
        names = [e.get("event") for e in self.events.records]
        if "setup_done" not in names:
            return Text("setting up" if names else "starting (no events yet)")
        idle = time.monotonic() - self.last_change
        return Text("running" + (f" (no new round for {idle:.0f} s)" if idle > 60 else ""))

    def _status(self) -> Table:
        rows = self.rounds.records
        t = Table(title=shown(f"geofed watch: {self.run_dir}"), show_header=False, title_justify="left")
        t.add_column(style="bold")
        t.add_column()
        t.add_row("state", self._state())
        last = rows[-1] if rows else {}
        done = (_count(last.get("round")) if "round" in last else -1)
        done = None if done is None else done + 1
        total = _count(self.total)
        # Rounds are numbered from 0 (files, checkpoints, export); the count of those done is apart.
        t.add_row("rounds", "-" if done is None or done < 1 else
                  (f"{done} / {total} done" if total else f"{done} done") + f" (last round {done - 1})")
        elapsed = _number(last.get("t_end"))
        if elapsed is not None and done:
            eta = elapsed / done * max(0, (total or done) - done)
            t.add_row("elapsed / ETA", f"{elapsed:.1f} s / {eta:.1f} s" if self.summary is None else f"{elapsed:.1f} s")
        t.add_row("train loss", _num(last.get("mean_train_loss")))
        ev = next((_dict(r["eval_avg"]) for r in reversed(rows) if r.get("eval_avg")), None)
        if self.summary and self.summary.get("eval"):
            ev = _dict(self.summary["eval"])
        t.add_row(shown(f"eval {ev.get('metric', '?')}") if ev else "eval", _num(ev.get("value")) if ev else "-")
        t.add_row("H", _num(last.get("H")))
        codecs = Counter(shown(c).plain for c in _dict(last.get("codecs")).values())
        t.add_row("codecs", shown(", ".join(f"{k} x{n}" for k, n in codecs.most_common())) if codecs else "-")
        sent = sum(v for v in (_number(_dict(r).get("bytes_sent")) for r in rows) if v is not None)
        t.add_row("MB sent", f"{sent / 1e6:.2f}")
        t.add_row("utilisation", _num(last.get("utilization")))
        alive = last.get("alive")
        if isinstance(alive, list):
            t.add_row("regions alive", shown(f"{len(alive)}: {', '.join(shown(a).plain for a in alive)}"))
        notable = [e for e in self.events.records if e.get("event") not in ("started", "links_probed", "setup_done")]
        t.add_row("last events", shown("; ".join(f"{shown(e.get('event')).plain} (round {shown(e.get('round')).plain})"
                                                 for e in notable[-3:])) if notable else "-")
        return t

    def _links(self) -> Table:
        links: dict[str, dict] = {}
        for r in self.rounds.records:
            links.update({str(k): _dict(v) for k, v in _dict(r.get("links")).items()})
        t = Table(title="links (latest estimate)", title_justify="left")
        t.add_column("link", no_wrap=True)
        for col in ("Mbit/s", "configured", "RTT ms", "configured"):
            t.add_column(col, justify="right")
        for name, est in sorted(links.items()):
            t.add_row(shown(name), _num(est.get("bandwidth_mbps"), 1), _num(est.get("configured_bandwidth_mbps"), 1),
                      _num(est.get("rtt_ms"), 1), _num(est.get("configured_rtt_ms"), 1))
        return t


def _num(v: Any, digits: int = 4) -> Text | str:
    """A number as the table shows it; '-' for anything that is not a finite number."""
    if isinstance(v, int) and not isinstance(v, bool) and _count(v) is not None:
        return str(v)
    x = _number(v)
    return "-" if x is None else f"{x:.{digits}f}"


def _total_rounds(run_dir: Path) -> int | None:
    """run.rounds of RUN_DIR/config.yaml, read by the strict loader (aliases, deep nesting, a FIFO
    are one ConfigError naming the file); None while it is not written yet, or says no number."""
    path = run_dir / "config.yaml"
    if not path.exists() and not path.is_symlink():
        return None
    rounds = _dict(parse_yaml_file(path).get("run")).get("rounds")
    return _count(rounds)


def watch(run_dir: str | Path, *, interval: float = 2.0, once: bool = False, console: Console | None = None) -> int:
    """Show RUN_DIR's live table until its summary.json appears (once: one snapshot); returns 0."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError("", "no such run directory", source=str(run_dir))
    if interval <= 0:
        raise ConfigError("", f"must be > 0, got {interval}", source="--interval")
    console = console or Console()
    view = RunView(run_dir)
    view.poll()
    if once or view.done:
        console.print(view.render())
        return 0
    with Live(view.render(), console=console, refresh_per_second=4, auto_refresh=False) as live:
        while not view.done:
            time.sleep(interval)
            if view.total is None:
                view.total = _total_rounds(run_dir)
            view.poll()
            live.update(view.render(), refresh=True)
    return 0
