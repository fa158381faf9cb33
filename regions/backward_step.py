"""sync.inner.step_in_backward: the inner optimizer steps each parameter in the backward pass, as soon as
its gradient is complete, and lets that gradient go (issue 39, docs/bench-memory.md).

A step after the backward pass needs every parameter's gradient at once: a model's worth (4 B/param in
fp32) on top of what the region holds while its exchange runs in the background (overlap). Stepped in
the backward pass (torch's post-accumulate-grad hooks, the pattern of torch's "optimizer step in
backward" recipe), the gradients alive at once are those autograd has made but whose parameter's hook
has not run yet: about one parameter's.

The values are the same. AdamW and SGD step each parameter on its own gradient and state only (no norm
over all gradients), and a step of one parameter is the loop body of a step of all of them: on the CPU
torch runs them one tensor at a time either way, so the weights are bitwise equal (tests/unit/
test_backward_step.py). On a GPU torch's default `foreach` kernels group the tensors of a step, which
can round differently in the last bit.

It cannot serve a step that needs all gradients before any parameter moves: fp16's loss scaler (it
unscales and checks every gradient for overflow first), record-level DP (per-example clipping),
gradient tracking's correction (`before_step`), a region of several workers (their gradients are
all-reduced after the backward pass) and the all-reduce baseline (it exchanges the gradient). There the
region steps after the backward pass as before (`Region.inner_steps` decides).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class BackwardStep:
    """Hooks on `params` that step `optimizer` for each parameter as its gradient is accumulated, while
    armed by `run`; disarmed (any other backward pass: gap fill's, the all-reduce baseline's) they do
    nothing."""

    def __init__(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer):
        self.params, self.optimizer = list(params), optimizer
        self._armed = False
        self._reached: set[int] = set()
        self._handles = [p.register_post_accumulate_grad_hook(self._stepped) for p in self.params]

    def _stepped(self, p: torch.Tensor) -> None:
        if not self._armed:
            return
        # Every other parameter's gradient is None here (stepped and let go, or not made yet), so the
        # optimizer's step moves this parameter alone.
        self.optimizer.step()
        p.grad = None
        self._reached.add(id(p))

    def run(self, backward: Callable[[], None]) -> None:
        """`backward()` with every parameter stepped as its gradient completes; a parameter the pass
        did not reach then steps on zeros (as a step after the backward pass does), and no gradient is
        left behind."""
        self._reached.clear()
        for p in self.params:
            p.grad = None
        self._armed = True
        try:
            backward()
        finally:
            self._armed = False
        missed = [p for p in self.params if id(p) not in self._reached]
        if missed:
            for p in missed:
                p.grad = torch.zeros_like(p)
            self.optimizer.step()
            for p in missed:
                p.grad = None

    def close(self) -> None:
        """Remove the hooks (the region is done with its model)."""
        for h in self._handles:
            h.remove()
        self._handles = []


__all__ = ["BackwardStep"]
