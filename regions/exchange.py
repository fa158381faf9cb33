"""One exchange of a round: encode per out-link, push to peers concurrently, receive by the deadline.

The algorithms (diloco, allreduce, gossip) only say what to send and how to mix what came
back; this module owns the transport calls, codec states and per-link measurements.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from geofed.compression import CodecState, encode_and_decode, make_codec
from geofed.p2p.deadline import AdaptiveDeadline
from geofed.p2p.estimator import LinkEstimator
from geofed.p2p.transport import Transport, TransportError

log = logging.getLogger(__name__)
PING_EVERY = 10  # rounds


def spec_key(spec: Any) -> str:
    """A stable, readable name of a codec spec ("int8", "topk(fraction=0.01,inner=int8)")."""
    if isinstance(spec, str):
        return spec
    if isinstance(spec, Mapping):
        params = ",".join(f"{k}={spec_key(v)}" for k, v in sorted(spec.items()) if k != "kind")
        return f"{spec.get('kind', '?')}({params})" if params else str(spec.get("kind", "?"))
    return repr(spec)


@dataclass
class ExchangeResult:
    received: dict[str, list[torch.Tensor]]  # sender -> decoded tensors
    own_decoded: dict[str, list[torch.Tensor]]  # peer -> what that peer decodes of my payload
    missing: list[str]
    transfers: list[dict] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    send_failures: dict[str, str] = field(default_factory=dict)
    wait_s: float = 0.0


class Exchanger:
    """Codec state per (out-link codec), link estimators per out-link, the adaptive deadline."""

    def __init__(self, transport: Transport, *, error_feedback: bool, deadline: AdaptiveDeadline,
                 send_timeout_s: float):
        self.transport = transport
        self.error_feedback = error_feedback
        self.deadline = deadline
        self.send_timeout_s = send_timeout_s
        self.states: dict[str, CodecState] = {}
        self.estimators: dict[str, LinkEstimator] = {}
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="geofed-send")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def estimator(self, peer: str) -> LinkEstimator:
        return self.estimators.setdefault(peer, LinkEstimator())

    def exchange(self, round_: int, tensors: Sequence[torch.Tensor], *, out_peers: Sequence[str],
                 in_peers: Sequence[str], codecs: Mapping[str, Any], default_codec: Any) -> ExchangeResult:
        """Push `tensors` to `out_peers` (each with its link's codec) and collect from `in_peers`."""
        self.transport.expect(round_, list(in_peers))
        payloads, own_decoded = self._encode(tensors, out_peers, codecs, default_codec)
        futures = {p: self._pool.submit(self._send, p, round_, payloads[p]) for p in out_peers}
        t0 = time.monotonic()
        inbox = self.transport.receive(round_, self.deadline.current())
        wait_s = time.monotonic() - t0
        result = ExchangeResult(received=dict(inbox.received), own_decoded=own_decoded,
                                missing=sorted(inbox.missing), wait_s=wait_s)
        if not inbox.missing:
            # Only complete rounds teach the deadline samples: a dead peer must not skew them...
            self.deadline.observe(wait_s)
        else:
            # ...but a peer whose link slowed would otherwise be cut off forever: widen the deadline.
            self.deadline.observe_miss()
        self._collect_sends(futures, payloads, result)
        for sender, (nbytes, seconds) in inbox.timings.items():  # payload bytes, receiver-timed
            result.bytes_received += nbytes
            result.transfers.append({"peer": sender, "direction": "recv", "bytes": nbytes, "seconds": round(seconds, 6)})
        return result

    def _send(self, peer: str, round_: int, payload: bytes):
        est = self.estimator(peer)
        if est.rtt_s is None or round_ % PING_EVERY == 0:
            # Large transfers measure bandwidth, not latency: a ping now and then keeps the RTT honest.
            try:
                est.observe_rtt(self.transport.ping(peer, timeout_s=min(10.0, self.send_timeout_s)))
            except TransportError as exc:
                log.info("ping %s failed: %s", peer, exc)
        return self.transport.send(peer, round_, payload, timeout_s=self.send_timeout_s)

    def _encode(self, tensors, out_peers, codecs, default_codec):
        """One encode per distinct codec: peers on the same codec share its bytes and its EF state."""
        by_key: dict[str, tuple[bytes, list[torch.Tensor]]] = {}
        payloads, own = {}, {}
        for peer in out_peers:
            spec = codecs.get(peer, default_codec)
            key = spec_key(spec)
            if key not in by_key:
                state = self.states.setdefault(key, CodecState(error_feedback=self.error_feedback))
                by_key[key] = encode_and_decode(make_codec(spec), tensors, state)
            payloads[peer], own[peer] = by_key[key]
        return payloads, own

    def _collect_sends(self, futures, payloads, result: ExchangeResult) -> None:
        for peer, fut in futures.items():
            try:
                stats = fut.result(timeout=self.send_timeout_s + 5.0)
            except (TransportError, TimeoutError) as exc:
                result.send_failures[peer] = str(exc)
                log.warning("send to %s failed: %s", peer, exc)
                continue
            result.bytes_sent += stats.bytes
            self.estimator(peer).observe_transfer(stats.bytes, stats.seconds)
            result.transfers.append({"peer": peer, "direction": "send", "bytes": stats.bytes,
                                     "seconds": round(stats.seconds, 6)})

    def link_estimates(self, region: str) -> dict[str, dict]:
        return {f"{region}->{peer}": est.snapshot() for peer, est in self.estimators.items()}

    def state_dict(self) -> dict:
        # Codec states (EF residuals) are not checkpointed: after a restore they start from zero,
        # which costs at most one round's dropped mass, never correctness.
        return {"deadline": self.deadline.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        if "deadline" in d:
            self.deadline.load_state_dict(d["deadline"])
