"""Live progress (rich) and the final summary table."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


class RunProgress:
    """Progress on stderr: a bar on a terminal; without one (a log file, nohup, CI) one plain line
    per round (round_line); nothing when disabled (--quiet).

    The ETA is from this process's pace to whichever ends the run first: run.rounds, or
    run.max_steps (`max_steps`, with `start_steps` already done at `start`) when set."""

    def __init__(self, total_rounds: int, *, enabled: bool, start: int = 0, console: Console | None = None,
                 max_steps: int = 0, start_steps: int = 0, clock: Callable[[], float] = time.monotonic):
        self.console = console or Console(stderr=True)
        self.plain = enabled and not self.console.is_terminal
        self.enabled = enabled and not self.plain
        self.total, self._start, self._clock = total_rounds, start, clock
        self.max_steps, self._start_steps = max_steps, start_steps
        self._t0 = clock()
        self.eta_s: float | None = None
        self._progress = Progress(
            TextColumn("[bold]rounds done"), MofNCompleteColumn(), BarColumn(),
            TextColumn("loss {task.fields[loss]}  H {task.fields[H]}  sent {task.fields[mb]} MB  {task.fields[note]}"),
            # Our own ETA, not rich's TimeRemainingColumn: that one counts rounds only, and a run
            # that run.max_steps ends in 7 minutes read 6h17m.
            TimeElapsedColumn(), TextColumn("eta {task.fields[eta]}"), console=self.console, transient=False,
            disable=not self.enabled)
        self._task = self._progress.add_task("run", total=total_rounds, completed=start, loss="-", H="-", mb="0.0",
                                             note="", eta="-")
        if self.enabled:
            self._progress.start()

    def update(self, *, round_: int, loss: float | None, H: int, mb_sent: float, note: str = "",
               codec: str = "-", utilization: float | None = None, elapsed_s: float = 0.0,
               steps_done: int | None = None) -> None:
        """After round `round_` (`steps_done`: inner steps of the whole run so far): the bar, or one
        line without a terminal."""
        self.eta_s = eta = self._eta(round_, steps_done)
        self._progress.update(self._task, completed=round_ + 1, loss="-" if loss is None else f"{loss:.4f}",
                              H=str(H), mb=f"{mb_sent:.1f}", note=note, eta=_dur(eta))
        if self.plain:
            self.console.print(round_line(round_=round_, total=self.total, loss=loss, H=H, codec=codec, mb_sent=mb_sent,
                                          utilization=utilization, elapsed_s=elapsed_s, eta_s=eta, note=note),
                               highlight=False, markup=False, soft_wrap=True)

    def _eta(self, round_: int, steps_done: int | None) -> float:
        spent = self._clock() - self._t0
        done = round_ + 1 - self._start  # rounds this process ran (a resume starts later)
        eta = spent / max(1, done) * max(0, self.total - round_ - 1)
        ran = (steps_done or 0) - self._start_steps
        if self.max_steps and steps_done is not None and ran > 0:
            eta = min(eta, spent / ran * max(0, self.max_steps - steps_done))
        return eta

    def log(self, message: str) -> None:
        self.console.print(message)

    def stop(self) -> None:
        if self.enabled:
            self._progress.stop()


def round_line(*, round_: int, total: int, loss: float | None, H: int, codec: str, mb_sent: float,
               utilization: float | None, elapsed_s: float, eta_s: float, note: str = "") -> str:
    """One round as one line, for logs: `round 2 (3/30 done) loss 0.5123 H 20 codec int8 sent 1.2 MB
    util 0.81 elapsed 12.3s eta 1m40s` (MB sent so far; elapsed training time; ETA from this process's pace)."""
    util = "-" if utilization is None else f"{utilization:.2f}"
    # A round's number counts from 0, as in every file and checkpoint; how many are done is a count.
    line = (f"round {round_} ({round_ + 1}/{total} done) loss {'-' if loss is None else f'{loss:.4f}'} H {H} codec {codec} "
            f"sent {mb_sent:.{2 if mb_sent < 10 else 1}f} MB util {util} elapsed {_dur(elapsed_s)} eta {_dur(eta_s)}")
    return f"{line} {note}" if note else line


def _dur(seconds: float) -> str:
    s = max(0.0, seconds)
    if s < 60:
        return f"{s:.1f}s"
    m, s = divmod(int(round(s)), 60)
    return f"{m}m{s:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m"


def print_summary(summary: dict[str, Any], run_dir: str) -> None:
    """Print the end-of-run table: rounds, wall time, losses, evaluation, bytes, faults, refusals."""
    console = Console()
    t = Table(title="geofed run", show_header=False)
    ev = summary.get("eval") or {}
    rows = [("run directory", run_dir), ("rounds", str(summary.get("rounds"))),
            *_times(summary),
            ("final train loss", _fmt(summary.get("final_train_loss"))),
            (f"eval {ev.get('metric', '')}".strip(), _fmt(ev.get("value")) + _eval_spread(summary)),
            ("bytes sent", f"{summary.get('bytes_sent', 0) / 1e6:.2f} MB"),
            ("compute utilisation", _fmt(summary.get("compute_utilization"))),
            *_fault_rows(summary.get("faults") or {}, (summary.get("live_regions") or {}).get("ended")),
            ("refused messages", str(summary["refusals"]["total"]))]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)


def _fault_rows(faults: dict[str, Any], ended: list[str] | None = None) -> list[tuple[str, str]]:
    """Stalled and failed regions apart from restarts, and the rounds they sat out apart from the
    updates participants missed: a stalled region is left out of rounds, not missed in them. Then
    the regions named, one line each (faults.by_region): a count alone did not say which failed,
    why, or what it missed."""
    rows = [("region stalls / failures / restarts", f"{faults.get('region_stalls', 0)} / "
             f"{faults.get('region_failures', 0)} / {faults.get('region_restarts', 0)}"),
            ("region-rounds out / updates missed", f"{faults.get('region_rounds_out', 0)} / "
             f"{faults.get('peers_left_out', 0)}")]
    named = [region_fault_line(region, f, back=None if ended is None else region in ended)
             for region, f in (faults.get("by_region") or {}).items() if isinstance(f, dict)]
    if named:
        rows.append(("region failures", "\n".join(named)))
    return rows


def region_fault_line(region: str, f: dict[str, Any], *, back: bool | None = None) -> str:
    """`eu-west-1 x1 (OOM), restarted x1, rounds 3-4 missed`: one region's faults.by_region entry
    (`back`: False adds that it was out at the end)."""
    parts = []
    if f.get("failures"):
        causes = sorted(set(map(str, f.get("causes") or [])))
        parts.append(f"x{f['failures']}" + (f" ({', '.join(causes)})" if causes else ""))
    if f.get("stalls"):
        parts.append(f"stalled x{f['stalls']}")
    if f.get("restarts"):
        parts.append(f"restarted x{f['restarts']}")
    if f.get("rounds_out"):
        parts.append(f"rounds {rounds_text(f['rounds_out'])} missed")
    if back is False:
        parts.append("out at the end")
    return f"{region} " + ", ".join(parts) if parts else region


def rounds_text(ranges: list[list[int]]) -> str:
    """[[3, 4], [7, 7]] -> '3-4, 7'."""
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges)


def end_line(summary: dict[str, Any]) -> str | None:
    """The run's last line when it ended with fewer live regions than it started with:
    `ended with 2 of 3 regions: eu-west-1 failed in round 5 (OOM) and did not come back`; None
    otherwise. From summary.json alone (live_regions, faults.by_region, left)."""
    live = summary.get("live_regions") or {}
    started, ended = list(live.get("started") or []), list(live.get("ended") or [])
    if len(ended) >= len(started):
        return None
    by_region = (summary.get("faults") or {}).get("by_region") or {}
    left = summary.get("left") or {}
    parts = []
    for region in started:
        if region in ended:
            continue
        f = by_region.get(region) or {}
        failed, stalled = f.get("failed_in") or [], f.get("stalled_in") or []
        if region in left:
            parts.append(f"{region} left after round {(left[region] or {}).get('round')}")
        elif failed and (not stalled or failed[-1] >= stalled[-1]):
            cause = (f.get("causes") or ["?"])[-1]
            parts.append(f"{region} failed in round {failed[-1]} ({cause}) and did not come back")
        elif stalled:
            parts.append(f"{region} stalled in round {stalled[-1]} and did not come back")
        else:
            parts.append(f"{region} is out")
    return f"ended with {len(ended)} of {len(started)} regions: " + "; ".join(parts)


def _eval_spread(summary: dict[str, Any]) -> str:
    """' (regions a-b)' when the regions ended on models that evaluate differently: the eval shown
    is one region's (diloco, all-reduce) or the average model's (gossip), and a drift (a miss
    without resync) must not hide behind it."""
    values = [v["value"] for v in (summary.get("eval_per_region") or {}).values()
              if isinstance(v, dict) and isinstance(v.get("value"), (int, float))]
    if len(values) < 2 or max(values) - min(values) <= 1e-6:
        return ""
    return f" (regions {min(values):.4f}-{max(values):.4f})"


def _times(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """Set-up (process start, or Ray, actors, TLS and link probes, to round 0) and training, apart:
    a run that waited 39 s must not say only "4.4 s"."""
    startup = (summary.get("startup") or {}).get("process_to_round0_s")
    setup = startup if startup is not None else summary.get("setup_s")
    rows = [("set-up time (start to first round)", "-" if setup is None else f"{setup:.1f} s")]
    return [*rows, ("training time (round 0 to end)", f"{summary.get('wall_s', 0):.1f} s")]


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)
