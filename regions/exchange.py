"""One exchange of a round: encode per out-link, push to peers concurrently, receive by the deadline.

The algorithms (diloco, allreduce, gossip) only say what to send and how to mix what came
back; this module owns the transport calls, codec states and per-link measurements.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from geofed.compression import CodecSpec, CodecState, decode_update, encode_update, make_codec, spec_key
from geofed.p2p.deadline import AdaptiveDeadline
from geofed.p2p.estimator import LinkEstimator
from geofed.p2p.prober import LinkProber
from geofed.p2p.transport import Transport, TransportError

from .link_probe import Reprober, SetupProbes

log = logging.getLogger(__name__)
PING_EVERY = 1  # rounds between RTT probes (a ping is ~100 bytes)


@dataclass
class ExchangeResult:
    """One exchange as the algorithm sees it: the decoded updates received, what each out-peer
    decodes of this region's own payload, who was missing, and the traffic of the exchange.
    """

    received: dict[str, list[torch.Tensor]]  # sender -> decoded tensors
    own_decoded: Mapping[str, list[torch.Tensor]]  # peer -> what that peer decodes of my payload (OwnDecoded)
    missing: list[str]
    transfers: list[dict] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    send_failures: dict[str, str] = field(default_factory=dict)
    wait_s: float = 0.0
    stale: list[tuple[str, int, list[torch.Tensor]]] = field(default_factory=list)  # (sender, its round, tensors): quorum rounds' late updates

    def finished_pushes(self, out_neighbours: Sequence[str]) -> list[str]:
        """Of the peers this region was to push to this round, those that will get nothing more of it:
        pushes delivered (acknowledged only once the peer filed them) and pushes never made. A push
        that failed or is still in flight is not finished: its peer may be about to receive it, so
        the driver's "senders done" notice (the mailbox's senders_done) must not cut it."""
        return sorted(p for p in out_neighbours if p not in self.send_failures)


class OwnDecoded(Mapping[str, list[torch.Tensor]]):
    """Peer -> what that peer decodes of this region's payload, decoded from the payload on first
    use (by decode_update, the receivers' own path: the same values). Only CHOCO gossip reads it;
    decoding every exchange cost DiLoCo a model-sized fp32 buffer a round for nothing (issue 39)."""

    def __init__(self, payloads: Mapping[str, bytes], *, numel: int):
        self._payloads = dict(payloads)
        self._max_bytes = max(1, 4 * numel, *(len(p) for p in self._payloads.values()))
        self._decoded: dict[int, list[torch.Tensor]] = {}  # by payload: peers on one codec share it

    def __getitem__(self, peer: str) -> list[torch.Tensor]:
        payload = self._payloads[peer]
        if id(payload) not in self._decoded:
            self._decoded[id(payload)] = decode_update(payload, max_bytes=self._max_bytes)
        return self._decoded[id(payload)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._payloads)

    def __len__(self) -> int:
        return len(self._payloads)


class Exchanger:
    """Codec state per (out-link codec), link estimators per out-link, the adaptive deadline.

    A push that has not finished a grace period after this region's own receive deadline is left
    running and not waited for: a stalled link (an outage that blackholes bytes) must cost the
    sender a deadline, not the push's whole timeout. Until that push ends (delivered late, refused
    or timed out) the peer is skipped, so a stalled link holds at most one push and one thread.
    """

    def __init__(self, transport: Transport, *, error_feedback: bool, deadline: AdaptiveDeadline,
                 send_timeout_s: float, max_peers: int = 8):
        self.transport = transport
        self.error_feedback = error_feedback
        self.deadline = deadline
        self.send_timeout_s = send_timeout_s
        self.states: dict[str, CodecState] = {}
        # Pings, probes and the out-links' estimators (probes update them from pool threads).
        self.links = LinkProber(transport, ping_timeout_s=min(10.0, send_timeout_s))
        # Sees every update this region sends (its norm is the reference no peer controls:
        # geofed.p2p.robust.UpdateAdmission.observe_own).
        self.observe_own: Callable[[Sequence[torch.Tensor]], None] | None = None
        # The hooks' before_send (regions/hooks.py BeforeSend): what is sent and to whom, after
        # observe_own has seen the region's own update (None: sent as it is).
        self.before_send: Any = None
        self._stalled: dict[str, tuple[int, Future]] = {}  # peer -> (round, push still running)
        # Pushes left running that then succeeded, (peer, round, stats): reported with the next
        # exchange, so a link that only got slow still teaches its estimator and the policy.
        self._late: list[tuple[str, int, Any]] = []
        self.quiet_late_upto = -1  # a peer refusing these rounds as `late` is expected (after a restore)
        self._late_seen: set[tuple[int, str]] = set()  # late arrivals (round, sender) the deadline has learnt from
        self.reprober: Reprober | None = None  # re-probes stale links during the rounds (set by probe_links)
        # One push per peer plus one stalled push per peer never queue behind each other. The
        # set-up probes and re-probes (regions/link_probe.py) run on it too.
        self.pool = ThreadPoolExecutor(max_workers=max(8, 2 * max_peers), thread_name_prefix="geofed-send")

    def close(self) -> None:
        """Stop the send pool without waiting: queued pushes are cancelled, running ones end on their timeout."""
        self.pool.shutdown(wait=False, cancel_futures=True)

    @property
    def estimators(self) -> dict[str, LinkEstimator]:
        """The out-links' estimators by peer (the link prober's; whoever updates one holds links.lock)."""
        return self.links.estimators

    def estimator(self, peer: str) -> LinkEstimator:
        """The link estimator of the out-link to `peer` (made on first use); callers that update it hold links.lock."""
        return self.links.estimator(peer)

    def exchange(self, round_: int, tensors: Sequence[torch.Tensor], *, out_peers: Sequence[str],
                 in_peers: Sequence[str], codecs: Mapping[str, CodecSpec], default_codec: CodecSpec,
                 quorum: int | None = None, grace_s: float = 0.0, stream: str = "",
                 spread_s: float = 0.0, window_s: float = 0.0, optional: Sequence[str] = ()) -> ExchangeResult:
        """Push `tensors` to `out_peers` (each with its link's codec) and collect from `in_peers`
        (all of them by the deadline, or with `quorum` that many and a grace for the rest). `stream`
        names a codec stream of its own (sync.fragments: one per fragment, each with its own layout
        and error-feedback residual). `spread_s`: pace each push over that many seconds (an overlapped
        exchange with sync.spread_sends; at most half the send timeout). `window_s`: the compute an
        overlapped exchange hides behind; the receive deadline is at least that long, since a peer
        arriving within it costs nothing to wait for (regions/sync/common.py, OverlapWindow).
        `optional` in-peers (a member on probation) are taken only if they come with the others."""
        self.transport.mailbox.expect(round_, list(in_peers))
        if self.observe_own is not None and out_peers:
            self.observe_own(tensors)
        if self.before_send is not None:
            tensors, out_peers = self.before_send.outgoing(round_, tensors, out_peers)
        payloads, own_decoded = self._encode(tensors, out_peers, codecs, default_codec, stream)
        skipped = self._still_stalled()
        spread_s = min(max(0.0, spread_s), self.send_timeout_s / 2)
        if quorum is None:
            self._learn_late(spread_s)
        futures = {p: self.pool.submit(self._send, p, round_, payloads[p], spread_s)
                   for p in out_peers if p not in skipped}
        t0 = time.monotonic()
        # Peers spread their pushes about as long as this region does: the deadline and its samples
        # count from where the spread ends, so a pace neither eats the slack for a slow peer nor
        # teaches the deadline a wait that is only the pace's.
        deadline_s = max(self.deadline.current(), min(window_s, self.deadline.max_s)) + spread_s
        optional = [p for p in optional if p in in_peers]
        extra = {"optional": optional} if optional else {}
        if quorum is None:
            inbox = self.transport.receive(round_, deadline_s, **extra)
        else:
            inbox = self.transport.receive(round_, deadline_s, quorum=quorum, grace_s=grace_s, **extra)
        wait_s = time.monotonic() - t0
        result = ExchangeResult(received=dict(inbox.received), own_decoded=own_decoded,
                                missing=sorted(inbox.missing), wait_s=wait_s)
        if quorum is not None:
            result.stale = self.transport.mailbox.take_stale()
        for peer in out_peers:
            if peer in skipped:
                result.send_failures[peer] = f"skipped: its push of round {skipped[peer]} is still in flight"
        self._report_late(result)
        # A refused update is the sender's doing, not the network's: it does not widen the deadline.
        # Neither does an optional peer's absence nor a sender done with the round (it said its push
        # here was made or never would be): the last of the others is what the round waited for.
        excused = inbox.refused | inbox.cut | frozenset(optional)
        if inbox.missing & (inbox.cut | frozenset(optional)) and not inbox.missing - excused and quorum is None:
            if inbox.received:
                self.deadline.observe(max(0.0, max(inbox.waits.get(p, 0.0) for p in inbox.received) - spread_s))
        elif not (inbox.missing - inbox.refused) or quorum is not None:
            # Only complete rounds teach the deadline samples: a dead peer must not skew them
            # (a quorum round closes on purpose without the slowest, and is complete too)...
            self.deadline.observe(max(0.0, wait_s - spread_s))
        else:
            # ...but a peer whose link slowed would otherwise be cut off forever: widen the deadline,
            # unless the others all came well inside it (a silent peer; its late arrival, if any,
            # widens it through _learn_late next round).
            others = [max(0.0, inbox.waits.get(p, 0.0) - spread_s) for p in inbox.received]
            self.deadline.observe_incomplete(others, deadline_s=deadline_s - spread_s)
        self._collect_sends(futures, round_, result, grace_s=max(1.0, deadline_s))
        pings = []
        if round_ % PING_EVERY == 0:
            for peer in futures:
                if peer not in result.send_failures:
                    pings.append(self.pool.submit(self.links.measure_rtt, peer))  # off the critical path
        if self.reprober is not None:
            self.reprober.count_updates(result.bytes_sent)  # what earns the re-probes' egress budget
            self.reprober.after_round([p for p in futures if p not in result.send_failures], pings)
            result.transfers.extend(self.reprober.take_records())
        for sender, (nbytes, seconds) in inbox.timings.items():  # payload bytes, receiver-timed
            result.bytes_received += nbytes
            result.transfers.append({"peer": sender, "direction": "recv", "bytes": nbytes, "seconds": round(seconds, 6)})
        return result

    def _learn_late(self, spread_s: float) -> None:
        """Updates the mailbox refused as `late` since the last exchange widen the deadline to
        cover them: the evidence of a slow link that a silent round does not give."""
        try:
            lates = self.transport.stats().get("late_waits_s", [])
        except Exception as exc:  # noqa: BLE001 -- a transport without counters teaches nothing
            log.debug("no late waits: %s", exc)
            return
        keys = set()
        for item in lates:
            key = (item["round"], item["sender"])
            keys.add(key)
            if key in self._late_seen or item["round"] <= self.quiet_late_upto:
                continue  # after a restore, late pushes of the rounds around it are expected
            self.deadline.observe_late(max(0.0, item["seconds"] - spread_s))
        self._late_seen = keys  # the mailbox keeps its last 32: what fell out of it cannot come back

    def _send(self, peer: str, round_: int, payload: bytes, spread_s: float = 0.0):
        if self.links.is_cold(peer):  # a ping of the last round may still be adding to this estimator
            self.links.measure_rtt(peer, warm_up=True)
        return self.transport.send(peer, round_, payload, timeout_s=self.send_timeout_s, spread_s=spread_s)

    def hurry(self) -> None:
        """Spread pushes in flight (sync.spread_sends) send what is left now: the compute they hid behind is over."""
        self.transport.spreading.hurry()

    def _encode(self, tensors, out_peers, codecs, default_codec, stream=""):
        """One encode per distinct codec: peers on the same codec share its bytes and its EF state.
        What each peer decodes of them is decoded only if asked for (OwnDecoded)."""
        by_key: dict[str, bytes] = {}
        payloads = {}
        for peer in out_peers:
            spec = codecs.get(peer, default_codec)
            key = spec.key
            if key not in by_key:
                state_key = f"{key}@{stream}" if stream else key
                state = self.states.setdefault(state_key, CodecState(error_feedback=self.error_feedback))
                by_key[key] = encode_update(make_codec(spec), tensors, state)
            payloads[peer] = by_key[key]
        return payloads, OwnDecoded(payloads, numel=sum(t.numel() for t in tensors))

    def _still_stalled(self) -> dict[str, int]:
        """Peers whose push from an earlier round is still running -> that round."""
        for peer in [p for p, (_, fut) in self._stalled.items() if fut.done()]:
            del self._stalled[peer]
        return {p: r for p, (r, _) in self._stalled.items()}

    def _collect_sends(self, futures: dict[str, Future], round_: int, result: ExchangeResult, *,
                       grace_s: float) -> None:
        wait(list(futures.values()), timeout=grace_s)
        n_sends = len(futures)
        for peer, fut in futures.items():
            if not fut.done():
                # Still running (a stalled link): leave it, skip the peer until it ends.
                self._stalled[peer] = (round_, fut)
                fut.add_done_callback(lambda f, p=peer, r=round_: self._stalled_ended(p, r, f, n_sends))
                result.send_failures[peer] = f"still in flight {grace_s:.1f}s after the receive deadline; left running"
                log.warning("push of round %d to %s still in flight after the deadline; not waiting for it", round_, peer)
                continue
            try:
                stats = fut.result()
            except TransportError as exc:
                result.send_failures[peer] = str(exc)
                expected = exc.reason == "late" and round_ <= self.quiet_late_upto
                log.log(logging.INFO if expected else logging.WARNING, "send to %s failed: %s", peer, exc)
                continue
            self._count_send(result, peer, stats, concurrent=n_sends)

    def _count_send(self, result: ExchangeResult, peer: str, stats, *, concurrent: int, **extra) -> None:
        result.bytes_sent += stats.bytes
        self.links.observe(peer, stats, concurrent)
        if stats.cold:
            extra["cold"] = True
        if stats.spread_s > 0:
            extra["spread_s"] = round(stats.spread_s, 4)
        # t_end (wall clock, as the driver's round times): the link's rate over time (peak-to-mean, summary.json).
        result.transfers.append({"peer": peer, "direction": "send", "bytes": stats.bytes,
                                 "seconds": round(stats.seconds, 6), "concurrent": concurrent,
                                 "t_end": round(time.time(), 4), **extra})

    def probe_links(self, peers: Sequence[str], *, duration_s: float, max_bytes: int) -> list[dict]:
        """Warm every connection to `peers` and measure it before the first round
        (regions/link_probe.py); returns the probes as transfer records. The rounds then re-probe
        links whose estimates go stale or doubted, with probes up to `max_bytes`."""
        self.reprober = Reprober(self.links, self.pool, send_timeout_s=self.send_timeout_s, max_bytes=max_bytes)
        return SetupProbes(self.links, self.pool, send_timeout_s=self.send_timeout_s).run(
            peers, duration_s=duration_s, max_bytes=max_bytes)

    def _stalled_ended(self, peer: str, round_: int, fut: Future, concurrent: int) -> None:
        # Runs on the pool's thread: only a list append (atomic) crosses to the exchanging thread.
        exc = fut.exception()
        if exc is None:
            self._late.append((peer, round_, fut.result(), concurrent))
            log.info("push of round %d to %s completed after its round", round_, peer)
        else:
            log.info("push of round %d to %s, left running, ended: %s", round_, peer, exc)

    def _report_late(self, result: ExchangeResult) -> None:
        while self._late:
            peer, round_, stats, concurrent = self._late.pop(0)
            self._count_send(result, peer, stats, concurrent=concurrent, late_round=round_)

    def link_estimates(self, region: str) -> dict[str, dict]:
        """Every out-link's estimate keyed 'region->peer', as the round's metrics report them."""
        return self.links.link_estimates(region)

    def state_dict(self) -> dict:
        """The deadline's samples and every codec stream's state (error-feedback residual,
        warm starts, seed and counter), so a restored region encodes exactly as it would have."""
        return {"deadline": self.deadline.state_dict(), "links": self.links.state_dict(),
                "codecs": {key: st.state_dict() for key, st in self.states.items()}}

    def load_state_dict(self, d: dict) -> None:
        """Restore `state_dict()`: the deadline's samples, every codec stream's state and the link estimates."""
        if "deadline" in d:
            self.deadline.load_state_dict(d["deadline"])
        for key, sd in d.get("codecs", {}).items():
            # By key; an older checkpoint's key (the spec as written) maps to today's.
            spec, at, stream = key.partition("@")  # a stream of its own (a fragment's) keeps its name
            state = CodecState(error_feedback=self.error_feedback)
            state.load_state_dict(sd)
            self.states[spec_key(spec) + at + stream] = state
        self.links.load_state_dict(d.get("links", {}))

