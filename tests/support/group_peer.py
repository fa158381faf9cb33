"""Worker 1 of 2 of a region's process group (regions/workers.py) in a process of its own, for
tests/unit/test_region_workers.py: it reads the group's HOST:PORT from stdin, joins, follows worker
0's commands with a one-parameter region, and prints what it was told as one JSON line.

    python -m support.group_peer REGION TIMEOUT_S
"""

from __future__ import annotations

import json
import sys

import torch

from geofed.regions.workers import WorkerGroup


class OneParameter:
    """What `WorkerGroup.follow` calls on a region: one parameter, its gradient all-reduced each step."""

    def __init__(self, group: WorkerGroup):
        self.group = group
        self.model = torch.nn.Linear(1, 1, bias=False)
        self.seen: list[str] = []

    def forward_backward(self) -> float:
        self.seen.append("step")
        loss = self.model(torch.ones(1, 1)).sum()
        loss.backward()
        return self.group.average_grads(list(self.model.parameters()), loss)

    def optimizer_step(self, lr_scale: float) -> None:
        pass

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.seen.append("state")
        self.model.load_state_dict(state["model"])


def main(region: str, timeout_s: float) -> None:
    group = WorkerGroup(region, 1, 2, timeout_s=timeout_s)
    group.join(sys.stdin.readline().strip(), torch.device("cpu"))
    peer = OneParameter(group)
    steps = group.follow(peer)
    print(json.dumps({"steps": steps, "seen": peer.seen, "weight": peer.model.weight.item()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
