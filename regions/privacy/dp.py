"""Differential privacy's two mechanisms (docs/privacy.md):

- record-level (DP-SGD): per-example gradients by torch.func (vmap of grad over the batch), each
  clipped to L2 norm `clip`, summed, Gaussian noise of std `noise_multiplier * clip` added, divided
  by the expected batch size; one example moves the summed gradient by at most `clip`;
- update-level: a region's whole pseudo-gradient clipped to `clip` and noised the same way, so a
  region's contribution to a round is bounded whatever its data (cheap: one norm per round).

torch.func rather than Opacus: no dependency and no module wrapping, and it works on any task
whose `loss(model, batch)` takes a tensor or a tuple of tensors with the examples along dim 0
(a batch of one is a valid batch). Models with batch norm mix examples and are refused.

A region's side of both is `DpHook`, a round hook (regions/hooks.py): it reads the round's plan
(mode, clip, noise multiplier) and either makes the region's inner steps DP-SGD steps (record) or
clips and noises the update the region contributes (update). The driver's side, the accountant that
picks the noise multiplier, spends the budget and ends the run at target_epsilon, is
orchestrator/driver/privacy.py's DpBudget; the config and its rules are orchestrator/config/privacy.py.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from ..hooks import RoundHook

if TYPE_CHECKING:
    from ..messages import RoundPlan

LossFn = Callable[[nn.Module, Any], torch.Tensor]


class _LossModule(nn.Module):
    """`loss(model, batch)` as a module, so functional_call can swap the model's parameters."""

    def __init__(self, model: nn.Module, loss: LossFn):
        super().__init__()
        self.model, self._loss = model, loss

    def forward(self, *batch):
        return self._loss(self.model, batch[0] if len(batch) == 1 else tuple(batch))


def check_dp_model(model: nn.Module) -> None:
    """Refuse a model whose output for one example depends on the others (batch norm)."""
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            raise ValueError(f"model: {name or 'the model'} is batch norm, which mixes examples; record-level DP "
                             "needs per-example gradients (use group or layer norm)")


def per_example_grads(model: nn.Module, loss: LossFn, batch: Any) -> dict[str, torch.Tensor]:
    """name -> gradient of every trainable parameter, one row per example of `batch`."""
    check_dp_model(model)
    wrapper = _LossModule(model, loss)
    params = {f"model.{n}": p.detach() for n, p in model.named_parameters() if p.requires_grad}
    buffers = {f"model.{n}": b for n, b in model.named_buffers()}
    parts = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)

    def one(p, *example):
        return functional_call(wrapper, {**p, **buffers}, tuple(e.unsqueeze(0) for e in example))

    grads = vmap(grad(one), in_dims=(None,) + (0,) * len(parts), randomness="different")(params, *parts)
    return {n.removeprefix("model."): g for n, g in grads.items()}


def clip_per_example(grads: dict[str, torch.Tensor], clip: float) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Every example's gradient (over all parameters together) scaled to L2 norm <= clip; returns
    the clipped gradients and each example's norm before clipping."""
    if not clip > 0:
        raise ValueError(f"clip: must be > 0, got {clip}")
    flat = [g.flatten(1) for g in grads.values()]  # flatten, not reshape(n, -1): a Poisson batch may be empty
    norms = torch.linalg.vector_norm(torch.cat(flat, dim=1), dim=1)
    factor = (clip / (norms + 1e-12)).clamp(max=1.0)
    return {n: g * factor.view(-1, *([1] * (g.dim() - 1))) for n, g in grads.items()}, norms


def dp_gradients(model: nn.Module, loss: LossFn, batch: Any, *, clip: float, noise_multiplier: float,
                 expected_batch: float, generator: torch.Generator | None = None) -> dict[str, float]:
    """One DP-SGD gradient written into each parameter's `.grad`: the sum of clipped per-example
    gradients plus N(0, (noise_multiplier * clip)^2) per coordinate, over `expected_batch` (the
    Poisson sampling rate times the shard size: dividing by the drawn size would leak it). The
    caller's optimizer then steps as usual. Returns the clipped fraction and the mean norm."""
    if not expected_batch > 0 or noise_multiplier < 0:
        raise ValueError("expected_batch: must be > 0 (and noise_multiplier >= 0)")
    grads = per_example_grads(model, loss, batch)
    clipped, norms = clip_per_example(grads, clip)
    std = noise_multiplier * clip
    for name, p in model.named_parameters():
        if name not in clipped:
            continue
        total = clipped[name].sum(0)
        if std > 0:
            total = total + std * torch.randn(total.shape, generator=generator, dtype=total.dtype).to(total.device)
        p.grad = (total / expected_batch).to(p.dtype)
    return {"clipped_fraction": float((norms > clip).float().mean()) if norms.numel() else 0.0,
            "mean_grad_norm": float(norms.mean()) if norms.numel() else 0.0}


def poisson_sample(n: int, rate: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Indices of a Poisson-sampled batch: each of n examples independently with probability
    `rate` (the sampling the accountant's subsampled-Gaussian bound assumes; may be empty)."""
    if not 0 < rate <= 1:
        raise ValueError(f"rate: must be in (0, 1], got {rate}")
    return torch.nonzero(torch.rand(n, generator=generator) < rate).flatten()


def clip_and_noise_update(tensors: Sequence[torch.Tensor], *, clip: float, noise_multiplier: float,
                          generator: torch.Generator | None = None, noise_share: float = 1.0) -> dict[str, float]:
    """Update-level DP, in place: the whole update (all tensors together) scaled to L2 norm <= clip,
    then N(0, noise_share * (noise_multiplier * clip)^2) added to every value.

    noise_share 1: each region's update is private on its own (local DP). With secure aggregation
    only the sum is seen, so n regions may each add 1/n of the variance (distributed DP): the sum
    then carries the full noise. Returns the norm before clipping and the scale applied."""
    if not clip > 0 or noise_multiplier < 0 or not 0 < noise_share <= 1:
        raise ValueError("clip: must be > 0, noise_multiplier >= 0 and noise_share in (0, 1]")
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors])))
    if not torch.isfinite(torch.tensor(norm)):
        raise ValueError("update: holds a non-finite value; it cannot be clipped")
    scale = min(1.0, clip / (norm + 1e-12))
    std = noise_multiplier * clip * noise_share ** 0.5
    for t in tensors:
        t.mul_(scale)
        if std > 0:
            t.add_(torch.randn(t.shape, generator=generator, dtype=t.dtype).to(t.device), alpha=std)
    return {"update_norm": norm, "clip_scale": scale}


def noise_generator(seed: int | None = None, *, region: int = 0, stream: str = "record") -> torch.Generator:
    """A generator for DP noise. Without a seed (privacy.dp.seeded_noise false, the default) it is
    seeded from the OS's randomness, not the run seed: whoever knows a noise draw can subtract it.
    (Like Opacus without secure_mode, the Mersenne Twister itself is not a cryptographic generator;
    a resumed run draws fresh noise, not the same.)

    With a seed (seeded_noise true: reproducible research and benchmarks, no privacy against anyone
    who knows the config) the generator is seeded by a hash of (seed, region, stream): its own
    stream, apart from the data sampling's seed * 1000 + region, so the noise is not correlated
    with which examples are drawn."""
    if seed is None:
        return torch.Generator().manual_seed(secrets.randbits(63))
    digest = hashlib.sha256(f"geofed-dp-noise/{stream}/{seed}/{region}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1)


def dp_step(model: nn.Module, loss: LossFn, batch: Any, *, clip: float, noise_multiplier: float,
            expected_batch: float, generator: torch.Generator) -> float:
    """One record-level DP inner step's gradients (dp_gradients, into `.grad`) for a region's
    batch; returns the batch's loss (computed apart, without gradients, for the metrics)."""
    first = batch if isinstance(batch, torch.Tensor) else batch[0]
    with torch.no_grad():  # a Poisson batch may be empty: its gradient is the noise alone, its loss 0
        value = float(loss(model, batch)) if len(first) else 0.0
    dp_gradients(model, loss, batch, clip=clip, noise_multiplier=noise_multiplier, expected_batch=expected_batch,
                 generator=generator)
    return value


def dp_noise_seed(cfg: Any) -> int | None:
    """The seed of a run's DP noise: run.seed with privacy.dp.seeded_noise, else None (the OS's
    randomness). `cfg` is the run config (duck-typed)."""
    dp = getattr(getattr(cfg, "privacy", None), "dp", None)
    return int(cfg.run.seed) if getattr(dp, "seeded_noise", False) else None


class DpHook(RoundHook):
    """privacy.dp in a region's round (module docstring). `seed`: dp_noise_seed's (None: the OS's
    randomness); `region`: the region's index, so every region draws noise of its own."""

    def __init__(self, *, seed: int | None, region: int):
        self.seed, self.region = seed, region
        self.record_generator = noise_generator(seed, region=region, stream="record")
        self.update_generator: torch.Generator | None = None  # made on the first noised update
        self.recording: RoundPlan | None = None  # this round's plan while it runs record-level DP

    def plan(self, plan: RoundPlan) -> RoundPlan:
        self.recording = plan if plan.dp_mode == "record" and plan.dp_noise is not None else None
        return plan

    def record_step(self, model: nn.Module, loss: LossFn, batch: Any, *, expected_batch: float) -> float:
        """One inner step's gradients under record-level DP (dp_step); only while `recording`."""
        plan = self.recording
        assert plan is not None and plan.dp_noise is not None, "record_step outside a record-level DP round"
        return dp_step(model, loss, batch, clip=plan.dp_clip, noise_multiplier=plan.dp_noise,
                       expected_batch=expected_batch, generator=self.record_generator)

    def payload(self, plan: RoundPlan, tensors: list[torch.Tensor], metrics: dict[str, Any]) -> list[torch.Tensor]:
        """Update-level DP on what leaves the region: clipped to plan.dp_clip, Gaussian noise of
        plan.dp_noise x clip (local DP: secure aggregation's 1/n noise share is not wired). A copy:
        with overlap, `tensors` stays the region's own unsynced progress."""
        if plan.dp_mode != "update" or plan.dp_noise is None:
            return tensors
        if self.update_generator is None:
            self.update_generator = noise_generator(self.seed, region=self.region, stream="update")
        noised = [t.clone() for t in tensors]
        out = clip_and_noise_update(noised, clip=plan.dp_clip, noise_multiplier=plan.dp_noise,
                                    generator=self.update_generator)
        metrics["dp_update_norm"], metrics["dp_clip_scale"] = round(out["update_norm"], 6), round(out["clip_scale"], 6)
        return noised
