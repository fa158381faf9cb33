"""`geofed report`: report.html and PNG plots for a run directory (docs/report.md)."""

from .load import RunDirError, load_run
from .write import write_comparison, write_report

__all__ = ["RunDirError", "load_run", "write_comparison", "write_report"]
