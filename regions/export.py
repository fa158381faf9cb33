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
    host memory: the driver that writes the file may have no GPU). Each entry is copied once: the
    model's own trainable parameters, replaced anyway, are not copied first (a model's worth less
    at the run's end, issue 39)."""
    names = trainable_names(model)
    if len(names) != len(params):
        raise ValueError(f"the model has {len(names)} trainable parameters, the result {len(params)}")
    given = dict(zip(names, params))
    state = {k: given.pop(k, v).detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    state.update({name: p.detach().to("cpu", copy=True) for name, p in given.items()})
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


def named_result(state: Mapping[str, Any], names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """A region checkpoint's result by name, with no model class (``geofed export`` of a run
    directory must not build, let alone import, the model of a plug-in it names): the model's own
    state, with DiLoCo's global model (``algorithm.global``, a list in ``model.parameters()``
    order) put under the names of the trainable parameters. `names` are those names when the
    caller knows them; else `parameter_names` finds them. ValueError naming the key when the
    checkpoint's tensors do not fit together."""
    model_state = state.get("model") if isinstance(state, Mapping) else None
    if not isinstance(model_state, Mapping) or not model_state:
        raise ValueError("model: missing, or not a mapping of tensors")
    for key, value in model_state.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise ValueError(f"model: {str(key)[:80]!r} is not a named tensor")
    algorithm = state.get("algorithm")
    glob = algorithm.get("global") if isinstance(algorithm, Mapping) else None
    out = {k: v.detach().clone() for k, v in model_state.items()}
    if glob is None:
        return out
    if not isinstance(glob, (list, tuple)) or not all(isinstance(g, torch.Tensor) for g in glob):
        raise ValueError("algorithm.global: not a list of tensors")
    names = list(parameter_names(model_state, glob) if names is None else names)
    if len(names) != len(glob):
        raise ValueError(f"algorithm.global: {len(glob)} tensors, the model has {len(names)} trainable parameters")
    aliases = _aliases(model_state)
    for name, g in zip(names, glob):
        if name not in out or tuple(out[name].shape) != tuple(g.shape):
            raise ValueError(f"algorithm.global: a tensor of shape {list(g.shape)} for {name!r}, which the model "
                             + (f"holds as {list(out[name].shape)}" if name in out else "does not have"))
        for key in [name, *aliases.get(name, ())]:  # a tied weight is one parameter under two names
            out[key] = g.detach().clone()
    return out


def parameter_names(model_state: Mapping[str, torch.Tensor], glob: Sequence[torch.Tensor]) -> list[str]:
    """The names of `glob`'s tensors in `model_state`, read from the state alone: a state_dict lists
    each module's parameters before its buffers, in the order of ``model.parameters()``, so the
    trainable parameters are a subsequence of its keys (a tied weight's second name skipped, as
    ``parameters()`` skips it). ValueError when no subsequence has `glob`'s shapes, or more than one
    does (buffers or frozen parameters shaped like the parameters around them): only the model
    class could tell then."""
    keys = [k for k in model_state if k not in {a for names in _aliases(model_state).values() for a in names}]
    shapes = [tuple(model_state[k].shape) for k in keys]
    want = [tuple(g.shape) for g in glob]
    ways = [1] + [0] * len(want)  # ways[j]: subsequences of the keys so far with want[:j]'s shapes (capped at 2)
    for shape in shapes:
        for j in range(len(want) - 1, -1, -1):
            if want[j] == shape:
                ways[j + 1] = min(2, ways[j + 1] + ways[j])
    if ways[-1] == 0:
        raise ValueError(f"algorithm.global: {len(want)} tensors whose shapes do not fit the model's {len(keys)} tensors "
                         "in order: the checkpoint's global model is not of its model")
    if ways[-1] > 1:
        raise ValueError("algorithm.global: its tensors fit the model's in more than one way (buffers or frozen "
                         "parameters shaped like parameters); only the model class can name them")
    names, j = [], 0
    for key, shape in zip(keys, shapes):  # the leftmost fit is the only one
        if j < len(want) and shape == want[j]:
            names.append(key)
            j += 1
    return names


def _aliases(model_state: Mapping[str, torch.Tensor]) -> dict[str, list[str]]:
    """First name -> later names of the same tensor (a tied weight: torch.save keeps the sharing)."""
    first: dict[tuple, str] = {}
    out: dict[str, list[str]] = {}
    for key, t in model_state.items():
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and ident in first:
            out.setdefault(first[ident], []).append(key)
        else:
            first.setdefault(ident, key)
    return out


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
