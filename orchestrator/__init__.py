"""geofed's control plane: the driver, the config, the policies, the report and the CLI.

`Trainer` (orchestrator/trainer.py) is its one entry for a program: a run with the user's own
training loop, or a task's (`geofed run`).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Trainer"]


def __getattr__(name: str) -> Any:
    # Loaded on first use, by name: every `geofed.orchestrator.X` import runs this package, and an
    # import here would make mypy read the whole driver (tests/unit/test_types.py checks the seams
    # and what they import) and every CLI command load the Trainer's module.
    if name == "Trainer":
        return importlib.import_module(f"{__name__}.trainer").Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
