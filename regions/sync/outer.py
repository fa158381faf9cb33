"""DiLoCo's outer optimizer (``sync.outer``): any ``torch.optim.Optimizer``, built by one factory.

``sync.outer.kind`` names it: ``nesterov`` (the default: SGD with Nesterov momentum, DiLoCo's 0.7 /
0.9), ``sgd`` (heavy-ball momentum; momentum 0 is plain SGD), ``adam``, or a plug-in
``python:module:Name`` (imported after putting ``sync.outer.path`` on sys.path): a callable its author
marked with ``@outer_optimizer`` that takes the parameters, ``lr=sync.outer.lr`` and
``sync.outer.options`` as keywords and returns an Optimizer
(docs/outer-optimizers.md shows one). As with plug-in tasks (regions/tasks/configs.py), a config
can make geofed call only a callable that was marked: naming ``os:system`` is refused before
anything is called.

`preview_step` is the one place that asks "what would a step make of these parameters" without
taking it (eager overlap's start, an overlapped exchange's evaluation): it steps a deep copy of
the real optimizer, so it is right for whatever optimizer runs, Adam's moments included.
"""

from __future__ import annotations

import copy
import importlib
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

BUILT_IN = ("nesterov", "sgd", "adam")
PLUGIN_KIND = re.compile(r"python:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*", re.ASCII)
OuterFactory = Callable[..., torch.optim.Optimizer]
# id -> the factory itself: a mark by identity, which no look-alike object can fake.
_MARKED: dict[int, OuterFactory] = {}


class OuterSettings(Protocol):
    """``sync.outer`` as the factory reads it (orchestrator/config/sync_parts.py: OuterOptimizer)."""

    kind: str
    lr: float
    momentum: float
    beta2: float
    eps: float
    path: str | None
    options: Mapping[str, Any]


def outer_optimizer(factory: OuterFactory) -> OuterFactory:
    """Mark `factory` (a function or an Optimizer class) as a geofed outer optimizer, so that
    ``sync.outer.kind: python:module:Name`` may name it."""
    if not callable(factory):
        raise TypeError(f"outer_optimizer: {factory!r} is not callable")
    _MARKED[id(factory)] = factory
    return factory


def is_outer_optimizer(obj: object) -> bool:
    """Whether `obj` was marked by @outer_optimizer."""
    return _MARKED.get(id(obj)) is obj


def make_outer_optimizer(settings: OuterSettings, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    """The outer optimizer `settings` names, over `params` (leaf tensors whose .grad the caller sets
    to the mixed pseudo-gradient before each step)."""
    kind, lr, mom = settings.kind, settings.lr, settings.momentum
    if kind == "nesterov":  # torch refuses Nesterov without momentum: momentum 0 is plain SGD
        return torch.optim.SGD(list(params), lr=lr, momentum=mom, nesterov=mom > 0)
    if kind == "sgd":
        return torch.optim.SGD(list(params), lr=lr, momentum=mom)
    if kind == "adam":
        return torch.optim.Adam(list(params), lr=lr, betas=(mom, settings.beta2), eps=settings.eps)
    opt = load_outer_factory(kind, settings.path)(list(params), lr=lr, **dict(settings.options))
    if not isinstance(opt, torch.optim.Optimizer):
        raise ValueError(f"sync.outer.kind: {kind!r} returned a {type(opt).__name__}, not a torch.optim.Optimizer")
    return opt


def load_outer_factory(kind: str, path: str | None = None) -> OuterFactory:
    """The marked factory ``python:module:Name`` names; ValueError naming sync.outer.kind otherwise.
    Importing the module runs its top-level code: a config naming a plug-in is code."""
    if not PLUGIN_KIND.fullmatch(kind):
        raise ValueError(f"sync.outer.kind: expected one of {', '.join(BUILT_IN)} or python:module:Name, got {kind!r}")
    _, module_name, name = kind.split(":")
    top = module_name.split(".")[0]
    if top in sys.stdlib_module_names or top in ("geofed", "torch"):
        raise ValueError(f"sync.outer.kind: {kind!r} names {top!r}, which holds no marked outer optimizer "
                         f"(a plug-in is your own callable, marked @outer_optimizer)")
    if path is not None and path not in sys.path:
        sys.path.insert(0, path)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - the user's module: any error it raises, on one line
        raise ValueError(f"sync.outer.kind: cannot import {module_name!r} for {kind!r}: {type(exc).__name__}: {exc}") from None
    factory = vars(module).get(name)  # a plain lookup: no module __getattr__
    if factory is None:
        raise ValueError(f"sync.outer.kind: module {module_name!r} has no {name!r}")
    if not is_outer_optimizer(factory):
        raise ValueError(f"sync.outer.kind: {kind!r} is not marked; mark it with "
                         f"@geofed.regions.sync.outer_optimizer (a config may only name marked factories)")
    return factory


def preview_step(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                 grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """What ``opt.step()`` would make of `params` (tensors `opt` steps) with gradients `grads`,
    computed on a deep copy of `opt`: neither `params` nor `opt`'s state (momentum, moments, step
    counts) change. The copy's memo maps each parameter to its twin in the groups and the state alike."""
    # The twins' gradients are `grads` (copied): seeded in the memo, deepcopy hands them to the twins
    # instead of copying the parameters' own .grad first (a model's worth of memory less).
    memo: dict[int, Any] = {id(p.grad): g.detach().clone() for p, g in zip(params, grads) if p.grad is not None}
    twin = copy.deepcopy(opt, memo)
    out = []
    for p, g in zip(params, grads):
        t = memo[id(p)]
        if p.grad is None:
            t.grad = g.detach().clone()
        out.append(t)
    twin.step()
    return [t.detach() for t in out]


__all__ = ["BUILT_IN", "OuterSettings", "is_outer_optimizer", "load_outer_factory", "make_outer_optimizer",
           "outer_optimizer", "preview_step"]
