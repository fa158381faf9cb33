"""The count sketch behind the consensus distance of DiLoCo runs (regions/sketch.py)."""

from __future__ import annotations

import pytest
import torch

from geofed.regions.sketch import consensus_from_sketches, count_sketch


def _models(spread: float, n: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(300, 200, generator=g), torch.randn(200, generator=g)]
    return [[t + spread * torch.randn(t.shape, generator=g) for t in base] for _ in range(n)]


def _exact(models) -> float:
    mean = [torch.stack(ts).mean(0) for ts in zip(*models)]
    spread = sum(sum(((t - m) ** 2).sum() for t, m in zip(ts, mean)) for ts in models) / len(models)
    return float(spread.sqrt() / torch.sqrt(sum((m ** 2).sum() for m in mean)))


def test_equal_models_have_equal_sketches_and_zero_distance():
    models = _models(0.0)
    sketches = [count_sketch(m, seed=7) for m in models]
    assert all(torch.equal(sketches[0], s) for s in sketches)
    assert consensus_from_sketches(sketches) == 0.0


@pytest.mark.parametrize("spread", [1e-5, 1e-2, 0.3])
def test_the_sketch_estimates_the_consensus_distance_within_a_few_percent(spread):
    models = _models(spread)
    estimate = consensus_from_sketches([count_sketch(m) for m in models])
    assert estimate == pytest.approx(_exact(models), rel=0.08)


def test_the_sketch_is_linear_and_the_seed_matters():
    a, b = _models(0.1, n=2)
    sa, sb = count_sketch(a), count_sketch(b)
    diff = count_sketch([x - y for x, y in zip(a, b)])
    assert torch.allclose(sa - sb, diff, atol=1e-4)  # float32 differences, rounded once more
    assert not torch.equal(count_sketch(a, seed=1), sa)
    assert consensus_from_sketches([]) is None
