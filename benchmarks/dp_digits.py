"""Record-level DP on digits, 4 regions, DiLoCo's round in one process (no Ray, no network):
accuracy of non-private training against DP-SGD at epsilon 1, 4 and 8 (delta 1e-5), each region's
records accounted on its own shard. A stand-in until `geofed bench privacy` drives real runs
(docs/privacy.md); it shows what the mechanism and the accountant cost in accuracy.

    .venv/bin/python benchmarks/dp_digits.py [--rounds 30] [--H 50] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from geofed.regions.privacy.budget import PrivacyBudget
from geofed.regions.privacy.dp import dp_gradients, poisson_sample
from geofed.regions.tasks.base import make_task
from geofed.regions.tasks.digits import DigitsConfig

REGIONS = 4


def run_arm(task, *, rounds: int, H: int, batch: int, lr: float, epsilon: float | None, seed: int = 0) -> dict:
    """DiLoCo rounds: every region H inner steps (Adam; DP-SGD gradients when epsilon is set) from
    the global model, then the outer Nesterov step (0.7, 0.9) on the mean pseudo-gradient."""
    gen = torch.Generator().manual_seed(seed)
    model = task.build_model(seed)
    shards = [task.shard(i, REGIONS, seed) for i in range(REGIONS)]
    data = [(s.x, s.y) for s in shards]
    smallest = min(len(x) for x, _ in data)
    budget = None
    if epsilon is not None:
        budget = PrivacyBudget.plan(mode="record", noise_multiplier=None, target_epsilon=epsilon, delta=1e-5,
                                    rounds=rounds, steps_per_round=H, batch_size=batch, smallest_shard=smallest)
    global_params = [p.detach().clone() for p in model.parameters()]
    outer = torch.optim.SGD(global_params, lr=0.7, momentum=0.9, nesterov=True)
    t0 = time.perf_counter()
    for _ in range(rounds):
        deltas = []
        for x, y in data:
            with torch.no_grad():
                for p, g in zip(model.parameters(), global_params):
                    p.copy_(g)
            inner = torch.optim.Adam(model.parameters(), lr=lr)
            for _ in range(H):
                if budget is None:
                    idx = torch.randint(len(x), (batch,), generator=gen)
                    inner.zero_grad()
                    task.loss(model, (x[idx], y[idx])).backward()
                else:
                    idx = poisson_sample(len(x), batch / len(x), gen)
                    dp_gradients(model, task.loss, (x[idx], y[idx]), clip=1.0, noise_multiplier=budget.noise_multiplier,
                                 expected_batch=float(batch), generator=gen)
                inner.step()
            deltas.append([g - p.detach() for g, p in zip(global_params, model.parameters())])
        for k, g in enumerate(global_params):
            g.grad = torch.stack([d[k] for d in deltas]).mean(0)
        outer.step()
        if budget is not None:
            budget.spend(H)
    with torch.no_grad():
        for p, g in zip(model.parameters(), global_params):
            p.copy_(g)
    acc = task.evaluate(model).value
    out = {"accuracy": round(acc, 4), "seconds": round(time.perf_counter() - t0, 2)}
    if budget is not None:
        out |= {"epsilon": round(budget.epsilon(), 3), "noise_multiplier": round(budget.noise_multiplier, 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--H", type=int, default=50)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.003)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    task = make_task(DigitsConfig(), batch_size=args.batch)
    arms = {"plain": None, "dp_eps1": 1.0, "dp_eps4": 4.0, "dp_eps8": 8.0}
    rows = {name: run_arm(task, rounds=args.rounds, H=args.H, batch=args.batch, lr=args.lr, epsilon=eps)
            for name, eps in arms.items()}
    ratios = {"dp_eps8_acc_ratio": round(rows["dp_eps8"]["accuracy"] / rows["plain"]["accuracy"], 4)}
    if args.json:
        print(json.dumps({"arms": rows, "ratios": ratios}, indent=2))
        return
    for name, row in rows.items():
        print(f"{name:8s} " + "  ".join(f"{k} {v}" for k, v in row.items()))
    print("ratios", ratios)


if __name__ == "__main__":
    main()
