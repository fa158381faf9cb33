"""sync.inner.step_in_backward (regions/backward_step.py): the inner optimizer steps each parameter in
the backward pass. The weights and optimizer state must be bitwise those of a step after the backward
pass (on the CPU), while at most one parameter's gradient is alive at a time."""

from __future__ import annotations

import copy

import pytest
import torch

from geofed.orchestrator.config import config_from_mapping
from geofed.regions.backward_step import BackwardStep
from geofed.regions.inprocess import InProcessRegions
from geofed.regions.messages import RoundPlan


class _Tied(torch.nn.Module):
    """Tied input/output weights (a gradient accumulated from two uses), an unused parameter (no
    gradient: it steps on zeros), a bias."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.unused = torch.nn.Parameter(torch.randn(3))

    def forward(self, x):
        h = torch.tanh(self.mid(self.emb(x)))
        return h @ self.emb.weight.t()


def _loss(model, x):
    return torch.nn.functional.cross_entropy(model(x).reshape(-1, 11), x.reshape(-1))


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_weights_and_state_are_bitwise_those_of_a_step_after_backward(kind):
    torch.manual_seed(0)
    a = _Tied()
    b = copy.deepcopy(a)

    def opt(m):
        if kind == "adamw":
            return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01)
        return torch.optim.SGD(m.parameters(), lr=1e-1, momentum=0.9, weight_decay=0.01)

    oa, ob = opt(a), opt(b)
    stepper = BackwardStep(list(b.parameters()), ob)
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        x = torch.randint(0, 11, (4, 5), generator=gen)
        oa.zero_grad(set_to_none=True)
        _loss(a, x).backward()
        for p in a.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        oa.step()
        stepper.run(_loss(b, x).backward)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
        assert pb.grad is None, f"{name}: a gradient was left behind"
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for field in sa[k]:
            assert torch.equal(torch.as_tensor(sa[k][field]), torch.as_tensor(sb[k][field])), (k, field)


def test_at_most_one_gradient_is_alive_at_a_time():
    torch.manual_seed(0)
    model = _Tied()
    params = list(model.parameters())
    alive = []
    for p in params:  # registered first: runs before the step's hook, while p's gradient is complete
        p.register_post_accumulate_grad_hook(lambda _p: alive.append(sum(q.grad is not None for q in params)))
    stepper = BackwardStep(params, torch.optim.AdamW(params, lr=1e-2))
    stepper.run(_loss(model, torch.randint(0, 11, (4, 5))).backward)
    assert len(alive) == 3  # emb (tied, once), mid.weight, mid.bias: not `unused`
    assert max(alive) == 1, alive
    stepper.close()


def _region_cfg(tinyshakespeare_txt, step_in_backward: bool):
    return config_from_mapping({
        "run": {"seed": 0, "checkpoint_every": 0, "eval_every": 0},
        "task": {"kind": "gpt", "path": str(tinyshakespeare_txt), "n_layer": 2, "n_head": 2, "d_model": 32,
                 "context": 16, "max_chars": 5_000, "eval_sequences": 2},
        "regions": {"names": ["a", "b"]}, "network": {"emulation": {"mode": "none"}},
        "compression": {"codec": "int8", "error_feedback": True},
        "sync": {"overlap": True, "policy": {"kind": "fixed", "H": 3},
                 "inner": {"kind": "adamw", "batch_size": 2, "step_in_backward": step_in_backward},
                 "deadline": {"initial_s": 5.0, "min_s": 1.0, "max_s": 10.0}},
    })


def test_a_regions_run_is_bitwise_the_same_with_and_without(tinyshakespeare_txt, tmp_path):
    """Two regions, DiLoCo with delayed overlap, int8 + error feedback: 3 rounds of 3 inner steps."""
    finals = {}
    for flag in (False, True):
        with InProcessRegions(_region_cfg(tinyshakespeare_txt, flag), tmp_path / str(flag)) as group:
            assert (group.workers["a"].backward_step is not None) == flag
            for r in range(3):
                group.run_round({reg: RoundPlan(round=r, H=3) for reg in ("a", "b")})
            finals[flag] = {reg: [p.detach().clone() for p in w.params] for reg, w in group.workers.items()}
    for reg in ("a", "b"):
        for x, y in zip(finals[False][reg], finals[True][reg]):
            assert torch.equal(x, y), reg
