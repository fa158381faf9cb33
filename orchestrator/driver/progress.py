"""Live progress (rich) and the final summary table."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table


class RunProgress:
    """The round progress bar on stderr (loss, H, MB sent); a no-op when disabled (--quiet)."""

    def __init__(self, total_rounds: int, *, enabled: bool, start: int = 0):
        self.console = Console(stderr=True)
        self.enabled = enabled
        self._progress = Progress(
            TextColumn("[bold]round"), MofNCompleteColumn(), BarColumn(),
            TextColumn("loss {task.fields[loss]}  H {task.fields[H]}  sent {task.fields[mb]} MB  {task.fields[note]}"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, transient=False,
            disable=not enabled)
        self._task = self._progress.add_task("run", total=total_rounds, completed=start, loss="-", H="-", mb="0.0", note="")
        if enabled:
            self._progress.start()

    def update(self, *, round_: int, loss: float | None, H: int, mb_sent: float, note: str = "") -> None:
        self._progress.update(self._task, completed=round_ + 1, loss="-" if loss is None else f"{loss:.4f}",
                              H=str(H), mb=f"{mb_sent:.1f}", note=note)

    def log(self, message: str) -> None:
        self.console.print(message)

    def stop(self) -> None:
        if self.enabled:
            self._progress.stop()


def print_summary(summary: dict[str, Any], run_dir: str) -> None:
    """Print the end-of-run table: rounds, wall time, losses, evaluation, bytes, faults, refusals."""
    console = Console()
    t = Table(title="geofed run", show_header=False)
    ev = summary.get("eval") or {}
    rows = [("run directory", run_dir), ("rounds", str(summary.get("rounds"))),
            ("wall time", f"{summary.get('wall_s', 0):.1f} s"),
            ("final train loss", _fmt(summary.get("final_train_loss"))),
            (f"eval {ev.get('metric', '')}".strip(), _fmt(ev.get("value"))),
            ("bytes sent", f"{summary.get('bytes_sent', 0) / 1e6:.2f} MB"),
            ("compute utilisation", _fmt(summary.get("compute_utilization"))),
            ("region restarts / peers left out", f"{summary['faults']['region_restarts']} / {summary['faults']['peers_left_out']}"),
            ("refused messages", str(summary["refusals"]["total"]))]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)
