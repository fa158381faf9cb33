"""Secure aggregation in DiLoCo's round (``security.secure_aggregation``; docs/privacy.md): the
round hook `SecureAggregation` (its `aggregate` point) runs `SecAggRound.exchange`.

Keys cross each link once per run (keys.py). One round of region i, after its inner steps; every
message goes over the run's transport on its ``secagg`` side stream (`SideChannel`: one side round
per (round, phase)), and every wait has the round's deadline. The common round (every region
took part in the last one) is one masked exchange plus a ~100-byte relay behind it, as int8's
round is one exchange; the other phases run only when needed:

1. Scales. Every region quantises with the same per-chunk scales (4096 values a chunk per
   tensor): the largest absmax over the round's regions, over the levels that keep a sum of n
   from wrapping the ring. Agreed a round ahead: each masked update carries its sender's absmax
   (as int8 sends its scales in the clear), so after a complete round every region holds every
   absmax and the next round quantises with them, clipping what grew into the error-feedback
   residual. Only when a region lacks them (the first round, after a round that lost a region,
   a restarted region) does it run SETUP first: its absmax, its signed key advert until that
   peer has filed it, and the peers whose keys it lacks (they send theirs again next round).
2. MASKED to every peer: the masked update, the digest of its grid (a peer on another grid
   refuses it: its sum would be garbage), its absmax for the next round's scales, and that peer's
   XOR share of i's round self key (relay.py) with a check of the key.
3. RELAY: once i's masked updates are in, i sends every other member its shares of the
   survivors' keys (and whether it counted that member's update); a key whose every share came
   is rebuilt, so only when every peer counted the owner's update. A region that holds every
   member's masked update and self key unmasks: done, no more phases.
   KEY (the fallback): the round's self key, sent to a peer only once that peer acknowledged i's
   masked update and i got the peer's (never to a region that may be counted dropped); sent when
   a masked update was lost, or when some peer did not count i's (nobody rebuilds i's key then).
4. Only when a masked update or a self key is missing: REVEAL to every survivor, the survivors
   i saw and the digest of its grid (a region whose survivors or grid differ from a peer's does
   not unmask: its sum would not be theirs), the self key again to the peers that acknowledged.
   A region that lost masked updates asks, by its survivor list, for the pair seeds of the lost
   regions: RECOVER answers carry a survivor's own round seeds, and only for regions whose masked
   update it lost too (whoever holds a masked update never gets the seeds that unmask it).
5. The sum of the survivors' updates is unmasked, dequantised and divided by their number: the
   full topology's uniform mean, the same at every survivor.

Admission (issue 36, N3), since no region sees a member's update: a member whose chunk maxima
(its share of the shared scale) pass security.max_update_value is refused (`out_of_bounds`), or
above norm_multiple x the median of the members' maxima (`outlier`, unless robust_aggregation is
none); the others' scales leave it out, so its masked update is on another grid or left out as a
lost one (recovered as in step 4). The scales are capped at max_update_value, so no value of the
mean can pass it; the unmasked mean is checked before the outer step: a value out of bounds fails
the round (`out_of_bounds`), and under clip a norm above norm_multiple x the region's own recent
update norms is scaled down to that bound (clipped, sender `secagg-mean`). Per-member clipping
at the median norm (clip's fair share) cannot be done on masked updates: inside these bounds a
member still moves the mean by up to the largest admitted scale.

Here, in one class: the round and steps 1-3 (SETUP, MASKED, RELAY); KEY, REVEAL and RECOVER,
which run only when the common round cannot end at RELAY; and the side messages' push, wait and
counting that every phase shares.

A region that cannot unmask (no keys, a missing reveal or answer, survivors that disagree)
applies its own update alone and reports every peer as missed: the driver's resync makes one
model again. Refused side messages are counted by SecAggError.reason under `secagg_refused`;
`secagg_phase_s` has each phase's seconds and `secagg_scales_ahead` whether SETUP was skipped.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from geofed.p2p.deadline import AdaptiveDeadline
from geofed.p2p.robust import UpdateAdmission, l2_norm, max_abs
from geofed.p2p.transport import Inbox, TransferStats, Transport, TransportError

from ..hooks import RoundHook
from . import SecAggError, masks, relay, wire
from .keys import KeyBook, RunKeys, verify_run_advert
from .masks import CHUNK

if TYPE_CHECKING:
    from ..messages import RoundPlan

STREAM = "secagg"  # the transport's side stream (p2p/mailbox.py, SIDE_STREAMS)
PHASES = 6              # side messages per round: scales (+ keys), masked update, relay, self key, reveal, recovery
# In this order: receiving a phase closes the earlier ones (the mailbox closes every round <= it).
# RELAY before KEY: a round whose relays rebuilt every self key never receives KEY (the keys it
# did not need are dropped as late), one that lacks some still can.
SETUP, MASKED, RELAY, KEY, REVEAL, RECOVER = range(PHASES)


def side_round(round: int, phase: int) -> int:
    """The side mailbox's round of (round, phase)."""
    assert 0 <= phase < PHASES and round >= 0, (round, phase)
    return round * PHASES + phase


class SideChannel:
    """One region's secure-aggregation messages over its transport's ``secagg`` stream, by (round,
    phase): a phase is the side round ``round * PHASES + phase`` (monotonic, so the stream's mailbox
    closes its rounds the way the update's does, every rule of which applies to these too).
    `validator(sender, round, phase, payload)` checks and files what arrives (a ValueError or a
    Refusal refuses it, counted like any refusal)."""

    def __init__(self, transport: Transport, *, max_message_bytes: int):
        self.transport = transport
        self.mailbox = transport.mailbox.open_stream(STREAM, max_message_bytes=max_message_bytes,
                                                     rounds_per_round=PHASES)

    def set_validator(self, fn: Callable[[str, int, int, memoryview], Any]) -> None:
        self.mailbox.set_validator(lambda sender, r, payload: fn(sender, r // PHASES, r % PHASES, payload))

    def send(self, peer: str, round: int, phase: int, payload: bytes, *, timeout_s: float) -> TransferStats:
        return self.transport.send(peer, side_round(round, phase), payload, timeout_s=timeout_s, stream=STREAM)

    def expect(self, round: int, phase: int, senders: Collection[str]) -> None:
        self.mailbox.expect(side_round(round, phase), senders)

    def receive(self, round: int, phase: int, deadline_s: float, *, until: Collection[str] | None = None) -> Inbox:
        return self.transport.receive(side_round(round, phase), deadline_s, until=until, stream=STREAM)


class Fallback(Exception):
    """This region cannot unmask the round (why): it applies its own update alone."""


class SecAggRound:
    """A region's secure-aggregation exchange, one `exchange` per DiLoCo round. `deadline` is the
    region's AdaptiveDeadline; `drop_mid_round(round)` emulates a region that leaves after its
    inner steps (after SETUP when the round runs one), before its masked update."""

    def __init__(self, *, region: str, regions: Sequence[str], transport: Transport, run_id: str, bits: int,
                 deadline: AdaptiveDeadline, send_timeout_s: float, error_feedback: bool, max_message_bytes: int,
                 drop_mid_round: Callable[[int], bool] = lambda r: False,
                 admission: UpdateAdmission | None = None):
        self.regions = sorted(regions)
        self.deadline, self.send_timeout_s = deadline, send_timeout_s
        self.side = SideChannel(transport, max_message_bytes=max_message_bytes)
        self.side.set_validator(lambda sender, r, phase, payload: bytes(payload))  # checked in the round's thread
        self.pending: list[tuple[int, str, int, Future]] = []  # pushes not yet acknowledged when a round ended
        self.refused: Counter[str] = Counter()
        # A KEY task waits in a worker for its MASKED push's ack: room for both, per peer, and a stalled one.
        self._pool = ThreadPoolExecutor(max_workers=max(6, 3 * len(regions)), thread_name_prefix="geofed-secagg")
        self.region, self.run_id, self.bits = region, run_id, bits
        self.error_feedback, self.drop_mid_round = error_feedback, drop_mid_round
        # security.max_update_value / norm_multiple / robust_aggregation, and the region's own update
        # norms: what a member's scale and the unmasked mean are held to (admission of the round).
        self.admission = admission if admission is not None else UpdateAdmission()
        self._refusals_reported: Counter[str] = Counter()
        tls = getattr(transport, "tls", None)
        self.tls_key = None if tls is None else tls.key_pem
        self.cert: bytes = b"" if tls is None else tls.cert_pem
        self.ca: bytes | None = None if tls is None else tls.ca_pem
        self.book = KeyBook()
        self.keys: RunKeys | None = None
        self.publics: dict[str, bytes] = {}
        self.advert_delivered: set[str] = set()  # peers that filed this region's advert
        self.residual: list[torch.Tensor] | None = None
        # contribution(round, own update, peers) -> the update that is quantised, masked and sent (its
        # absmax sets the shared scales); the error-feedback residual is added after, so it stays what
        # the update the algorithm gave left behind. A seam for plug-ins (the bench's attack member).
        self.contribution_hooks: list[Callable[[int, list[torch.Tensor], Sequence[str]], list[torch.Tensor]]] = []
        # (round, its members, every member's chunk absmax, a row each in members' order): the next
        # round's scales, agreed ahead
        self.ahead: tuple[int, tuple[str, ...], np.ndarray] | None = None

    def close(self) -> None:
        """Stop the push pool without waiting: queued pushes are cancelled, running ones end on their timeout."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- the round ---------------------------------------------------------------------
    def exchange(self, round_: int, tensors: Sequence[torch.Tensor], alive: Sequence[str] | None) -> tuple[list[torch.Tensor], dict]:
        """(the round's mean update, metrics with the exchange keys of regions/sync/common.py)."""
        members = sorted(alive) if alive is not None else list(self.regions)
        peers = [p for p in members if p != self.region]
        m: dict[str, Any] = {"bytes_sent": 0, "bytes_received": 0, "transfers": [], "peers_missing": [],
                             "wait_s": 0.0, "send_failures": {}, "secagg_signed": self.ca is not None,
                             "secagg_phase_s": {}}
        self._harvest(m)  # the last round's self-key pushes (acknowledged during the inner steps)
        self.admission.observe_own(tensors)  # the reference of the mean's norm rule
        t0 = time.monotonic()
        try:
            if len(members) < 3 or self.region not in members:
                # Nothing can be hidden with two regions: this round, the region keeps its own update.
                raise Fallback(f"{len(members)} regions in the round (secure aggregation needs 3)")
            mean, survivors = self._round(round_, tensors, members, peers, m)
        except Fallback as why:
            # Next round runs SETUP, and sends this region's advert again: a peer it lost may have restarted.
            self.ahead = None
            self.advert_delivered.clear()
            m.update(peers_missing=peers, secagg_failed=str(why), secagg_refused=dict(self.refused),
                     refusals=self._take_refusals())
            return [t.detach().clone() for t in tensors], m
        m.update(wait_s=round(time.monotonic() - t0, 6), secagg_survivors=len(survivors),
                 secagg_dropped=sorted(set(members) - survivors), secagg_refused=dict(self.refused),
                 refusals=self._take_refusals())
        # Every survivor holds this same mean: the dropped are not "missing" for the resync.
        return [x.to(device=ref.device, dtype=ref.dtype) for x, ref in zip(mean, tensors)], m

    @property
    def run_keys(self) -> RunKeys:
        """This region's keys for the run (made by its first round, before any other step uses them)."""
        assert self.keys is not None, "no round has run yet"
        return self.keys

    def _round(self, round_: int, tensors: Sequence[torch.Tensor], members: list[str], peers: list[str],
               m: dict[str, Any]) -> tuple[list[torch.Tensor], frozenset[str]]:
        if self.keys is None:
            self.keys = RunKeys.generate(run_id=self.run_id, region=self.region, round=round_,
                                         tls_key_pem=self.tls_key)
        own = [t.detach().float().cpu() for t in tensors]
        for hook in self.contribution_hooks:
            own = hook(round_, own, peers)
        if self.residual is not None:
            own = [o + r for o, r in zip(own, self.residual)]
        self.side.expect(round_, MASKED, peers)
        self.side.expect(round_, RELAY, peers)
        absmax = np.concatenate([masks.chunk_absmax(o.numpy(), CHUNK) for o in own])
        levels = masks.levels_for(len(members), self.bits)
        ahead, self.ahead = self.ahead, None  # set again only by a complete round
        if ahead is not None and ahead[:2] == (round_ - 1, tuple(members)) and set(peers) <= set(self.publics):
            absmaxes = dict(zip(members, ahead[2]))
        else:
            absmaxes = {self.region: absmax, **self._setup(round_, members, peers, absmax, m)}
        refused = self._admit_scales(absmaxes)
        # Capped at max_update_value: no member's value on the grid, nor the mean, can pass it.
        scales = masks.shared_scales([np.minimum(a, self.admission.max_update_value)
                                        for r, a in absmaxes.items() if r not in refused], levels)
        m.update(secagg_levels=levels, secagg_scales_ahead="setup" not in m["secagg_phase_s"])
        if self.drop_mid_round(round_):
            m["secagg_dropped_self"] = True  # emulated: the region leaves before its masked update
            raise Fallback("dropped mid-round (emulated)")
        q, spans = masks.quantize_all(own, scales, levels)
        if self.error_feedback:  # what the grid clipped or rounded away goes out next round
            self.residual = [o - d for o, d in zip(own, masks.dequantize_all(q, scales, spans, own))]
        mine = self.run_keys.mask(q, {p: self.publics[p] for p in peers}, round=round_, bits=self.bits)
        grid = masks.digest(scales)
        masked, absmaxes, shares, sends = self._masked_exchange(round_, mine, grid, absmax, peers, m, refused)
        survivors = frozenset(masked)
        self.advert_delivered -= set(members) - survivors  # a region that missed the round may have restarted
        if len(survivors) < 3:  # the sum of two is the other's update: no self key, no seed, no share relayed, no sum
            raise Fallback(f"{len(survivors)} masked updates arrived (secure aggregation needs 3)")
        complete = survivors == set(members)
        if not complete:  # a lost masked update: the relays cannot rebuild every key; KEY as before, now
            self._send_keys(round_, survivors, sends, grid)
        self_keys, counted = self._relay_exchange(round_, members, survivors, shares, m)
        if complete and counted != set(peers):  # a peer did not count ours: nobody rebuilds our key
            self._send_keys(round_, survivors, sends, grid)
        self_keys = self._key_exchange(round_, survivors, self_keys, grid, m)
        if complete and set(self_keys) == survivors:
            # The common round ends here. Waiting for the masked update's acks (as int8 waits for
            # its update's) counts this round's bytes in it.
            wait(list(sends.values()), timeout=max(1.0, self.deadline.current()))
            self._harvest(m)
            total = masks.unmask_total(masked, self_keys=self_keys, dropped_seeds={}, bits=self.bits)
            self.ahead = (round_, tuple(members), np.stack([absmaxes[r] for r in members]))
        else:
            wait(list(sends.values()), timeout=max(1.0, self.deadline.current()))  # acks decide the reveal
            ackers = {p for p, f in sends.items() if f.done() and f.exception() is None}
            self._harvest(m)
            total = self._unmask(round_, members, survivors, masked, ackers, grid, self_keys, m)
        mean = [d / len(survivors) for d in masks.dequantize_all(total, scales, spans, own)]
        return self._admit_mean(mean, m), survivors

    def _admit_scales(self, absmaxes: dict[str, np.ndarray]) -> dict[str, str]:
        """{member: reason} for the peers whose chunk maxima (their share of the shared scale) are
        refused: out_of_bounds above max_update_value; outlier (unless robust_aggregation is none)
        above norm_multiple x the median of the members' maxima, the norm rule on the largest value.
        Each is counted; every honest region sees the same maxima and refuses the same members, so
        they keep one grid, and the refused member's masked update is then left out as a lost one."""
        adm = self.admission
        peaks = {r: float(a.max()) if a.size else 0.0 for r, a in absmaxes.items()}
        median = statistics.median(peaks.values())
        refused = {}
        for r, peak in sorted(peaks.items()):
            if r == self.region:
                continue
            if peak > adm.max_update_value:
                refused[r] = "out_of_bounds"
            elif adm.mode != "none" and len(peaks) >= 3 and peak > adm.norm_multiple * median:
                refused[r] = "outlier"
        self.refused.update(refused.values())
        return refused

    def _admit_mean(self, mean: list[torch.Tensor], m: dict) -> list[torch.Tensor]:
        """The unmasked mean held to what a peer's update is held to, before the outer step: a value
        above max_update_value (or not finite) fails the round (out_of_bounds; the region applies its
        own update); under clip, a norm above norm_multiple x the region's recent own update norms
        is scaled down to that bound (counted as clipped, sender `secagg-mean`)."""
        adm = self.admission
        peak = max_abs(mean)
        if not math.isfinite(peak) or peak > adm.max_update_value:
            self.refused["out_of_bounds"] += 1
            raise Fallback(f"the unmasked mean holds a value of magnitude {peak:.3g} "
                           f"(security.max_update_value {adm.max_update_value:.3g})")
        bound = adm.bound() if adm.mode == "clip" else None
        norm = l2_norm(mean)
        if bound is not None and norm > bound:
            adm.note_clipped(["secagg-mean"])
            m["secagg_clipped"] = 1
            return [t * (bound / norm) for t in mean]
        return mean

    def _take_refusals(self) -> dict[str, int]:
        """This region's secure-aggregation refusals by reason since the last round's report: they
        reach metrics' `refusals` and summary.json like the transport's."""
        now = Counter(self.refused)
        out = {k: n - self._refusals_reported[k] for k, n in now.items() if n > self._refusals_reported[k]}
        self._refusals_reported = now
        return out

    def _setup(self, round_: int, members: list[str], peers: list[str], absmax: np.ndarray, m: dict) -> dict[str, np.ndarray]:
        """SETUP (step 1 when no scales were agreed ahead): every peer's absmax, keys filed."""
        t = time.monotonic()
        self.side.expect(round_, SETUP, peers)
        advert = wire.encode_advert(self.run_keys.advert, self.cert)
        need = ",".join(sorted(p for p in peers if p not in self.publics)).encode()  # keys this region lacks
        setups = {p: wire.pack(absmax.astype("<f4").tobytes(), b"" if p in self.advert_delivered else advert, need)
                  for p in peers}
        with_advert = {p for p in peers if p not in self.advert_delivered}
        inbox, futures = self._round_trip(round_, SETUP, setups, m)
        assert inbox is not None  # it received
        for p in with_advert:  # filed once its push is acknowledged (the next SETUP then sends none)
            futures[p].add_done_callback(functools.partial(self._advert_filed, p))
        peer_absmax = self._take_setups(inbox, members, absmax.size, with_advert)
        m["secagg_phase_s"]["setup"] = round(time.monotonic() - t, 6)
        if set(peer_absmax) != set(peers) or not set(peers) <= set(self.publics):
            raise Fallback(f"no scales or key from {sorted(set(peers) - (set(peer_absmax) & set(self.publics)))}")
        return peer_absmax

    def _advert_filed(self, peer: str, push: Future) -> None:
        if push.exception() is None:
            self.advert_delivered.add(peer)

    def _masked_exchange(self, round_: int, mine: np.ndarray, grid: bytes, absmax: np.ndarray, peers: Sequence[str],
                         m: dict[str, Any], refused: Collection[str] = frozenset()
                         ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, tuple[bytes, bytes]],
                                    dict[str, Future]]:
        """Step 2: push the masked update (its grid, the next round's absmax) and take the peers'.
        Returns ({survivor: masked}, {survivor: absmax}, {survivor: (this region's share of its
        self key, the key's check)}, {peer: the push's future})."""
        t = time.monotonic()
        key = self.run_keys.self_key(round_)
        check = relay.check(self.run_id, round_, self.region, key)
        body, tail = wire.encode_masked(mine), absmax.astype("<f4").tobytes()
        # Each peer's XOR share of the round's self key rides with the masked update: only a peer
        # that got the update holds its share (and relays it, step 3).
        sends = {p: self._pool.submit(self.side.send, p, round_, MASKED, wire.pack(body, grid, tail, share + check),
                                      timeout_s=self.send_timeout_s)
                 for p, share in relay.split(key, peers).items()}
        self.pending += [(round_, p, MASKED, f) for p, f in sends.items()]
        inbox = self.side.receive(round_, MASKED, self.deadline.current())
        if inbox.missing:  # as the Exchanger does: a miss widens the deadline, a complete round teaches it
            self.deadline.observe_miss()
        else:
            self.deadline.observe(inbox.waited_s)
        self._count_received(inbox, MASKED, m)
        masked, absmaxes, shares = {self.region: mine}, {self.region: absmax}, {}
        for sender, raw in sorted(inbox.received.items()):
            if sender in refused:  # its scale was refused (counted then): left out as a lost update
                continue
            try:
                body, their_grid, their_absmax, their_share = wire.unpack(raw, 4)
                if len(their_share) != relay.SHARE + relay.CHECK:
                    raise SecAggError("malformed", f"{sender}'s self-key share is {len(their_share)} bytes")
                if their_grid != grid:
                    raise SecAggError("wrong_grid", f"{sender} quantised on another grid (its scales differ)")
                their = masks.absmax_of(their_absmax, absmax.size, sender)
                masked[sender] = wire.decode_masked(body, numel=mine.size, bits=self.bits)
            except SecAggError as exc:
                self.refused[exc.reason] += 1
                continue
            absmaxes[sender] = their
            shares[sender] = (their_share[:relay.SHARE], their_share[relay.SHARE:])
        m["secagg_phase_s"]["masked"] = round(time.monotonic() - t, 6)
        return masked, absmaxes, shares, sends

    def _relay_exchange(self, round_: int, members: list[str], survivors: frozenset[str],
                        shares: dict[str, tuple[bytes, bytes]], m: dict[str, Any]) -> tuple[dict[str, bytes], set[str]]:
        """Step 3: relay this region's share of each survivor's self key to every other member
        (with whether it counted that member's own masked update) and rebuild the self keys whose
        every share came: ({owner: self key}, this region's included; {peers that counted ours})."""
        t = time.monotonic()
        others = sorted(survivors - {self.region})
        payloads = {p: relay.encode_relay(relay.tag(self.run_id, round_, self.region, p), p in survivors,
                                          {o: shares[o][0] for o in others if o != p}, self.regions)
                    for p in members if p != self.region}
        # Every member relays to every other; a survivor's is awaited (it sent its masked update),
        # a lost region's taken if it came by then. Twice the deadline, as for KEY: a peer that lost
        # a masked update relays only once its own deadline is over.
        inbox, _ = self._round_trip(round_, RELAY, payloads, m, until=others, wait_s=2 * self.deadline.current())
        assert inbox is not None  # it received
        relayed, counted = {}, set()
        for sender, raw in sorted(inbox.received.items()):
            try:
                flag, relayed[sender] = relay.decode_relay(raw, binding=relay.tag(self.run_id, round_, sender, self.region),
                                                           regions=self.regions, relayer=sender, me=self.region)
            except SecAggError as exc:
                self.refused[exc.reason] += 1
                continue
            if flag:
                counted.add(sender)
        keys, forged = relay.rebuild(self.run_id, round_, self.region, members, shares, relayed)
        if forged:  # a forged share: the key comes by KEY or not at all
            self.refused["wrong_share"] += forged
        keys[self.region] = self.run_keys.self_key(round_)
        m["secagg_phase_s"]["relay"] = round(time.monotonic() - t, 6)
        return keys, counted

    def _take_setups(self, inbox: Inbox, members: list[str], nchunks: int, with_advert: set[str]) -> dict[str, np.ndarray]:
        """Each peer's absmax, and its advert when it sent one (refused setups left out). A peer
        that lacks this region's key and was not sent it this round gets it next round."""
        out = {}
        for sender, payload in sorted(inbox.received.items()):
            try:
                raw, advert, need = wire.unpack(payload, 3)
                if self.region in need.decode("ascii", "replace").split(",") and sender not in with_advert:
                    self.advert_delivered.discard(sender)  # it lost our key (a restart): send it again
                am = masks.absmax_of(raw, nchunks, sender)
                if advert:
                    adv, cert = wire.decode_advert(advert)
                    verify_run_advert(adv, sender=sender, run_id=self.run_id, regions=members, book=self.book,
                                          cert_pem=cert, ca_pem=self.ca)
                    if self.publics.get(sender) not in (None, adv.public_key):
                        self.advert_delivered.discard(sender)  # it has new keys (a restart): it needs ours again
                    self.publics[sender] = adv.public_key
            except SecAggError as exc:
                self.refused[exc.reason] += 1
                continue
            out[sender] = am
        return out

    # ---- KEY, REVEAL, RECOVER: when the common round cannot end at RELAY -----------------
    def _send_keys(self, round_: int, survivors: frozenset[str], sends: dict[str, Future], grid: bytes) -> None:
        """KEY: the self key to each survivor once it acknowledged the masked update (a worker
        waits for the ack: no ack, no key)."""
        msg = wire.encode_reveal(self.run_id, round_, self.region, self_key=self.run_keys.self_key(round_), survivors=(),
                                grid=grid)
        for p in sorted(survivors - {self.region}):
            self.pending.append((round_, p, KEY, self._pool.submit(self._key_after_ack, sends[p], p, round_, msg)))

    def _key_exchange(self, round_: int, survivors: frozenset[str], self_keys: dict[str, bytes], grid: bytes,
                      m: dict[str, Any]) -> dict[str, bytes]:
        """The self keys the relays did not rebuild, by KEY; returns every self key held."""
        others = sorted(survivors - {self.region})
        self.side.expect(round_, KEY, others)
        lacking = sorted(survivors - set(self_keys))
        if not lacking:
            return self_keys  # the KEY slot closes with the next receive (keys sent anyway are dropped)
        t = time.monotonic()
        # Twice the deadline: a peer that waited out its own deadline for a masked update that never
        # came sends its key only then (a complete round's keys arrive within an RTT of the updates).
        inbox = self.side.receive(round_, KEY, 2 * self.deadline.current(), until=lacking)
        self._count_received(inbox, KEY, m)
        self_keys = dict(self_keys)
        for sender, raw in sorted(inbox.received.items()):
            try:
                run_id, r, region, their_key, _, their_grid = wire.decode_reveal(raw)
                if (run_id, r, region) != (self.run_id, round_, sender) or not their_key:
                    raise SecAggError("wrong_round", f"a self key of {region!r} for round {r} pushed by {sender!r}")
            except SecAggError as exc:
                self.refused[exc.reason] += 1
                continue
            if their_grid == grid:
                self_keys.setdefault(sender, their_key)
        m["secagg_phase_s"]["key"] = round(time.monotonic() - t, 6)
        return self_keys

    def _key_after_ack(self, masked: Future, peer: str, round_: int, msg: bytes) -> TransferStats | None:
        """In a worker: the self key to `peer` once its ack of the masked update is in (None: no ack)."""
        try:
            masked.result(timeout=self.send_timeout_s)
        except (TransportError, TimeoutError):
            return None
        return self.side.send(peer, round_, KEY, msg, timeout_s=self.send_timeout_s)

    def _unmask(self, round_: int, members: Sequence[str], survivors: frozenset[str], masked: dict[str, np.ndarray],
                ackers: set[str], grid: bytes, self_keys: dict[str, bytes], m: dict[str, Any]) -> np.ndarray:
        """Step 4 (a region or a self key is missing): the exact integer sum of the survivors' updates."""
        t = time.monotonic()
        others = sorted(survivors - {self.region})
        dropped = sorted(set(members) - survivors)
        self.side.expect(round_, REVEAL, others)
        if dropped:
            self.side.expect(round_, RECOVER, others)
        reveals = {p: wire.encode_reveal(self.run_id, round_, self.region, survivors=survivors, grid=grid,
                                        self_key=self.run_keys.self_key(round_) if p in ackers else b"")
                   for p in others}
        inbox, _ = self._round_trip(round_, REVEAL, reveals, m)
        assert inbox is not None  # it received
        self_keys = dict(self_keys)
        answers = {}
        for sender, raw in sorted(inbox.received.items()):
            try:
                run_id, r, region, key, theirs, their_grid = wire.decode_reveal(raw)
                if (run_id, r, region) != (self.run_id, round_, sender):
                    raise SecAggError("wrong_round", f"a reveal of {region!r} for round {r} pushed by {sender!r}")
            except SecAggError as exc:
                self.refused[exc.reason] += 1
                continue
            if theirs != survivors or their_grid != grid:
                raise Fallback(f"{sender} saw survivors {sorted(theirs)} (or another grid); this region saw {sorted(survivors)}")
            if key:
                self_keys[sender] = key
            lost = set(members) - theirs
            if lost:  # it asks for the pair seeds of the regions it lost; answer for those this region lost too
                answers[sender] = wire.encode_recover(self.run_id, round_, self.region, {
                    d: self.run_keys.pair_seed(d, self.publics[d], round_) for d in lost if d not in survivors})
        if set(self_keys) != survivors:
            raise Fallback(f"no self key from {sorted(survivors - set(self_keys))}")
        seeds = {(self.region, d): self.run_keys.pair_seed(d, self.publics[d], round_) for d in dropped}
        if answers or dropped:
            inbox, _ = self._round_trip(round_, RECOVER, answers, m, receive=bool(dropped))
            for sender, raw in sorted((inbox.received if inbox is not None else {}).items()):
                try:
                    run_id, r, region, their_seeds = wire.decode_recover(raw)
                    if (run_id, r, region) != (self.run_id, round_, sender):
                        raise SecAggError("wrong_round", f"a recovery answer of {region!r} pushed by {sender!r}")
                except SecAggError as exc:
                    self.refused[exc.reason] += 1
                    continue
                seeds.update({(sender, d): seed for d, seed in their_seeds.items() if d in dropped})
        m["secagg_phase_s"]["reveal"] = round(time.monotonic() - t, 6)  # with the recovery answers
        missing = [(s, d) for s in survivors for d in dropped if (s, d) not in seeds]
        if missing:
            raise Fallback(f"no pair seeds for {sorted(missing)}")
        return masks.unmask_total(masked, self_keys=self_keys, dropped_seeds=seeds, bits=self.bits)

    # ---- the side messages every phase shares ---------------------------------------------
    def _harvest(self, m: dict) -> None:
        """Count the pushes of `pending` that ended; the others stay pending, counted by a later
        round. The common round waits for no self-key ack: those pushes end while the next round's
        inner steps run (the last round's few hundred bytes are not counted)."""
        still = []
        for round_, peer, phase, fut in self.pending:
            if not fut.done():
                still.append((round_, peer, phase, fut))
                continue
            try:
                stats = fut.result()
            except TransportError as exc:
                m["send_failures"][peer] = f"secagg round {round_} phase {phase}: {exc}"
                continue
            if stats is None:  # a self key not sent: the masked update was not acknowledged
                continue
            m["bytes_sent"] += stats.bytes
            if phase == MASKED:
                m["transfers"].append({"peer": peer, "direction": "send", "bytes": stats.bytes,
                                       "seconds": round(stats.seconds, 6), "concurrent": len(self.regions) - 1})
        self.pending = still

    @staticmethod
    def _count_received(inbox: Inbox, phase: int, m: dict[str, Any]) -> None:
        for sender, (nbytes, seconds) in inbox.timings.items():
            m["bytes_received"] += nbytes
            if phase == MASKED:
                m["transfers"].append({"peer": sender, "direction": "recv", "bytes": nbytes, "seconds": round(seconds, 6)})

    def _round_trip(self, round_: int, phase: int, payloads: dict[str, bytes], m: dict[str, Any], *,
                    receive: bool = True, until: Collection[str] | None = None,
                    wait_s: float | None = None) -> tuple[Inbox | None, dict[str, Future]]:
        """Push each peer its payload and wait (the deadline) for the peers' of this phase; returns
        (the inbox, {peer: its push's future}). No ack is waited for: the pushes are counted when
        they end (`_harvest`), and only the masked update's acks decide anything."""
        futures = {p: self._pool.submit(self.side.send, p, round_, phase, b, timeout_s=self.send_timeout_s)
                   for p, b in payloads.items()}
        self.pending += [(round_, p, phase, f) for p, f in futures.items()]
        wait_s = self.deadline.current() if wait_s is None else wait_s
        inbox = self.side.receive(round_, phase, wait_s, until=until) if receive else None
        if inbox is not None:
            self._count_received(inbox, phase, m)
        return inbox, futures


class SecureAggregation(RoundHook):
    """security.secure_aggregation in a region's round (regions/hooks.py): the round's mean is the
    unmasked sum of SecAggRound's exchange, in place of the exchange and the mix. The config's rules
    (full topology, an outer step, int8/int4/randomk codecs, no overlap or fragments) are
    orchestrator/config/privacy.py's; the driver has no side of its own."""

    def __init__(self, secagg: SecAggRound):
        self.secagg = secagg

    def aggregate(self, plan: RoundPlan, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, Any]]:
        return self.secagg.exchange(plan.round, tensors, plan.alive)


def make_secagg(cfg: Any, region: str, transport: Transport, run_dir: Path, *, deadline: AdaptiveDeadline,
                max_message_bytes: int, admission: UpdateAdmission | None = None) -> SecAggRound | None:
    """The region's SecAggRound when security.secure_aggregation is on (None otherwise). Absent
    regions of regions.emulation.availability with `mid_round` leave mid-round instead."""
    sec = cfg.security
    if not sec.secure_aggregation:
        return None
    from ..emulation import absent_regions

    emulation, names = cfg.regions.emulation, list(cfg.regions.names)
    mid_round = emulation.active and emulation.availability.mid_round
    return SecAggRound(region=region, regions=names, transport=transport, run_id=f"{cfg.run.name}/{run_dir.name}",
                       bits=sec.secagg_bits, deadline=deadline,
                       send_timeout_s=cfg.sync.deadline.max_s, error_feedback=cfg.compression.error_feedback,
                       max_message_bytes=max_message_bytes, admission=admission,
                       drop_mid_round=lambda r: mid_round and region in absent_regions(emulation, r, names))
