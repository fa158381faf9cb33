"""Secure aggregation in DiLoCo's round (``security.secure_aggregation``; docs/privacy.md).

Keys cross each link once per run (p2p/secagg_run.py). One round of region i, after its inner
steps; every message goes over the run's transport in secure aggregation's own side slots
(p2p/secagg_slot.py), and every wait has the round's deadline. The common round (every region
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
   XOR share of i's round self key (p2p/secagg_relay.py) with a check of the key.
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

Here: the round and steps 1-3 (SETUP, MASKED, RELAY); KEY, REVEAL and RECOVER, which run only
when the common round cannot end at RELAY, are in regions/secagg_recovery.py, and the side
messages' push, wait and counting every phase shares in regions/secagg_io.py.

A region that cannot unmask (no keys, a missing reveal or answer, survivors that disagree)
applies its own update alone and reports every peer as missed: the driver's resync makes one
model again. Refused side messages are counted by SecAggError.reason under `secagg_refused`;
`secagg_phase_s` has each phase's seconds and `secagg_scales_ahead` whether SETUP was skipped.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import wait
from typing import Any

import numpy as np
import torch

from geofed.p2p import secagg_relay as relay
from geofed.p2p import secagg_run as run
from geofed.p2p import secmask
from geofed.p2p.secagg import KeyBook, SecAggError
from geofed.p2p.secagg_slot import MASKED, RELAY, SETUP
from geofed.p2p.robust import UpdateAdmission, l2_norm, max_abs
from geofed.p2p.secagg_wire import decode_advert, decode_masked, encode_advert, encode_masked
from geofed.p2p.transport import Transport

from .secagg_grid import CHUNK, absmax_of, dequantize_all, pack, quantize_all, unpack
from .secagg_io import Fallback
from .secagg_recovery import SecAggRecovery


class SecAggRound(SecAggRecovery):
    """A region's secure-aggregation exchange, one `exchange` per DiLoCo round. `deadline` is the
    region's AdaptiveDeadline; `drop_mid_round(round)` emulates a region that leaves after its
    inner steps (after SETUP when the round runs one), before its masked update."""

    hostile = None  # geofed bench attack only: a member whose contribution lies (regions/adversary.py)

    def __init__(self, *, region: str, regions: Sequence[str], transport: Transport, run_id: str, bits: int,
                 deadline, send_timeout_s: float, error_feedback: bool, max_message_bytes: int,
                 drop_mid_round=lambda r: False, admission: UpdateAdmission | None = None):
        super().__init__(regions=regions, transport=transport, deadline=deadline, send_timeout_s=send_timeout_s,
                         max_message_bytes=max_message_bytes)
        self.region, self.run_id, self.bits = region, run_id, bits
        self.error_feedback, self.drop_mid_round = error_feedback, drop_mid_round
        # security.max_update_value / norm_multiple / robust_aggregation, and the region's own update
        # norms: what a member's scale and the unmasked mean are held to (admission of the round).
        self.admission = admission if admission is not None else UpdateAdmission()
        self._refusals_reported: Counter[str] = Counter()
        tls = getattr(transport, "tls", None)
        self.tls_key = None if tls is None else tls.key_pem
        self.cert, self.ca = (b"", None) if tls is None else (tls.cert_pem, tls.ca_pem)
        self.book = KeyBook()
        self.keys: run.RunKeys | None = None
        self.publics: dict[str, bytes] = {}
        self.advert_delivered: set[str] = set()  # peers that filed this region's advert
        self.residual: list[torch.Tensor] | None = None
        # (round, its members, every member's chunk absmax, a row each in members' order): the next
        # round's scales, agreed ahead
        self.ahead: tuple[int, tuple[str, ...], np.ndarray] | None = None

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

    def _round(self, round_: int, tensors, members: list[str], peers: list[str], m: dict):
        if self.keys is None:
            self.keys = run.RunKeys.generate(run_id=self.run_id, region=self.region, round=round_,
                                             tls_key_pem=self.tls_key)
        own = [t.detach().float().cpu() for t in tensors]
        if self.hostile is not None:
            own = self.hostile.masked(round_, own, peers)
        if self.residual is not None:
            own = [o + r for o, r in zip(own, self.residual)]
        self.side.expect(round_, MASKED, peers)
        self.side.expect(round_, RELAY, peers)
        absmax = np.concatenate([secmask.chunk_absmax(o.numpy(), CHUNK) for o in own])
        levels = secmask.levels_for(len(members), self.bits)
        ahead, self.ahead = self.ahead, None  # set again only by a complete round
        if ahead is not None and ahead[:2] == (round_ - 1, tuple(members)) and set(peers) <= set(self.publics):
            absmaxes = dict(zip(members, ahead[2]))
        else:
            absmaxes = {self.region: absmax, **self._setup(round_, members, peers, absmax, m)}
        refused = self._admit_scales(absmaxes)
        # Capped at max_update_value: no member's value on the grid, nor the mean, can pass it.
        scales = secmask.shared_scales([np.minimum(a, self.admission.max_update_value)
                                        for r, a in absmaxes.items() if r not in refused], levels)
        m.update(secagg_levels=levels, secagg_scales_ahead="setup" not in m["secagg_phase_s"])
        if self.drop_mid_round(round_):
            m["secagg_dropped_self"] = True  # emulated: the region leaves before its masked update
            raise Fallback("dropped mid-round (emulated)")
        q, spans = quantize_all(own, scales, levels)
        if self.error_feedback:  # what the grid clipped or rounded away goes out next round
            self.residual = [o - d for o, d in zip(own, dequantize_all(q, scales, spans, own))]
        mine = run.mask_values(self.keys, {p: self.publics[p] for p in peers}, q, round=round_, bits=self.bits)
        grid = run.digest(scales)
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
            total = run.unmask_total(masked, self_keys=self_keys, dropped_seeds={}, bits=self.bits)
            self.ahead = (round_, tuple(members), np.stack([absmaxes[r] for r in members]))
        else:
            wait(list(sends.values()), timeout=max(1.0, self.deadline.current()))  # acks decide the reveal
            ackers = {p for p, f in sends.items() if f.done() and f.exception() is None}
            self._harvest(m)
            total = self._unmask(round_, members, survivors, masked, ackers, grid, self_keys, m)
        mean = [d / len(survivors) for d in dequantize_all(total, scales, spans, own)]
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
        advert = encode_advert(self.keys.advert, self.cert)
        need = ",".join(sorted(p for p in peers if p not in self.publics)).encode()  # keys this region lacks
        setups = {p: pack(absmax.astype("<f4").tobytes(), b"" if p in self.advert_delivered else advert, need)
                  for p in peers}
        with_advert = {p for p in peers if p not in self.advert_delivered}
        inbox, futures = self._round_trip(round_, SETUP, setups, m)
        for p in with_advert:  # filed once its push is acknowledged (the next SETUP then sends none)
            futures[p].add_done_callback(lambda f, p=p: f.exception() is None and self.advert_delivered.add(p))
        peer_absmax = self._take_setups(inbox, members, absmax.size, with_advert)
        m["secagg_phase_s"]["setup"] = round(time.monotonic() - t, 6)
        if set(peer_absmax) != set(peers) or not set(peers) <= set(self.publics):
            raise Fallback(f"no scales or key from {sorted(set(peers) - (set(peer_absmax) & set(self.publics)))}")
        return peer_absmax

    def _masked_exchange(self, round_: int, mine: np.ndarray, grid: bytes, absmax: np.ndarray, peers, m,
                         refused=frozenset()):
        """Step 2: push the masked update (its grid, the next round's absmax) and take the peers'.
        Returns ({survivor: masked}, {survivor: absmax}, {survivor: (this region's share of its
        self key, the key's check)}, {peer: the push's future})."""
        t = time.monotonic()
        key = self.keys.self_key(round_)
        check = relay.check(self.run_id, round_, self.region, key)
        body, tail = encode_masked(mine), absmax.astype("<f4").tobytes()
        # Each peer's XOR share of the round's self key rides with the masked update: only a peer
        # that got the update holds its share (and relays it, step 3).
        sends = {p: self._pool.submit(self.side.send, p, round_, MASKED, pack(body, grid, tail, share + check),
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
                body, their_grid, their_absmax, their_share = unpack(raw, 4)
                if len(their_share) != relay.SHARE + relay.CHECK:
                    raise SecAggError("malformed", f"{sender}'s self-key share is {len(their_share)} bytes")
                if their_grid != grid:
                    raise SecAggError("wrong_grid", f"{sender} quantised on another grid (its scales differ)")
                their = absmax_of(their_absmax, absmax.size, sender)
                masked[sender] = decode_masked(body, numel=mine.size, bits=self.bits)
            except SecAggError as exc:
                self.refused[exc.reason] += 1
                continue
            absmaxes[sender] = their
            shares[sender] = (their_share[:relay.SHARE], their_share[relay.SHARE:])
        m["secagg_phase_s"]["masked"] = round(time.monotonic() - t, 6)
        return masked, absmaxes, shares, sends

    def _relay_exchange(self, round_: int, members: list[str], survivors: frozenset[str], shares, m):
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
        keys[self.region] = self.keys.self_key(round_)
        m["secagg_phase_s"]["relay"] = round(time.monotonic() - t, 6)
        return keys, counted

    def _take_setups(self, inbox, members: list[str], nchunks: int, with_advert: set[str]) -> dict[str, np.ndarray]:
        """Each peer's absmax, and its advert when it sent one (refused setups left out). A peer
        that lacks this region's key and was not sent it this round gets it next round."""
        out = {}
        for sender, payload in sorted(inbox.received.items()):
            try:
                raw, advert, need = unpack(payload, 3)
                if self.region in need.decode("ascii", "replace").split(",") and sender not in with_advert:
                    self.advert_delivered.discard(sender)  # it lost our key (a restart): send it again
                am = absmax_of(raw, nchunks, sender)
                if advert:
                    adv, cert = decode_advert(advert)
                    run.verify_run_advert(adv, sender=sender, run_id=self.run_id, regions=members, book=self.book,
                                          cert_pem=cert, ca_pem=self.ca)
                    if self.publics.get(sender) not in (None, adv.public_key):
                        self.advert_delivered.discard(sender)  # it has new keys (a restart): it needs ours again
                    self.publics[sender] = adv.public_key
            except SecAggError as exc:
                self.refused[exc.reason] += 1
                continue
            out[sender] = am
        return out


def make_secagg(cfg: Any, region: str, transport: Transport, run_dir, *, deadline,
                max_message_bytes: int, admission: UpdateAdmission | None = None) -> SecAggRound | None:
    """The region's SecAggRound when security.secure_aggregation is on (None otherwise). Absent
    regions of regions.emulation.availability with `mid_round` leave mid-round instead."""
    sec = cfg.security
    if not sec.secure_aggregation:
        return None
    from .emulation import absent_regions

    emulation, names = cfg.regions.emulation, list(cfg.regions.names)
    mid_round = emulation.active and emulation.availability.mid_round
    return SecAggRound(region=region, regions=names, transport=transport, run_id=f"{cfg.run.name}/{run_dir.name}",
                       bits=sec.secagg_bits, deadline=deadline,
                       send_timeout_s=cfg.sync.deadline.max_s, error_feedback=cfg.compression.error_feedback,
                       max_message_bytes=max_message_bytes, admission=admission,
                       drop_mid_round=lambda r: mid_round and region in absent_regions(emulation, r, names))
