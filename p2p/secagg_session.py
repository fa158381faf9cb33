"""One region's secure-aggregation round as a state machine over bytes: what to send each peer
at each phase, and a handler for what arrives (usable as a transport validator: a refusal is a
SecAggError, a ValueError). The integration into DiLoCo's exchange is plumbing around this
(docs/privacy.md, "Integration").

Phases: advert + bundle (before the update exists), masked update, reveal, then the sum.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from . import secagg_wire as wire
from .secagg import (
    KeyAdvert, KeyBook, RoundContext, RoundSecrets, SecAggError, ShareHolder, mask_update, recover_secret, unmask_sum,
    verify_advert,
)
from .shamir import Share


class SecAggSession:
    """Region `me`'s side of round `ctx.round`. `book` outlives the round (replay refusal);
    `tls_key_pem`/`cert_pem`/`ca_pem` sign and check adverts (all None: a plaintext test run)."""

    def __init__(self, ctx: RoundContext, me: str, *, book: KeyBook, numel: int, tls_key_pem: bytes | None = None,
                 cert_pem: bytes | None = None, ca_pem: bytes | None = None):
        if (tls_key_pem is None) != (ca_pem is None) or (cert_pem is None) != (ca_pem is None):
            raise ValueError("tls_key_pem, cert_pem, ca_pem: give all three (TLS runs) or none")
        self.ctx, self.me, self.book, self.numel = ctx, me, book, numel
        self.cert_pem, self.ca_pem = cert_pem, ca_pem
        self.secrets = RoundSecrets.generate(ctx, me, tls_key_pem=tls_key_pem)
        self.adverts: dict[str, KeyAdvert] = {me: self.secrets.advert}
        self._early_bundles: dict[str, bytes] = {}
        self.holder: ShareHolder | None = None
        self.masked: dict[str, np.ndarray] = {}
        self.survivors: frozenset[str] | None = None
        self.reveals: dict[str, dict[tuple[str, str], Share]] = {}

    @property
    def peers(self) -> list[str]:
        return [r for r in self.ctx.regions if r != self.me]

    # ---- phase 1: keys and shares ------------------------------------------------------
    def advert_bytes(self) -> bytes:
        return wire.encode_advert(self.secrets.advert, self.cert_pem or b"")

    def bundle_bytes(self, peer: str) -> bytes:
        return wire.encode_bundle(self.secrets.bundles[peer])

    def on_advert(self, sender: str, payload: bytes | memoryview) -> KeyAdvert:
        advert, cert = wire.decode_advert(payload)
        if advert.region != sender or sender == self.me:
            raise SecAggError("unknown_region", f"an advert for {advert.region!r} pushed by {sender!r}")
        if sender in self.adverts:
            if self.adverts[sender] == advert:
                return advert  # a retried push
            raise SecAggError("replayed_key", f"{sender} sent a second, different advert for round {self.ctx.round}")
        if self.ca_pem is not None:
            verify_advert(advert, self.ctx, book=self.book, cert_pem=cert, ca_pem=self.ca_pem)
        else:
            verify_advert(advert, self.ctx, book=self.book)
        self.adverts[sender] = advert
        if len(self.adverts) == len(self.ctx.regions):
            self._start_holding()
        return advert

    def _start_holding(self) -> None:
        self.holder = ShareHolder(self.ctx, self.me, self.adverts)
        self.holder.receive(self.secrets.bundles[self.me])
        for sender, payload in sorted(self._early_bundles.items()):
            self.on_bundle(sender, payload)
        self._early_bundles.clear()

    def on_bundle(self, sender: str, payload: bytes | memoryview) -> None:
        """A peer's shares; checked once every advert is in (kept until then: pushes race)."""
        bundle = wire.decode_bundle(payload)
        self.ctx.index(sender)  # a region of the run: at most one held bundle per region
        if bundle.dealer != sender or bundle.holder != self.me:
            raise SecAggError("unknown_region", f"shares of {bundle.dealer!r} for {bundle.holder!r} pushed by {sender!r}")
        if self.holder is None:
            self._early_bundles[sender] = bytes(payload)
            return
        self.holder.receive(bundle)

    # ---- phase 2: the masked update ----------------------------------------------------
    def masked_bytes(self, values: np.ndarray) -> bytes:
        """This region's integer update, masked (needs every peer's advert)."""
        missing = sorted(set(self.ctx.regions) - set(self.adverts))
        if missing:
            raise SecAggError("too_few_shares", f"no key advert from {missing}: cannot mask for them")
        if np.size(values) != self.numel:
            raise ValueError(f"values: {np.size(values)} elements, the session is for {self.numel}")
        y = mask_update(self.secrets, self.adverts, values)
        self.masked[self.me] = y
        return wire.encode_masked(y)

    def on_masked(self, sender: str, payload: bytes | memoryview) -> np.ndarray:
        if sender not in self.adverts or sender == self.me:
            raise SecAggError("unknown_region", f"a masked update from {sender!r}, who advertised no key")
        if self.survivors is not None:
            raise SecAggError("wrong_round", f"{sender}'s masked update came after the survivors were fixed")
        y = wire.decode_masked(payload, numel=self.numel, bits=self.ctx.bits)
        self.masked[sender] = y
        return y

    # ---- phase 3: reveal and sum -------------------------------------------------------
    def reveal_bytes(self, survivors: Iterable[str]) -> bytes:
        """Fix the survivors (this region among them) and reveal this region's shares for them."""
        survivors = frozenset(survivors) | {self.me}
        if self.holder is None:
            raise SecAggError("too_few_shares", "the round's shares never all arrived")
        self.survivors = survivors
        dropped = set(self.ctx.regions) - survivors
        revealed = self.holder.reveal(survivors=set(survivors), dropped=dropped)
        self.reveals[self.me] = revealed
        return wire.encode_reveal(self.ctx.run_id, self.ctx.round, self.me, revealed)

    def on_reveal(self, sender: str, payload: bytes | memoryview) -> None:
        run_id, round, holder, revealed = wire.decode_reveal(payload)
        if (run_id, round) != (self.ctx.run_id, self.ctx.round) or holder != sender:
            raise SecAggError("wrong_round", f"a reveal of {holder!r} for round {round} pushed by {sender!r}")
        self.reveals[sender] = revealed

    def total(self) -> np.ndarray:
        """The exact int64 sum of the survivors' updates (this region's included)."""
        if self.survivors is None:
            raise ValueError("reveal_bytes: fix the survivors first")
        survivors, dropped = self.survivors, set(self.ctx.regions) - self.survivors
        secrets: dict[str, bytes] = {}
        for kind, dealers in (("seed", survivors), ("key", dropped)):
            for dealer in dealers:
                shares = {h: rv[(dealer, kind)] for h, rv in self.reveals.items() if (dealer, kind) in rv}
                secrets[dealer] = recover_secret(self.ctx, self.adverts[dealer], kind, shares)
        masked = {s: self.masked[s] for s in survivors if s in self.masked}
        if set(masked) != survivors:
            raise SecAggError("reveal_conflict", f"survivors {sorted(survivors - set(masked))} sent no masked update")
        return unmask_sum(self.ctx, masked, self.adverts, self_seeds={s: secrets[s] for s in survivors},
                          dropped_keys={d: secrets[d] for d in dropped})
