"""Secure aggregation in DiLoCo's round (``security.secure_aggregation``; docs/privacy.md).

One round of region i, after its inner steps (every message goes over the run's transport, in
secure aggregation's own side slots, p2p/secagg_slot.py; every wait has the round's deadline):

1. SETUP to every peer: its signed key advert, the peer's Shamir shares, and the per-chunk
   absmax of its update (4096-value chunks per tensor, int8's; public, as int8 sends its scales).
2. Every region quantises with the same scales (the largest absmax over the round's regions,
   over the levels that keep a sum of n from wrapping the ring), masks, and sends MASKED.
3. The survivors are the regions whose masked update arrived by the deadline; REVEAL (shares of
   the survivors' self seeds and of the dropped regions' keys) goes to every survivor.
4. The sum of the survivors' updates is unmasked, dequantised and divided by their number: the
   full topology's uniform mean, the same at every region whose survivors agree.

A region that cannot unmask (too few keys or reveals, survivors that disagree) applies its own
update alone and reports the peers it missed: the driver's resync makes one model again.
Refused side messages are counted by SecAggError.reason under `secagg_refused`.
"""

from __future__ import annotations

import struct
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import torch

from geofed.p2p import secmask
from geofed.p2p.secagg import KeyBook, RoundContext, SecAggError, default_threshold
from geofed.p2p.secagg_session import SecAggSession
from geofed.p2p.secagg_slot import MASKED, REVEAL, SETUP, SideChannel
from geofed.p2p.transport import Transport, TransportError

CHUNK = 4096  # values per shared scale (int8's chunk)


def _pack(*parts: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(p)) + p for p in parts)


def _unpack(payload: bytes, count: int) -> list[bytes]:
    out, pos = [], 0
    for _ in range(count):
        if pos + 4 > len(payload):
            raise SecAggError("malformed", "a setup message ends inside a length")
        (n,) = struct.unpack_from("<I", payload, pos)
        if pos + 4 + n > len(payload):
            raise SecAggError("malformed", "a setup message ends inside a part")
        out.append(payload[pos + 4:pos + 4 + n])
        pos += 4 + n
    if pos != len(payload):
        raise SecAggError("malformed", f"{len(payload) - pos} bytes after a setup message")
    return out


class SecAggRound:
    """A region's secure-aggregation exchange, one `exchange` per DiLoCo round. `drop_mid_round`
    (round -> bool) emulates a region that leaves after setting up the round's keys."""

    def __init__(self, *, region: str, regions: Sequence[str], transport: Transport, run_id: str,
                 threshold: int | None, bits: int, deadline_s, send_timeout_s: float, error_feedback: bool,
                 max_message_bytes: int, drop_mid_round=lambda r: False):
        self.region, self.regions = region, sorted(regions)
        self.run_id, self.threshold, self.bits = run_id, threshold, bits
        self.deadline_s, self.send_timeout_s = deadline_s, send_timeout_s
        self.error_feedback, self.drop_mid_round = error_feedback, drop_mid_round
        tls = getattr(transport, "tls", None)
        self.pems = {} if tls is None else {"tls_key_pem": tls.key_pem, "cert_pem": tls.cert_pem, "ca_pem": tls.ca_pem}
        self.side = SideChannel(transport, max_message_bytes=max_message_bytes)
        self.side.set_validator(self._admit)
        self.book = KeyBook()
        self.residual: list[torch.Tensor] | None = None
        self.refused: Counter[str] = Counter()
        self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(regions)), thread_name_prefix="geofed-secagg")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _admit(sender: str, round_: int, phase: int, payload: memoryview) -> bytes:
        """The side mailbox's validator: a copy of the bytes; the session checks them in the
        round's thread (a peer may push round r's setup before this region has begun round r)."""
        return bytes(payload)

    # ---- the round ---------------------------------------------------------------------
    def exchange(self, round_: int, tensors: Sequence[torch.Tensor], alive: Sequence[str] | None) -> tuple[list[torch.Tensor], dict]:
        """(the round's mean update, metrics with the exchange keys of regions/sync/common.py)."""
        members = sorted(alive) if alive is not None else list(self.regions)
        peers = [p for p in members if p != self.region]
        m: dict[str, Any] = {"bytes_sent": 0, "bytes_received": 0, "transfers": [], "peers_missing": [],
                             "wait_s": 0.0, "send_failures": {}}
        own = [t.detach().float().cpu() for t in tensors]
        if self.residual is not None:
            own = [o + r for o, r in zip(own, self.residual)]
        if len(members) < 3 or self.region not in members:
            # Nothing can be hidden with two regions: this round, the region keeps its own update.
            return self._alone(tensors, m, peers, why=f"{len(members)} regions in the round (secure aggregation needs 3)")
        n = len(members)
        t = self.threshold or default_threshold(n)
        ctx = RoundContext(run_id=self.run_id, round=round_, regions=tuple(members), threshold=max(2, min(t, n - 1)),
                           bits=self.bits)
        numel = sum(o.numel() for o in own)
        session = SecAggSession(ctx, self.region, book=self.book, numel=numel, **self.pems)
        for phase in (SETUP, MASKED, REVEAL):
            self.side.expect(round_, phase, peers)
        t0 = time.monotonic()
        absmax = np.concatenate([secmask.chunk_absmax(o.numpy(), CHUNK) for o in own])
        setups = {p: _pack(session.advert_bytes(), session.bundle_bytes(p), absmax.astype("<f4").tobytes())
                  for p in peers}
        inbox = self._round_trip(round_, SETUP, setups, m)
        peer_absmax = self._take_setups(session, inbox, absmax.size)
        if set(peer_absmax) != set(peers):
            return self._alone(tensors, m, peers, why="key setup incomplete", session_missing=sorted(set(peers) - set(peer_absmax)))
        if self.drop_mid_round(round_):
            m["secagg_dropped_self"] = True  # emulated: the region leaves with its keys dealt
            return self._alone(tensors, m, peers, why="dropped mid-round (emulated)")
        levels = secmask.levels_for(n, self.bits)
        scales = secmask.shared_scales([absmax, *peer_absmax.values()], levels)
        q, spans = self._quantize(own, scales, levels)
        if self.error_feedback:
            self.residual = [o - d for o, d in zip(own, self._dequantize(q, scales, spans, own))]
        masked = session.masked_bytes(q)
        inbox = self._round_trip(round_, MASKED, {p: masked for p in peers}, m)
        survivors = {self.region}
        for sender, payload in inbox.received.items():
            if self._checked(session.on_masked, sender, payload):
                survivors.add(sender)
        dropped = sorted(set(members) - survivors)
        reveal = session.reveal_bytes(survivors)
        inbox = self._round_trip(round_, REVEAL, {p: reveal for p in sorted(survivors - {self.region})}, m)
        for sender, payload in inbox.received.items():
            self._checked(session.on_reveal, sender, payload)
        try:
            total = session.total()
        except SecAggError as exc:
            self.refused[exc.reason] += 1
            return self._alone(tensors, m, peers, why=f"cannot unmask: {exc}")
        mean = [d / len(survivors) for d in self._dequantize(total, scales, spans, own)]
        m.update(wait_s=round(time.monotonic() - t0, 6), secagg_survivors=len(survivors), secagg_dropped=dropped,
                 secagg_levels=levels, secagg_refused=dict(self.refused), secagg_signed=bool(self.pems))
        # Every survivor holds this same mean: the dropped are not "missing" for the resync.
        return [x.to(device=ref.device, dtype=ref.dtype) for x, ref in zip(mean, tensors)], m

    def _alone(self, tensors, m: dict, peers: list[str], *, why: str, **extra) -> tuple[list[torch.Tensor], dict]:
        m.update(peers_missing=peers, secagg_failed=why, secagg_refused=dict(self.refused), **extra)
        return [t.detach().clone() for t in tensors], m

    def _checked(self, fn, sender: str, payload: bytes) -> bool:
        try:
            fn(sender, payload)
            return True
        except SecAggError as exc:
            self.refused[exc.reason] += 1
            return False

    def _take_setups(self, session: SecAggSession, inbox, nchunks: int) -> dict[str, np.ndarray]:
        """Adverts and bundles into the session; each peer's absmax (refused setups left out)."""
        out = {}
        for sender, payload in sorted(inbox.received.items()):
            try:
                advert, bundle, raw = _unpack(payload, 3)
                if len(raw) != 4 * nchunks:
                    raise SecAggError("malformed", f"{sender} sent {len(raw) // 4} chunk maxima, {nchunks} expected")
                am = np.frombuffer(raw, dtype="<f4").astype(np.float32)
                if not np.all(np.isfinite(am)) or np.any(am < 0):
                    raise SecAggError("malformed", f"{sender}'s chunk maxima are not finite non-negative numbers")
                session.on_advert(sender, advert)
                session.on_bundle(sender, bundle)
            except SecAggError as exc:
                self.refused[exc.reason] += 1
                continue
            out[sender] = am
        return out

    def _round_trip(self, round_: int, phase: int, payloads: dict[str, bytes], m: dict):
        """Push each peer its payload, wait for the peers' (the deadline), count the traffic."""
        futures = {p: self._pool.submit(self.side.send, p, round_, phase, b, timeout_s=self.send_timeout_s)
                   for p, b in payloads.items()}
        deadline = self.deadline_s()
        inbox = self.side.receive(round_, phase, deadline)
        wait(list(futures.values()), timeout=max(1.0, deadline))
        for peer, fut in futures.items():
            if not fut.done():
                m["send_failures"][peer] = f"secagg phase {phase} still in flight after the deadline"
                continue
            try:
                stats = fut.result()
            except TransportError as exc:
                m["send_failures"][peer] = str(exc)
                continue
            m["bytes_sent"] += stats.bytes
            if phase == MASKED:
                m["transfers"].append({"peer": peer, "direction": "send", "bytes": stats.bytes,
                                       "seconds": round(stats.seconds, 6), "concurrent": len(futures)})
        for sender, (nbytes, seconds) in inbox.timings.items():
            m["bytes_received"] += nbytes
            if phase == MASKED:
                m["transfers"].append({"peer": sender, "direction": "recv", "bytes": nbytes, "seconds": round(seconds, 6)})
        return inbox

    # ---- the shared-scale quantiser over a list of tensors -------------------------------
    @staticmethod
    def _quantize(own: list[torch.Tensor], scales: np.ndarray, levels: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """One int64 vector of every tensor's values (each tensor chunked on its own) and, per
        tensor, its slice of `scales`."""
        parts, spans, c0 = [], [], 0
        for o in own:
            nch = -(-o.numel() // CHUNK)
            spans.append((c0, c0 + nch))
            parts.append(secmask.quantize(o.numpy(), scales[c0:c0 + nch], chunk=CHUNK, levels=levels))
            c0 += nch
        return np.concatenate(parts), spans

    @staticmethod
    def _dequantize(q: np.ndarray, scales: np.ndarray, spans, like: list[torch.Tensor]) -> list[torch.Tensor]:
        out, pos = [], 0
        for (c0, c1), ref in zip(spans, like):
            vals = secmask.dequantize(q[pos:pos + ref.numel()], scales[c0:c1], chunk=CHUNK)
            out.append(torch.from_numpy(vals).reshape(ref.shape))
            pos += ref.numel()
        return out


def make_secagg(cfg: Any, region: str, transport: Transport, run_dir, *, deadline,
                max_message_bytes: int) -> SecAggRound | None:
    """The region's SecAggRound when security.secure_aggregation is on (None otherwise). Absent
    regions of regions.emulation.availability with `mid_round` leave mid-round instead."""
    sec = cfg.security
    if not sec.secure_aggregation:
        return None
    from .emulation import absent_regions

    emulation, names = cfg.regions.emulation, list(cfg.regions.names)
    mid_round = emulation.active and emulation.availability.mid_round
    return SecAggRound(region=region, regions=names, transport=transport, run_id=f"{cfg.run.name}/{run_dir.name}",
                       threshold=sec.secagg_threshold, bits=sec.secagg_bits, deadline_s=deadline.current,
                       send_timeout_s=cfg.sync.deadline.max_s, error_feedback=cfg.compression.error_feedback,
                       max_message_bytes=max_message_bytes,
                       drop_mid_round=lambda r: mid_round and region in absent_regions(emulation, r, names))
