"""What a region sends each round and how it mixes what comes back, one module per algorithm:
diloco, allreduce (per-step baseline), gossip (D-PSGD / CHOCO-SGD)."""

from .allreduce import AllReduceSync
from .common import mix
from .diloco import DilocoSync
from .gossip import GossipSync

ALGORITHMS = {"diloco": DilocoSync, "allreduce": AllReduceSync, "gossip": GossipSync}

__all__ = ["ALGORITHMS", "AllReduceSync", "DilocoSync", "GossipSync", "mix"]
