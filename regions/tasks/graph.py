"""Task ``gcn-planetoid``: node classification with a GNN on a region's subgraph.

Each region holds one part of the graph (see geofed.regions.graph.partition) and trains a
2-layer GCN or GraphSAGE full-batch on it: one training batch is the region's whole subgraph,
so one inner step is one local epoch. Evaluation runs the model on the *whole* graph and
scores the standard test split, so a region model is judged with the test nodes' true
neighbourhoods, the same way the centralized reference is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from geofed.regions.graph.data import GraphView, build_view, full_view, load_task_graph
from geofed.regions.graph.models import accuracy, build_gnn, gnn_loss
from geofed.regions.graph.partition import extract_subgraph, partition_nodes, partition_stats, train_flags

from .base import EvalResult, Shard, Task, register_task
from .configs import GcnPlanetoidConfig

class GraphShard(Shard):
    """A region's subgraph; every batch is the whole subgraph (full-batch training)."""

    def __init__(self, view: GraphView):
        self.view = view

    @property
    def num_examples(self) -> int:
        return int(self.view.train_mask.sum())

    def batches(self, generator: torch.Generator) -> Iterator[GraphView]:
        while True:
            yield self.view


class GcnPlanetoidTask(Task):
    """Full-batch GCN or GraphSAGE: each region trains on its subgraph (a step is an epoch of it);
    evaluation is test accuracy on the whole graph.
    """

    kind = "gcn-planetoid"

    def __init__(self, config: GcnPlanetoidConfig, *, batch_size: int = 32, seed: int = 0):
        # batch_size does not apply (full-batch: one step is one epoch on the whole subgraph);
        # seed does not move the partition (partition_seed does), see shard().
        self.config = config
        self.data = load_task_graph(config.path, max_mb=config.max_mb)
        self._assign: dict[int, Any] = {}
        self._full: GraphView | None = None
        self._last_regions: int | None = None

    @property
    def adjacency(self) -> str:
        return "gcn" if self.config.model == "gcn" else "mean"

    def build_model(self, seed: int) -> nn.Module:
        c = self.config
        return build_gnn(c.model, self.data.num_features, c.hidden, self.data.num_classes, dropout=c.dropout, seed=seed)

    def assignment(self, n_regions: int):
        """Region of every node (cached; the same in every process for a given partition_seed)."""
        if n_regions not in self._assign:
            c = self.config
            self._assign[n_regions] = partition_nodes(self.data, n_regions, c.partition, alpha=c.alpha,
                                                      seed=c.partition_seed)
        return self._assign[n_regions]

    def shard(self, region_index: int, n_regions: int, seed: int) -> GraphShard:
        # `seed` is not used: the split follows partition_seed so that runs with different
        # seeds (and every region of one run) see the same partition.
        if not 0 <= region_index < n_regions:
            raise ValueError(f"region_index: must be in [0, {n_regions}), got {region_index}")
        self._last_regions = n_regions
        if n_regions == 1:
            return GraphShard(self.full_view())
        sub = extract_subgraph(self.data, self.assignment(n_regions), region_index, halo=self.config.halo)
        view = build_view(self.data, sub.nodes, sub.edge_index, adjacency=self.adjacency,
                          train_nodes=train_flags(self.data, sub))
        if self.config.loss_weighting == "nodes":
            # Region loss = (its train nodes / average per region) x its mean: the average of
            # the region objectives is then exactly the centralized mean over all train nodes.
            scale = float(view.train_mask.sum()) * n_regions / float(self.data.train_mask.sum())
            view = dataclasses.replace(view, loss_scale=scale)
        return GraphShard(view)

    def full_view(self) -> GraphView:
        if self._full is None:
            self._full = full_view(self.data, adjacency=self.adjacency)
        return self._full

    def loss(self, model: nn.Module, batch: GraphView) -> torch.Tensor:
        return gnn_loss(model, batch.x, batch.adj, batch.y, batch.train_mask, weight_decay=self.config.weight_decay,
                        scale=batch.loss_scale)

    def evaluate(self, model: nn.Module) -> EvalResult:
        v = self.full_view()
        return EvalResult(metric="accuracy", value=accuracy(model, v.x, v.adj, v.y, v.test_mask), higher_is_better=True)

    def partition_stats(self, n_regions: int, seed: int = 0) -> dict[str, Any]:
        return partition_stats(self.data, self.assignment(n_regions), n_regions, halo=self.config.halo)

    def describe(self) -> dict[str, Any]:
        d = self.data
        out: dict[str, Any] = {
            "dataset": d.source, "nodes": d.num_nodes, "edges": d.num_edges, "features": d.num_features,
            "classes": d.num_classes, "train": int(d.train_mask.sum()), "test": int(d.test_mask.sum()),
            "model": self.config.model, "partition": self.config.partition, "halo": self.config.halo,
        }
        if self._last_regions and self._last_regions > 1:
            out["regions"] = self.partition_stats(self._last_regions)
        return out


register_task("gcn-planetoid", GcnPlanetoidConfig, lambda cfg, **kw: GcnPlanetoidTask(cfg, **kw))
