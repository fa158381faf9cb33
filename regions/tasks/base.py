"""The task seam: a model, how data is split across regions, and how the model is judged.

A task is a plain object built from its own frozen config dataclass. The registry maps the
YAML ``task.kind`` to (config class, factory). ``python:module:function`` plugs in a user's
own task: the function takes the task config mapping's extra keys and returns a Task.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True, kw_only=True)
class EvalResult:
    metric: str  # e.g. "accuracy", "loss"
    value: float
    higher_is_better: bool = True


class Shard(ABC):
    """One region's share of the training data."""

    @property
    @abstractmethod
    def num_examples(self) -> int: ...

    @abstractmethod
    def batches(self, generator: torch.Generator) -> Iterator[Any]:
        """An endless stream of training batches drawn with `generator` (reproducible)."""


class Task(ABC):
    """Model + data + evaluation. Implementations must be deterministic given the seed."""

    kind: str = "?"

    @abstractmethod
    def build_model(self, seed: int) -> nn.Module: ...

    @abstractmethod
    def shard(self, region_index: int, n_regions: int, seed: int) -> Shard: ...

    @abstractmethod
    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Training loss of `model` on one batch (the model is in train mode)."""

    @abstractmethod
    def evaluate(self, model: nn.Module) -> EvalResult:
        """Metric on held-out data that no region trains on."""

    def describe(self) -> dict[str, Any]:
        """Facts for the summary (dataset sizes, partition statistics)."""
        return {}


@dataclass(frozen=True, kw_only=True)
class PluginTaskConfig:
    """``kind: python:package.module:function``; every other key goes to the function."""

    kind: str
    path: str | None = field(default=None, metadata={"doc": "folder put on sys.path before importing the module (relative to the working directory)"})
    options: Mapping[str, Any] = field(default_factory=dict, metadata={"doc": "keyword arguments for the factory"})

    def __post_init__(self):
        if not self.kind.startswith("python:") or self.kind.count(":") != 2:
            raise ValueError(f"kind: expected python:module:function, got {self.kind!r}")


_REGISTRY: dict[str, tuple[type, Callable[..., Task]]] = {}


def register_task(kind: str, config_cls: type, factory: Callable[..., Task]) -> None:
    """`factory(config, *, batch_size, seed) -> Task`."""
    assert dataclasses.is_dataclass(config_cls), config_cls
    _REGISTRY[kind] = (config_cls, factory)


def task_kinds() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def task_config_class(kind: str) -> type:
    """Config class for `kind`; KeyError with the known names otherwise (used by the loader)."""
    _load_builtin()
    if kind.startswith("python:"):
        return PluginTaskConfig
    if kind not in _REGISTRY:
        raise KeyError(f"unknown task {kind!r} (known: {', '.join(sorted(_REGISTRY))}, python:module:function)")
    return _REGISTRY[kind][0]


def make_task(config: Any, *, batch_size: int = 32, seed: int = 0) -> Task:
    """Build the task; `batch_size` and `seed` come from the run config (sync.inner, run.seed)."""
    _load_builtin()
    if isinstance(config, PluginTaskConfig):
        _, module_name, fn_name = config.kind.split(":")
        if config.path is not None and config.path not in sys.path:
            sys.path.insert(0, config.path)
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"kind: cannot load {config.kind!r}: {exc}") from None
        task = fn(**dict(config.options))
        if not isinstance(task, Task):
            raise ValueError(f"kind: {config.kind!r} returned {type(task).__name__}, not a geofed Task")
        return task
    return _REGISTRY[config.kind][1](config, batch_size=batch_size, seed=seed)


def _load_builtin() -> None:
    # Importing the modules registers them; done lazily so `geofed validate` stays fast.
    from . import builtin  # noqa: F401
