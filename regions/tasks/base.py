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

import dataclasses
import importlib
import inspect
import re
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


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


@dataclass(frozen=True, kw_only=True)
class PluginTaskConfig:
    """``kind: python:package.module:function``; every other key goes to the function."""

    kind: str
    path: str | None = field(default=None, metadata={"path": "config", "doc": "folder put on sys.path before importing the module"})
    options: Mapping[str, Any] = field(default_factory=dict, metadata={"doc": "keyword arguments for the factory"})

    def __post_init__(self):
        if not _PLUGIN_KIND.fullmatch(self.kind):
            raise ValueError(f"kind: expected python:module:function (dotted Python names), got {self.kind!r}")


_PLUGIN_KIND = re.compile(r"python:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*", re.ASCII)
ENTRY_POINT_GROUP = "geofed.tasks"
# id -> the factory itself: a mark by identity, which no look-alike object (a proxy whose every
# attribute is truthy, a module __getattr__) can fake. Holding the function keeps its id unique.
_FACTORIES: dict[int, Callable[..., Any]] = {}


def task_factory(fn: Callable[..., Task]) -> Callable[..., Task]:
    """Mark `fn` as a geofed task factory: a config may then name it as
    ``task.kind: python:module:function``; ``fn(**task.options)`` returns a Task.

    A config can only make geofed call functions marked so (or declared as ``geofed.tasks``
    entry points): naming any other callable, ``os:system`` say, is refused before a call.
    """
    if not callable(fn):
        raise TypeError(f"task_factory: {fn!r} is not callable")
    _FACTORIES[id(fn)] = fn
    return fn


def is_task_factory(fn: Any) -> bool:
    """Whether `fn` was marked by @task_factory (by identity, which no look-alike object can fake)."""
    return _FACTORIES.get(id(fn)) is fn


def _declared_entry_point(module: str, attr: str) -> bool:
    """Whether an installed distribution declares ``module:attr`` in the ``geofed.tasks`` entry
    point group (read from metadata: nothing is imported)."""
    from importlib.metadata import entry_points

    return any(ep.module == module and ep.attr == attr for ep in entry_points(group=ENTRY_POINT_GROUP))


def load_task_factory(config: PluginTaskConfig) -> Callable[..., Task]:
    """The factory `config.kind` names, once it is known to be marked; ValueError('kind: ...')
    otherwise. Importing the module runs its top-level code (see the module docstring)."""
    _, module_name, fn_name = config.kind.split(":")
    top = module_name.split(".")[0]
    if top in sys.stdlib_module_names or top == "geofed":
        raise ValueError(f"kind: {config.kind!r} names {top!r}, which holds no geofed task factory "
                         f"(a plug-in task is a function in your own module, marked @task_factory)")
    declared = _declared_entry_point(module_name, fn_name)
    if config.path is not None and config.path not in sys.path:
        sys.path.insert(0, config.path)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - the user's module: any error it raises, on one line
        raise ValueError(f"kind: cannot import {module_name!r} for {config.kind!r}: {type(exc).__name__}: {exc} "
                         f"(python -c 'import {module_name}' shows the traceback)") from None
    fn = vars(module).get(fn_name)  # no module __getattr__: a plain lookup
    if fn is None:
        raise ValueError(f"kind: {config.kind!r}: module {module_name!r} has no {fn_name!r}")
    if not (declared or is_task_factory(fn)):
        raise ValueError(f"kind: {config.kind!r} is not a geofed task factory; mark it with "
                         f"@geofed.regions.tasks.task_factory or declare it as a {ENTRY_POINT_GROUP!r} entry point "
                         f"(a config may only name marked factories)")
    return fn


_REGISTRY: dict[str, tuple[type, Callable[..., Task]]] = {}


def register_task(kind: str, config_cls: type, factory: Callable[..., Task]) -> None:
    """`factory(config, *, batch_size, seed) -> Task`."""
    assert dataclasses.is_dataclass(config_cls), config_cls
    _REGISTRY[kind] = (config_cls, factory)


def task_kinds() -> list[str]:
    """The registered (built-in) task kinds; plug-ins are named python:module:function instead."""
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


def make_task(config: Any, *, batch_size: int = 32, seed: int = 0, device: str = "cpu") -> Task:
    """Build the task; `batch_size` and `seed` come from the run config (sync.inner, run.seed),
    `device` is where the region trains (a plug-in may put its data there). A plug-in factory gets
    each of the three it names in its signature (or takes through **kwargs), unless its options
    already set it."""
    _load_builtin()
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


def _load_builtin() -> None:
    # Importing the modules registers them; done lazily so `geofed validate` stays fast.
    from . import builtin  # noqa: F401
