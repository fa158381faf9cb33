"""The task seam: a model, how data is split across regions, and how the model is judged.

A task is a plain object built from its own frozen config dataclass. The registry maps the
YAML ``task.kind`` to (config class, factory). ``python:module:function`` plugs in a user's
own task: the function takes ``task.options`` as keyword arguments and returns a Task.

Trust model of plug-ins: a config that names a plug-in is code. Loading one imports the named
module, which runs its top-level code (``geofed validate`` does so too), so a config naming
``python:...`` deserves the trust you give a Python file. What the config cannot do is call
an arbitrary function: only a callable its author marked as a geofed task factory (the
``task_factory`` decorator, or a ``geofed.tasks`` entry point of an installed distribution) is
ever called, and the mark is checked before the call. ``python:os:system`` is refused without
importing anything (standard-library modules hold no task factories).
"""

from __future__ import annotations

import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# The torch-free half (plug-in trust checks, config classes and their registry), re-exported here.
from .configs import (ENTRY_POINT_GROUP, PluginTaskConfig, is_task_factory, load_task_factory,  # noqa: F401
                      task_config_class, task_factory, task_kinds)


@dataclass(frozen=True, kw_only=True)
class EvalResult:
    """A task's held-out metric: its name, its value and which direction is better."""

    metric: str  # e.g. "accuracy", "loss"
    value: float
    higher_is_better: bool = True


class Shard(ABC):
    """One region's share of the training data."""

    @property
    @abstractmethod
    def num_examples(self) -> int:
        """Training examples in the shard (reported with the region's info)."""

    @abstractmethod
    def batches(self, generator: torch.Generator) -> Iterator[Any]:
        """An endless stream of training batches drawn with `generator` (reproducible)."""

    def poisson_batches(self, generator: torch.Generator, rate: float) -> Iterator[Any] | None:
        """Batches of independently drawn examples (each with probability `rate`; a batch may be
        empty), the sampling record-level DP's accountant assumes; None where the shard cannot
        (the worker then uses `batches`: fixed-size batches, the usual approximation)."""
        return None


class Task(ABC):
    """Model + data + evaluation. Implementations must be deterministic given the seed."""

    kind: str = "?"

    @abstractmethod
    def build_model(self, seed: int) -> nn.Module:
        """A fresh model. The same seed must give the same weights in every process: DiLoCo starts
        every region from one model."""

    @abstractmethod
    def shard(self, region_index: int, n_regions: int, seed: int) -> Shard:
        """Region `region_index`'s training data out of `n_regions`; a function of its arguments (and
        the task's config), so every process computes the same split."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Training loss of `model` on one batch (the model is in train mode)."""

    @abstractmethod
    def evaluate(self, model: nn.Module) -> EvalResult:
        """Metric on held-out data that no region trains on."""

    def describe(self) -> dict[str, Any]:
        """Facts for the summary (dataset sizes, partition statistics)."""
        return {}


_REGISTRY: dict[str, tuple[type, Callable[..., Task]]] = {}


def register_task(kind: str, config_cls: type, factory: Callable[..., Task]) -> None:
    """`factory(config, *, batch_size, seed) -> Task`; `config_cls` is the one configs.py registers
    for `kind` (one list of kinds: the config loader reads that one without torch)."""
    assert task_config_class(kind) is config_cls, (kind, config_cls)
    _REGISTRY[kind] = (config_cls, factory)


def make_task(config: Any, *, batch_size: int = 32, seed: int = 0, device: str = "cpu") -> Task:
    """Build the task; `batch_size` and `seed` come from the run config (sync.inner, run.seed),
    `device` is where the region trains (a plug-in may put its data there). A plug-in factory gets
    each of the three it names in its signature (or takes through **kwargs), unless its options
    already set it."""
    load_builtin_tasks()
    if isinstance(config, PluginTaskConfig):
        fn = load_task_factory(config)
        options = {**_run_facts(fn, batch_size=batch_size, seed=seed, device=device), **dict(config.options)}
        try:
            inspect.signature(fn).bind(**options)
        except TypeError as exc:
            raise ValueError(f"options: {config.kind!r} does not take these options: {exc}") from None
        except ValueError:  # no signature to read (a builtin): the call itself will say
            pass
        task = fn(**options)
        if not isinstance(task, Task):
            raise ValueError(f"kind: {config.kind!r} returned {type(task).__name__}, not a geofed Task")
        return task
    return _REGISTRY[config.kind][1](config, batch_size=batch_size, seed=seed)


def _run_facts(fn: Callable[..., Any], **facts: Any) -> dict[str, Any]:
    """The run facts (batch_size, seed, device) that `fn`'s signature takes by name or by **kwargs."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return facts
    return {k: v for k, v in facts.items() if k in params and params[k].kind is not inspect.Parameter.POSITIONAL_ONLY}


# The built-in task modules, imported by name the way plug-ins are: importing one registers its
# kind (register_task), and this module never depends on them, so they may all import it.
BUILTIN_MODULES = ("charlm", "digits", "gpt", "hf", "graph")


def load_builtin_tasks() -> None:
    """Register the built-in task kinds (make_task does it on first use; lazily, so `geofed
    validate` stays fast)."""
    for name in BUILTIN_MODULES:
        importlib.import_module(f"{__package__}.{name}")
