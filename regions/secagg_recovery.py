"""The phases of secure aggregation in the round that run only when the common round cannot end
at RELAY (regions/secagg_round.py, steps 3 and 4): KEY, a region's self key pushed to a peer once
that peer acknowledged its masked update; REVEAL, the survivors and grid each survivor saw, with
the self key again; RECOVER, the pair seeds of the regions whose masked update was lost. Mixed into
SecAggRound, whose round state (run_id, region, keys, publics, bits) these read."""

from __future__ import annotations

import time
from concurrent.futures import Future

from geofed.p2p import secagg_run as run
from geofed.p2p.secagg import SecAggError
from geofed.p2p.secagg_slot import KEY, RECOVER, REVEAL
from geofed.p2p.transport import TransferStats, TransportError

from .secagg_io import Fallback, SecAggIO


class SecAggRecovery(SecAggIO):
    """KEY, REVEAL and RECOVER of a region's secure-aggregation round."""

    def _send_keys(self, round_: int, survivors: frozenset[str], sends: dict[str, Future], grid: bytes) -> None:
        """KEY: the self key to each survivor once it acknowledged the masked update (a worker
        waits for the ack: no ack, no key)."""
        msg = run.encode_reveal(self.run_id, round_, self.region, self_key=self.keys.self_key(round_), survivors=(),
                                grid=grid)
        for p in sorted(survivors - {self.region}):
            self.pending.append((round_, p, KEY, self._pool.submit(self._key_after_ack, sends[p], p, round_, msg)))

    def _key_exchange(self, round_: int, survivors: frozenset[str], self_keys: dict[str, bytes], grid: bytes, m) -> dict[str, bytes]:
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
                run_id, r, region, their_key, _, their_grid = run.decode_reveal(raw)
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

    def _unmask(self, round_: int, members, survivors: frozenset[str], masked, ackers: set[str], grid: bytes,
                self_keys: dict[str, bytes], m):
        """Step 4 (a region or a self key is missing): the exact integer sum of the survivors' updates."""
        t = time.monotonic()
        others = sorted(survivors - {self.region})
        dropped = sorted(set(members) - survivors)
        self.side.expect(round_, REVEAL, others)
        if dropped:
            self.side.expect(round_, RECOVER, others)
        reveals = {p: run.encode_reveal(self.run_id, round_, self.region, survivors=survivors, grid=grid,
                                        self_key=self.keys.self_key(round_) if p in ackers else b"")
                   for p in others}
        inbox, _ = self._round_trip(round_, REVEAL, reveals, m)
        self_keys = dict(self_keys)
        answers = {}
        for sender, raw in sorted(inbox.received.items()):
            try:
                run_id, r, region, key, theirs, their_grid = run.decode_reveal(raw)
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
                answers[sender] = run.encode_recover(self.run_id, round_, self.region, {
                    d: self.keys.pair_seed(d, self.publics[d], round_) for d in lost if d not in survivors})
        if set(self_keys) != survivors:
            raise Fallback(f"no self key from {sorted(survivors - set(self_keys))}")
        seeds = {(self.region, d): self.keys.pair_seed(d, self.publics[d], round_) for d in dropped}
        if answers or dropped:
            inbox, _ = self._round_trip(round_, RECOVER, answers, m, receive=bool(dropped))
            for sender, raw in sorted((inbox.received if inbox is not None else {}).items()):
                try:
                    run_id, r, region, theirs = run.decode_recover(raw)
                    if (run_id, r, region) != (self.run_id, round_, sender):
                        raise SecAggError("wrong_round", f"a recovery answer of {region!r} pushed by {sender!r}")
                except SecAggError as exc:
                    self.refused[exc.reason] += 1
                    continue
                seeds.update({(sender, d): seed for d, seed in theirs.items() if d in dropped})
        m["secagg_phase_s"]["reveal"] = round(time.monotonic() - t, 6)  # with the recovery answers
        missing = [(s, d) for s in survivors for d in dropped if (s, d) not in seeds]
        if missing:
            raise Fallback(f"no pair seeds for {sorted(missing)}")
        return run.unmask_total(masked, self_keys=self_keys, dropped_seeds=seeds, bits=self.bits)
