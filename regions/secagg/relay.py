"""The relay fast path of secure aggregation's round (docs/privacy.md, "Secure aggregation in the
round"): a region's round self key b_A, split into XOR shares that only its masked update carries.

* A splits b_A into one 32-byte share per peer of the round (XOR of all of them is b_A; any fewer
  are uniform and say nothing of it) and puts peer j's share, with an 8-byte check of b_A, into
  the MASKED message that carries y_A to j (over mTLS: only j reads it).
* j, once it counts y_A among its round's masked updates (it arrived by j's deadline, on j's
  grid), relays its share to the other peers in one small RELAY message per peer, bound by a tag
  to (run, round, relayer, recipient).
* k rebuilds b_A from its own share (it came with y_A) and every other peer's relayed share, and
  checks it against the check that came with y_A.

So b_A can be rebuilt only when every peer of A counted y_A: a peer that lost y_A never has its
share and relays none. The rule that keeps dropouts safe follows: a region reveals its pair seed
with A only when it lost y_A, and then nobody can rebuild b_A from relays.
"""

from __future__ import annotations

import hashlib
import secrets as _secrets
from collections.abc import Mapping, Sequence

from . import SecAggError

SHARE = 32  # a self key's bytes (masks.self_seed_key), and so a share's
CHECK = 8   # bytes of the self key's check (a wrong share is found, not summed)
TAG = 16    # bytes of a relay's binding


def split(key: bytes, peers: Sequence[str]) -> dict[str, bytes]:
    """`key` as one XOR share per peer (sorted): all of them XOR to `key`, fewer are uniform."""
    peers = sorted(peers)
    shares = {p: _secrets.token_bytes(len(key)) for p in peers[:-1]}
    last = key
    for s in shares.values():
        last = _xor(last, s)
    shares[peers[-1]] = last
    return shares


def combine(shares: Sequence[bytes]) -> bytes:
    """The key whose shares these are (all of them: XOR)."""
    out = bytes(SHARE)
    for s in shares:
        out = _xor(out, s)
    return out


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b, strict=True))


def check(run_id: str, round: int, owner: str, key: bytes) -> bytes:
    """What a masked update carries to check the self key rebuilt from shares (bound to the owner
    and the round; the key is 256 pseudo-random bits, so its hash hides it)."""
    data = b"|".join([b"geofed-secagg-selfkey-v1", run_id.encode(), str(round).encode(), owner.encode(), key])
    return hashlib.sha256(data).digest()[:CHECK]


def tag(run_id: str, round: int, relayer: str, recipient: str) -> bytes:
    """A relay message's binding: the receiver recomputes it from its own run, round, the pushing
    identity and itself, so a relay of another run, round or link is refused."""
    data = b"|".join([b"geofed-secagg-relay-v1", run_id.encode(), str(round).encode(), relayer.encode(),
                      recipient.encode()])
    return hashlib.sha256(data).digest()[:TAG]


def encode_relay(binding: bytes, counted: bool, shares: Mapping[str, bytes], regions: Sequence[str]) -> bytes:
    """The binding tag, whether the relayer counted the recipient's own masked update (1 byte: its
    owner then needs no KEY), then (owner's index in the sorted regions: 1 byte, share) per owner."""
    index = {r: i for i, r in enumerate(sorted(regions))}
    return binding + bytes([counted]) + b"".join(bytes([index[o]]) + s for o, s in sorted(shares.items()))


def decode_relay(data: bytes, *, binding: bytes, regions: Sequence[str], relayer: str,
                 me: str) -> tuple[bool, dict[str, bytes]]:
    """(counted, {owner: share}) of a relay that `relayer` pushed to `me`; SecAggError on a wrong
    binding ("wrong_round": another run, round or link, a replay), a wrong size or flag, an owner
    that is not a third region or that appears twice ("malformed")."""
    data = bytes(data)
    if len(data) < TAG + 1 or data[:TAG] != binding:
        raise SecAggError("wrong_round", f"a relay pushed by {relayer!r} is bound to another run, round or link")
    flag, body = data[TAG], data[TAG + 1:]
    if flag > 1 or len(body) % (1 + SHARE):
        raise SecAggError("malformed", f"a relay of {len(data)} bytes is not a flag and whole shares")
    regions = sorted(regions)
    out: dict[str, bytes] = {}
    for pos in range(0, len(body), 1 + SHARE):
        i = body[pos]
        owner = regions[i] if i < len(regions) else None
        if owner is None or owner in (relayer, me) or owner in out:
            raise SecAggError("malformed", f"a relay by {relayer!r} names owner index {i} (not a third region, or twice)")
        out[owner] = body[pos + 1:pos + 1 + SHARE]
    return bool(flag), out


def rebuild(run_id: str, round: int, me: str, members: Sequence[str], shares: Mapping[str, tuple[bytes, bytes]],
            relayed: Mapping[str, Mapping[str, bytes]]) -> tuple[dict[str, bytes], int]:
    """({owner: self key}, how many rebuilt keys failed their check) for every owner of `shares`
    (owner -> this region's share and the key's check, from its masked update) whose every other
    member's share is in `relayed` (relayer -> {owner: share})."""
    keys, forged = {}, 0
    for owner, (mine, want) in sorted(shares.items()):
        theirs = [relayed.get(j, {}).get(owner) for j in members if j not in (owner, me)]
        if None in theirs:
            continue  # a member lost owner's masked update (or its relay is not in): KEY decides
        key = combine([mine, *(p for p in theirs if p is not None)])
        if check(run_id, round, owner, key) != want:
            forged += 1
            continue
        keys[owner] = key
    return keys, forged
