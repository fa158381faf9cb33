"""What a region sends each round and how it mixes what comes back, one module per algorithm:
diloco, allreduce (per-step baseline), gossip (D-PSGD / CHOCO-SGD)."""

from .allreduce import AllReduceSync
from .common import mix
from .diloco import DilocoSync
from .fragments import FragmentedDilocoSync, split_fragments
from .gossip import GossipSync

ALGORITHMS = {"diloco": DilocoSync, "allreduce": AllReduceSync, "gossip": GossipSync}


def algorithm_class(settings):
    """The class of the run's `sync:` section: its algorithm, or diloco in fragments (sync.fragments > 1)."""
    if settings.algorithm == "diloco" and getattr(settings, "fragments", 1) > 1:
        return FragmentedDilocoSync
    return ALGORITHMS[settings.algorithm]


__all__ = ["ALGORITHMS", "AllReduceSync", "DilocoSync", "FragmentedDilocoSync", "GossipSync", "algorithm_class",
           "mix", "split_fragments"]
