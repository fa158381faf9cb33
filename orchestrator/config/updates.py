"""``compression`` and ``security``: how an update is encoded, and what a region admits of its peers'."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from geofed.compression import CodecSpec

from .common import _doc


@dataclass(frozen=True, kw_only=True)
class CompressionSection:
    """``compression``: the default codec, error feedback, and the ladder of codecs a policy may
    choose per link (all CodecSpecs: the loader parses every spelling).
    """

    codec: CodecSpec = field(default=CodecSpec(kind="fp16"), metadata=_doc(
        "a codec name (int8), a mapping ({kind: topk, fraction: 0.01, inner: int8}) or its key "
        "(topk(fraction=0.01,inner=int8)); see docs/compression.md"))
    error_feedback: bool = field(default=True, metadata=_doc("keep what a lossy codec dropped and send it later"))
    ladder: tuple[CodecSpec, ...] = field(default=(), metadata=_doc("codecs the policy may choose per link, least compression first"))

    def __post_init__(self):
        # The loader parses every spelling into a CodecSpec; code that builds a section must too.
        for key, spec in [("codec", self.codec)] + [(f"ladder.{i}", s) for i, s in enumerate(self.ladder)]:
            if not isinstance(spec, CodecSpec):
                raise TypeError(f"{key}: expected a CodecSpec (CodecSpec.parse(...)), got {type(spec).__name__}")


@dataclass(frozen=True, kw_only=True)
class SecuritySection:
    """``security``: mutual TLS, how far ahead updates may come, what admission does with outsized
    updates, and the rollback of rounds that turn a model non-finite.
    """

    tls: bool = field(default=True, metadata=_doc("mutual TLS on every channel (false: plaintext, warns)"))
    round_window: int = field(default=2, metadata=_doc("accept updates at most this many rounds ahead"))
    robust_aggregation: Literal["none", "clip", "trimmed-mean", "median"] = field(default="clip", metadata=_doc(
        "what a peer update meets: clip: scaled down at the mix to clip_multiple x the median norm of the round's "
        "updates (gossip, and clip_multiple 0: to norm_multiple x the recent median norm on arrival); "
        "trimmed-mean / median: refused (outlier) above norm_multiple and the mix is coordinate-wise robust "
        "(full-topology diloco or allreduce); none: only the value bound (docs/reliability.md)"))
    max_update_value: float = field(default=1e6, metadata=_doc(
        "an update holding a value of larger magnitude is refused (out_of_bounds), in every mode"))
    norm_multiple: float = field(default=10.0, metadata=_doc(
        "an update whose L2 norm exceeds this multiple of the median of recent update norms (all senders and "
        "the region's own) is clipped or refused"))
    clip_multiple: float = field(default=1.0, metadata=_doc(
        "clip (diloco, allreduce): every peer update in a round's mix is scaled down to this multiple of the median "
        "L2 norm of that round's updates (the region's own included), so one member moves the mean by at most its "
        "1/n share at that norm; 0: off (only norm_multiple's bound, on arrival). Counted as clipped in metrics, "
        "summary.json and the report"))
    score_updates: bool = field(default=True, metadata=_doc(
        "diloco without secure aggregation or fragments, robust_aggregation other than none: every received update is scored on score_batches batches of "
        "the region's own data before the mix, and refused (harmful) when the model it claims (the global model minus "
        "the update) has a loss higher than the global model's by more than score_margin and 8x the median increase of "
        "the round's received updates; not a network miss (docs/reliability.md)"))
    score_batches: int = field(default=4, metadata=_doc(
        "score_updates: batches of the region's own shard (drawn once, at start) each update is scored on; each costs "
        "a forward pass per received update and round"))
    score_margin: float = field(default=0.5, metadata=_doc(
        "score_updates: the least loss increase (the task's loss units, nats for the built-in tasks) that refuses an "
        "update as harmful; honest updates measured at most +0.11 (digits IID) and +3.7 in early non-IID rounds, "
        "where the round's median sets the bar. A quarantined sender's harmless update counts toward its release only "
        "where it and its reverse read more than this apart (regions/gauntlet.py)"))
    trim_fraction: float = field(default=0.25, metadata=_doc(
        "trimmed-mean: values dropped at each end of every coordinate, as a fraction of the regions present "
        "(at least 1 when 3 or more)"))
    rollback_on_nonfinite: bool = field(default=True, metadata=_doc(
        "a region whose loss or model turns non-finite goes back to its state at the start of the round and "
        "drops the round's inputs (an event), instead of failing the run; 3 in a row still fail it"))
    rollback_copy: Literal["disk", "memory"] = field(default="disk", metadata=_doc(
        "where rollback_on_nonfinite keeps its copy of the round's start (DiLoCo with AdamW: 8 B/param through the "
        "inner steps, 16 from the outer step to the round's end): disk writes it to a file of the region's run "
        "directory (rollback/, deleted when the round stands) and reads it back only to restore, so it is not "
        "resident (page cache, not the region's memory); memory keeps it in the process and skips the writes"))
    secure_aggregation: bool = field(default=False, metadata=_doc(
        "mask every region's update with pairwise X25519/ChaCha20 masks that cancel in the sum, so a region learns "
        "only the sum of the others' updates; full-topology diloco, >= 3 regions, TLS, and a codec that sums as "
        "integers (int8, int4, randomk; topk, sign and powersgd are refused). docs/privacy.md"))
    secagg_threshold: int | None = field(default=None, metadata=_doc(
        "retired: the per-round Shamir protocol it configured is gone; secure aggregation recovers from the "
        "survivors' own seeds (docs/privacy.md). Only null is accepted; a value is refused, naming this key"))
    secagg_bits: Literal[8, 16, 32] = field(default=32, metadata=_doc(
        "the mask ring Z_2^bits: a masked value costs bits on the wire (32: 4x an int8 update); 8 keeps int8's "
        "bytes but leaves each region 127 // n levels so that the sum cannot wrap"))

    def __post_init__(self):
        if not 0 <= self.round_window <= 1000:
            raise ValueError(f"round_window: must be in [0, 1000], got {self.round_window}")
        if not 0 < self.max_update_value <= 3.4e38:
            raise ValueError(f"max_update_value: must be in (0, 3.4e38], got {self.max_update_value}")
        if not 1 < self.norm_multiple <= 1e6:
            raise ValueError(f"norm_multiple: must be in (1, 1e6], got {self.norm_multiple}")
        if not (self.clip_multiple == 0 or 1 <= self.clip_multiple <= 1e6):
            raise ValueError(f"clip_multiple: must be 0 (off) or in [1, 1e6], got {self.clip_multiple}")
        if not 1 <= self.score_batches <= 64:
            raise ValueError(f"score_batches: must be in [1, 64], got {self.score_batches}")
        if not 0 < self.score_margin <= 1e6:
            raise ValueError(f"score_margin: must be in (0, 1e6], got {self.score_margin}")
        if not 0 <= self.trim_fraction < 0.5:
            raise ValueError(f"trim_fraction: must be in [0, 0.5), got {self.trim_fraction}")
