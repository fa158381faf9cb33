"""Tasks: model + data shards + evaluation, chosen by `task.kind`.

The config side (configs.py: the kinds, their config classes, plug-in trust checks) imports
without torch, for the config loader and `geofed validate`; the torch side (Task, Shard,
make_task, ...) is imported on first access (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .configs import is_task_factory, task_config_class, task_factory, task_kinds

if TYPE_CHECKING:
    from .base import EvalResult, Shard, Task, make_task, register_task

_LAZY = {"EvalResult", "Shard", "Task", "make_task", "register_task"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.base"), name)
    globals()[name] = value
    return value


__all__ = ["EvalResult", "Shard", "Task", "is_task_factory", "make_task", "register_task", "task_config_class",
           "task_factory", "task_kinds"]
