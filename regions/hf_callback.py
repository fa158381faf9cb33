"""GeofedCallback: a Hugging Face ``transformers.Trainer`` trained across geofed's regions.

The loop API (regions/loop.py) for a training loop one does not write: ``transformers.Trainer``
owns the loop, and this callback is where it meets geofed. ``Trainer.train()`` builds the optimizer
and learning-rate scheduler inside itself, so ``ctx.sync`` cannot be called before it:
``on_train_begin`` receives both and calls ``ctx.sync(model, optimizer, state=...)`` there (the
scheduler is added to the checkpointed user state as ``"lr_scheduler"``); ``on_step_end`` (after each
optimizer step) calls ``sync.step(loss)`` and, once ``sync.should_stop``, sets
``control.should_training_stop``, so ``train()`` returns after the run's final outer step.

The loss: callbacks are not given it, so a forward hook on the model keeps the training forward
passes' ``loss`` outputs of the step (with gradient accumulation, several): their mean, or their sum
when transformers passed ``num_items_in_batch`` to the model (each part is then already divided by
the whole step's items). A model whose outputs have no ``loss`` (a ``compute_loss`` of one's own)
reports none (``sync.step(loss=None)``), and the round's train_loss is then absent.

Needs ``pip install 'geofed[hf]'`` (transformers and accelerate); nothing else in geofed imports
this module. Example: examples/hf_trainer.py; docs/own-loop.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

try:
    from transformers import TrainerCallback
except ImportError as exc:  # the extra is optional; say which install brings it
    raise ImportError(f"geofed.regions.hf_callback needs transformers: pip install 'geofed[hf]' ({exc})") from exc

if TYPE_CHECKING:
    from .loop import RegionContext, Sync


class GeofedCallback(TrainerCallback):
    """Syncs a ``transformers.Trainer``'s training across geofed's regions (see the module's text).

    ``state``: more objects with state_dict/load_state_dict for the run's checkpoints (the
    Trainer's scheduler is always there); ``evaluate``/``examples``: passed on to ``ctx.sync``.
    ``sync`` is the loop API's Sync once training has begun (its round, H, should_stop).
    """

    def __init__(self, ctx: RegionContext, *, state: dict[str, Any] | None = None,
                 evaluate: Callable[[torch.nn.Module], Any] | None = None, examples: int | None = None):
        self.ctx = ctx
        self.user_state = dict(state or {})
        self.evaluate, self.examples = evaluate, examples
        self.sync: Sync | None = None
        self.losses = StepLosses()
        self._hook: torch.utils.hooks.RemovableHandle | None = None

    def on_train_begin(self, args, state, control, *, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        """Hands the model and the Trainer's optimizer to geofed; returns once the first round starts."""
        if model is None or optimizer is None:
            raise ValueError("GeofedCallback: transformers gave on_train_begin no model or optimizer "
                             "(a transformers.Trainer passes both; call it only from one)")
        if self.sync is not None:
            raise RuntimeError("GeofedCallback: train() was called twice; one geofed run takes one training")
        user_state = dict(self.user_state)
        if lr_scheduler is not None:
            user_state.setdefault("lr_scheduler", lr_scheduler)
        self._hook = model.register_forward_hook(self.losses, with_kwargs=True)
        self.sync = self.ctx.sync(model, optimizer, state=user_state, evaluate=self.evaluate, examples=self.examples)
        # A resumed run that had already ended: transformers checks the flag only after a step, so it
        # takes one (on the user's model, after the run's result was written) and then stops.
        if self.sync.should_stop:
            control.should_training_stop = True
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        """A new optimizer step: the losses kept are this step's from here on."""
        self.losses.clear()

    def on_step_end(self, args, state, control, **kwargs):
        """Counts the optimizer step; at the round's last step, blocks while geofed exchanges and
        takes the outer step, and stops training once the run is over."""
        assert self.sync is not None, "on_step_end before on_train_begin"
        self.sync.step(loss=self.losses.take())
        if self.sync.should_stop:
            control.should_training_stop = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        """Removes the loss hook: the model may be used (evaluated, saved) without it."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None



class StepLosses:
    """The forward hook that keeps one optimizer step's training losses. An object of its own, holding
    nothing but them: geofed evaluates on a deep copy of the model (Region.evaluate_params), which
    copies its hooks too, and a hook bound to the callback would drag the region's context (threads,
    locks) into that copy and fail it."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []
        self.summed = False  # the parts are fractions of the step's whole (num_items_in_batch)

    def __call__(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        """Forward hook (with_kwargs): keep a training forward pass's scalar `loss` output."""
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if module.training and isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self.parts.append(loss.detach())
            self.summed = kwargs.get("num_items_in_batch") is not None

    def clear(self) -> None:
        """Forget what was kept (a new step begins)."""
        self.parts.clear()

    def take(self) -> float | None:
        """The step's loss (the parts' sum or mean, see `summed`), and forget them; None if none came."""
        if not self.parts:
            return None
        parts = torch.stack([x.float() for x in self.parts])
        self.parts.clear()
        return float(parts.sum() if self.summed else parts.mean())
