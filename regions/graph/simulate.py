"""In-process decentralized federated graph learning: the algorithm without the runtime.

``simulate_dfgl`` runs what ``sync.algorithm: gossip`` does across region workers, in one
process: every round each region trains E local epochs (Adam, full batch on its subgraph),
then the regions run CHOCO-SGD gossip (Koloskova et al. 2019, arXiv 1902.00340) on their
parameters over a topology from geofed.p2p.topology, sending compressed differences to
public copies, and (by default) gossiping a gradient tracker too (tracking.py explains why
louvain regions need it). ``centralized`` and ``local_only`` are the two baselines of ``geofed bench
dfgl``. All three work on any Task whose shards yield full-batch views (gcn-planetoid).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from geofed.compression import Codec, decode_update, make_codec
from geofed.p2p.gossip import ChocoGossip, codec_compressor
from geofed.p2p.topology import StaticTopology, make_topology, topology_names
from geofed.regions.tasks.base import Task

from .tracking import GradientTracker, flat_params, load_flat_params

@dataclass(frozen=True, kw_only=True)
class DfglConfig:
    """Settings of one decentralized run (the runtime's sync.* keys, in one place)."""

    n_regions: int = 4
    rounds: int = 40
    local_epochs: int = 5
    topology: str = "ring"
    codec: Any = "int8"  # a geofed.compression spec; CHOCO needs a contractive one
    gamma: float = 1.0
    gossip_steps: int = 1
    tracking: bool = True
    lr: float = 0.01
    optimizer: str = "adam"
    momentum: float = 0.0
    eval_every: int = 0

    def __post_init__(self):
        if not 2 <= self.n_regions <= 256:
            raise ValueError(f"n_regions: must be in [2, 256], got {self.n_regions}")
        if self.rounds < 1 or self.local_epochs < 1 or self.gossip_steps < 1:
            raise ValueError("rounds: rounds, local_epochs and gossip_steps must be >= 1")
        if not 0 < self.gamma <= 1:
            raise ValueError(f"gamma: must be in (0, 1], got {self.gamma}")
        if not 0 < self.lr <= 10:
            raise ValueError(f"lr: must be in (0, 10], got {self.lr}")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer: must be adam or sgd, got {self.optimizer!r}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum: must be in [0, 1), got {self.momentum}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every: must be >= 0, got {self.eval_every}")
        if self.topology not in topology_names():
            raise ValueError(f"topology: unknown topology {self.topology!r} (known: {', '.join(topology_names())})")
        if not isinstance(make_topology(self.topology, self.n_regions), StaticTopology):
            # One public copy per region: every neighbour must get every message (as the runtime).
            raise ValueError(f"topology: CHOCO gossip needs a static topology, got {self.topology!r}")
        try:
            codec = make_codec(self.codec)
        except ValueError as exc:
            raise ValueError(f"codec: {exc}") from None
        if not codec.contractive:
            # CHOCO's public copies drift apart under an unbiased, rescaled compressor.
            raise ValueError(f"codec: CHOCO gossip needs a contractive codec, {codec.name} is not")


@dataclass(kw_only=True)
class DfglResult:
    region_acc: list[float]
    mean_acc: float  # mean over regions of each region's own model
    avg_model_acc: float  # the parameter average of all regions (what consensus converges to)
    consensus_distance: float  # sqrt(mean_i ||x_i - x_bar||^2)
    bytes_per_region: float  # mean bytes sent per region over the run (gossip + one-time halo)
    gossip_bytes_per_region: float
    halo_bytes_per_region: float
    epochs: int
    wall_s: float
    history: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


_flat = flat_params
_load_flat = load_flat_params


def _train_epochs(task: Task, model: nn.Module, opt: torch.optim.Optimizer, batch: Any, epochs: int) -> float:
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(epochs):
        opt.zero_grad(set_to_none=True)
        loss = task.loss(model, batch)
        loss.backward()
        opt.step()
    return float(loss.detach())


def make_optimizer(params, kind: str, lr: float, momentum: float = 0.0) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum)
    raise ValueError(f"optimizer: must be adam or sgd, got {kind!r}")


def _seeded(seed: int) -> torch.Generator:
    torch.manual_seed(seed)  # dropout draws from the global generator
    return torch.Generator().manual_seed(seed)


def centralized(task: Task, *, epochs: int = 200, lr: float = 0.01, seed: int = 0, optimizer: str = "adam",
                momentum: float = 0.0) -> dict[str, Any]:
    """One process, whole graph, same model and optimizer: the accuracy to match."""
    gen = _seeded(seed)
    t0 = time.perf_counter()
    model = task.build_model(seed)
    batch = next(task.shard(0, 1, seed).batches(gen))
    opt = make_optimizer(model.parameters(), optimizer, lr, momentum)
    _train_epochs(task, model, opt, batch, epochs)
    acc = task.evaluate(model).value
    return {"acc": acc, "bytes_per_region": 0.0, "wall_s": time.perf_counter() - t0, "epochs": epochs}


def local_only(task: Task, n_regions: int, *, epochs: int = 200, lr: float = 0.01, seed: int = 0,
               optimizer: str = "adam", momentum: float = 0.0) -> dict[str, Any]:
    """Each region trains alone on its subgraph; no exchange. Accuracy is the mean over regions."""
    gen = _seeded(seed)
    t0 = time.perf_counter()
    accs = []
    for r in range(n_regions):
        model = task.build_model(seed)
        batch = next(task.shard(r, n_regions, seed).batches(gen))
        opt = make_optimizer(model.parameters(), optimizer, lr, momentum)
        _train_epochs(task, model, opt, batch, epochs)
        accs.append(task.evaluate(model).value)
    return {"acc": sum(accs) / n_regions, "region_acc": accs, "bytes_per_region": 0.0,
            "wall_s": time.perf_counter() - t0, "epochs": epochs}


def consensus_distance(xs: list[torch.Tensor]) -> float:
    mean = torch.stack(xs).mean(0)
    return math.sqrt(float(sum(((x - mean) ** 2).sum() for x in xs)) / len(xs))


class _Region:
    """One region's model, inner optimizer, batch and gradient-tracking state."""

    def __init__(self, task: Task, cfg: DfglConfig, index: int, seed: int, gen: torch.Generator, codec: Codec):
        self.task = task
        self.model = task.build_model(seed)
        self.batch = next(task.shard(index, cfg.n_regions, seed).batches(gen))
        self.opt = make_optimizer(self.model.parameters(), cfg.optimizer, cfg.lr, cfg.momentum)
        self.x = _flat(self.model).clone()
        self.tracker = GradientTracker()
        self.shapes = [p.shape for p in self.model.parameters()]
        self.max_bytes = 8 * self.x.numel() + (1 << 20)
        compressor = codec_compressor(codec)
        self.choco = {"x": ChocoGossip(gamma=cfg.gamma, compressor=compressor),
                      "y": ChocoGossip(gamma=cfg.gamma, compressor=compressor)}
        self.bytes_sent = 0

    def pieces(self, which: str) -> list[torch.Tensor]:
        """The flat vector as parameter-shaped views (what the runtime would send)."""
        flat = self.x if which == "x" else self.tracker.y
        return [t.view(s) for t, s in zip(flat.split([math.prod(s) for s in self.shapes]), self.shapes)]

    def set_flat(self, which: str, flat: torch.Tensor) -> None:
        if which == "x":
            self.x = flat
        else:
            self.tracker.y = flat

    def local_round(self, epochs: int, tracking: bool) -> None:
        """E inner steps from self.x, drift-corrected when tracking (see tracking.py)."""
        m = self.model
        _load_flat(m, self.x)
        m.train()
        for e in range(epochs):
            self.opt.zero_grad(set_to_none=True)
            self.task.loss(m, self.batch).backward()
            if tracking:
                self.tracker.correct(m, first_step_of_round=e == 0)
            self.opt.step()
        self.x = _flat(m).clone()


def simulate_dfgl(task: Task, cfg: DfglConfig, *, seed: int = 0) -> DfglResult:
    """Local epochs then CHOCO gossip, round after round; every region starts from one model."""
    gen = _seeded(seed)
    t0 = time.perf_counter()
    n = cfg.n_regions
    codec = make_codec(cfg.codec)
    regions = [_Region(task, cfg, r, seed, gen, codec) for r in range(n)]
    topo = make_topology(cfg.topology, n, seed=seed)
    history = []
    step = 0
    for rnd in range(cfg.rounds):
        for r in regions:
            r.local_round(cfg.local_epochs, cfg.tracking)
        for _ in range(cfg.gossip_steps):
            _gossip(regions, topo, step, "x")
            if cfg.tracking:
                _gossip(regions, topo, step, "y")
            step += 1
        if cfg.eval_every and (rnd + 1) % cfg.eval_every == 0:
            history.append({"round": rnd + 1, **_evaluate(task, regions)})
    ev = _evaluate(task, regions)
    halo = _halo_bytes(task, n)
    gossip = sum(r.bytes_sent for r in regions) / n
    return DfglResult(
        region_acc=ev["region_acc"], mean_acc=ev["mean_acc"], avg_model_acc=ev["avg_model_acc"],
        consensus_distance=ev["consensus_distance"], bytes_per_region=gossip + halo,
        gossip_bytes_per_region=gossip, halo_bytes_per_region=halo,
        epochs=cfg.rounds * cfg.local_epochs, wall_s=time.perf_counter() - t0, history=history)


def _gossip(regions: list[_Region], topo, step: int, which: str) -> None:
    """One CHOCO exchange of vector `which` ("x": parameters, "y": gradient trackers).

    Every payload is real wire bytes from geofed.compression, decoded by the receivers' code
    path, so the byte counts and the rounding are those of the runtime.
    """
    payloads = [r.choco[which].outgoing(r.pieces(which)) for r in regions]
    for i, (r, payload) in enumerate(zip(regions, payloads)):
        outs = topo.out_neighbours(i, step)
        r.bytes_sent += len(payload) * len(outs)
        if outs:
            q = decode_update(payload, max_bytes=r.max_bytes)
            for j in outs:
                regions[j].choco[which].incoming(i, q)
    for i, r in enumerate(regions):
        mixed = r.choco[which].step(r.pieces(which), topo.in_weights(i, step))
        r.set_flat(which, torch.cat([t.reshape(-1) for t in mixed]))


def _evaluate(task: Task, regions: list[_Region]) -> dict[str, Any]:
    region_acc = []
    for r in regions:
        _load_flat(r.model, r.x)
        region_acc.append(task.evaluate(r.model).value)
    xs = [r.x for r in regions]
    probe = regions[0].model
    _load_flat(probe, torch.stack(xs).mean(0))
    avg_acc = task.evaluate(probe).value
    return {"region_acc": region_acc, "mean_acc": sum(region_acc) / len(region_acc),
            "avg_model_acc": avg_acc, "consensus_distance": consensus_distance(xs)}


def _halo_bytes(task: Task, n: int) -> float:
    stats = getattr(task, "partition_stats", None)
    if stats is None:
        return 0.0
    return stats(n)["halo_bytes"] / n

