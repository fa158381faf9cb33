"""`geofed watch RUN_DIR`: a live table of a run, from its files alone (rounds.jsonl, events.jsonl,
config.yaml, summary.json), so it works from any terminal that can read the run directory, while
the run goes on or after it ended. Exits when summary.json appears (docs/watch.md).

Imports only rich and yaml: watching must not pay for torch or Ray.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from .config.strict import ConfigError


class JsonlTail:
    """Reads a JSON lines file incrementally: each read() returns the records of the complete lines
    appended since the last (a line still being written waits for its newline)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.records = path, 0, []

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return self.records
        end = data.rfind(b"\n") + 1
        for line in data[:end].splitlines():
            try:
                self.records.append(json.loads(line))
            except ValueError:
                continue  # a damaged line: the report names it; a live view skips it
        self.offset += end
        return self.records


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
        if self.summary is None and path.is_file():
            try:
                self.summary = json.loads(path.read_text())
            except ValueError:
                self.summary = None  # written atomically; a parse error means another writer: retry

    @property
    def done(self) -> bool:
        return self.summary is not None

    def render(self) -> Group:
        """The status table and the per-link table."""
        return Group(self._status(), self._links())

    def _state(self) -> str:
        if self.summary is not None:
            stop = self.summary.get("interrupted")
            return f"stopped by {stop['signal']} after round {stop['last_round']}" if stop else "finished"
        names = [e.get("event") for e in self.events.records]
        if "setup_done" not in names:
            return "setting up" if names else "starting (no events yet)"
        idle = time.monotonic() - self.last_change
        return "running" + (f" (no new round for {idle:.0f} s)" if idle > 60 else "")

    def _status(self) -> Table:
        rows = self.rounds.records
        t = Table(title=f"geofed watch: {self.run_dir}", show_header=False, title_justify="left")
        t.add_column(style="bold")
        t.add_column()
        t.add_row("state", self._state())
        last = rows[-1] if rows else {}
        done = last.get("round", -1) + 1
        t.add_row("round", f"{done} / {self.total}" if self.total else str(done))
        elapsed = last.get("t_end")
        if elapsed is not None and done:
            eta = elapsed / done * max(0, (self.total or done) - done)
            t.add_row("elapsed / ETA", f"{elapsed:.1f} s / {eta:.1f} s" if self.summary is None else f"{elapsed:.1f} s")
        t.add_row("train loss", _num(last.get("mean_train_loss")))
        ev = next((r["eval_avg"] for r in reversed(rows) if r.get("eval_avg")), None)
        if self.summary and self.summary.get("eval"):
            ev = self.summary["eval"]
        t.add_row(f"eval {ev['metric']}" if ev else "eval", _num(ev["value"]) if ev else "-")
        t.add_row("H", str(last.get("H", "-")))
        codecs = Counter((last.get("codecs") or {}).values())
        t.add_row("codecs", ", ".join(f"{k} x{n}" for k, n in codecs.most_common()) or "-")
        t.add_row("MB sent", f"{sum(r.get('bytes_sent', 0) for r in rows) / 1e6:.2f}")
        t.add_row("utilisation", _num(last.get("utilization")))
        alive = last.get("alive")
        if alive is not None:
            t.add_row("regions alive", f"{len(alive)}: {', '.join(alive)}")
        notable = [e for e in self.events.records if e.get("event") not in ("started", "links_probed", "setup_done")]
        t.add_row("last events", "; ".join(f"{e.get('event')} (round {e.get('round')})" for e in notable[-3:]) or "-")
        return t

    def _links(self) -> Table:
        links: dict[str, dict] = {}
        for r in self.rounds.records:
            links.update(r.get("links") or {})
        t = Table(title="links (latest estimate)", title_justify="left")
        t.add_column("link", no_wrap=True)
        for col in ("Mbit/s", "configured", "RTT ms", "configured"):
            t.add_column(col, justify="right")
        for name, est in sorted(links.items()):
            t.add_row(name, _num(est.get("bandwidth_mbps"), 1), _num(est.get("configured_bandwidth_mbps"), 1),
                      _num(est.get("rtt_ms"), 1), _num(est.get("configured_rtt_ms"), 1))
        return t


def _num(v: Any, digits: int = 4) -> str:
    return "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _total_rounds(run_dir: Path) -> int | None:
    try:
        return int(yaml.safe_load((run_dir / "config.yaml").read_text())["run"]["rounds"])
    except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError):
        return None


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
