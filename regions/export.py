"""A run's model in standard formats: the regions' averaged model as a plain ``state_dict``,
written as safetensors (``model.safetensors``) or a ``torch.save`` file that
``torch.load(weights_only=True)`` opens, with no geofed header (docs/export.md).

"A region's result" is the parameters its sync algorithm calls the run's result
(``eval_params``: DiLoCo's global model, gossip's and all-reduce's own model) over the model's
other state (buffers); "the averaged model" is the element-wise mean of the regions' results,
which for DiLoCo and all-reduce over a full topology is every region's model alike.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

import torch

FORMATS = ("safetensors", "torch")


def trainable_names(model: torch.nn.Module) -> list[str]:
    """Names of the trainable parameters, in the order of ``model.parameters()`` (the order every
    list of parameters in geofed uses: messages, eval_params, checkpoints' global models)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def result_state(model: torch.nn.Module, params: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with its trainable parameters replaced by `params` (detached copies in
    host memory: the driver that writes the file may have no GPU)."""
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    names = trainable_names(model)
    if len(names) != len(params):
        raise ValueError(f"the model has {len(names)} trainable parameters, the result {len(params)}")
    for name, p in zip(names, params):
        state[name] = p.detach().to("cpu", copy=True)
    return state


def average_states(states: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The element-wise mean of floating-point entries (``torch.stack(...).mean(0)``, as the run's
    evaluation of the average does); other entries (integer counters) are the first state's."""
    if not states:
        raise ValueError("no region state to average")
    out = {}
    for key, first in states[0].items():
        if first.is_floating_point():
            out[key] = torch.stack([s[key] for s in states]).mean(0)
        else:
            out[key] = first.clone()
    return out


def params_of(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The trainable parameters of `state`, in ``model.parameters()`` order."""
    return [state[n] for n in trainable_names(model)]


def checkpoint_result(model: torch.nn.Module, state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A region checkpoint's result (regions/checkpoint.py: ``model``, ``algorithm``, ...): DiLoCo's
    global model (``algorithm.global``) over the model's state, else the model's own state."""
    model_state = state["model"]
    glob = (state.get("algorithm") or {}).get("global")
    if glob is None:
        return {k: v.clone() for k, v in model_state.items()}
    model.load_state_dict(model_state)
    return result_state(model, glob)


def encode(state: Mapping[str, torch.Tensor], fmt: str, metadata: Mapping[str, str] | None = None) -> bytes:
    """The bytes of `state` as a safetensors file (`metadata` in its header) or a ``torch.save``
    file of the plain state_dict."""
    # Own contiguous storage per tensor: safetensors refuses shared (tied) and strided tensors.
    plain = {k: v.detach().contiguous().clone() for k, v in state.items()}
    if fmt == "safetensors":
        from safetensors.torch import save

        return save(plain, metadata=dict(metadata or {}))
    if fmt == "torch":
        buf = io.BytesIO()
        torch.save(plain, buf)
        return buf.getvalue()
    raise ValueError(f"format: one of {', '.join(FORMATS)}, got {fmt!r}")
