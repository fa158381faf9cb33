"""What a region sends each round and how it mixes what comes back, one module per algorithm:
diloco (with fragments.py and overlap.py wrapping its parts; outer.py its outer optimizer),
allreduce (per-step baseline), gossip (D-PSGD / CHOCO-SGD). algorithm.py is the seam they share."""

from .algorithm import Algorithm
from .allreduce import AllReduceSync
from .common import mix
from .diloco import Diloco, DilocoSync
from .fragments import split_fragments
from .gossip import GossipSync
from .outer import outer_optimizer

ALGORITHMS = {"diloco": DilocoSync, "allreduce": AllReduceSync, "gossip": GossipSync}


def algorithm_class(settings):
    """The class of the run's `sync:` section (DiLoCo's fragments and overlap are its own settings)."""
    return ALGORITHMS[settings.algorithm]


__all__ = ["ALGORITHMS", "Algorithm", "AllReduceSync", "Diloco", "DilocoSync", "GossipSync", "algorithm_class",
           "mix", "outer_optimizer", "split_fragments"]
