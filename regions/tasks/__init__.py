"""Tasks: model + data shards + evaluation, chosen by `task.kind`."""

from .base import (EvalResult, Shard, Task, is_task_factory, make_task, register_task, task_config_class,
                   task_factory, task_kinds)

__all__ = ["EvalResult", "Shard", "Task", "is_task_factory", "make_task", "register_task", "task_config_class",
           "task_factory", "task_kinds"]
