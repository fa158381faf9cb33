"""Atomic, checksummed checkpoints: temp file, fsync, rename; a torn or corrupt file is detected.

File layout: ``GFCK`` magic, 32-byte SHA-256 of the body, then the body (``torch.save`` of a
state of tensors and plain values, loaded back with ``weights_only=True`` so a checkpoint can
never run code).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

MAGIC = b"GFCK"
_NAME = re.compile(r"^ckpt-(\d+)\.pt$")
log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint file that cannot be trusted (truncated, corrupt, wrong format)."""


def save_atomic(path: Path, state: Any) -> None:
    buf = io.BytesIO()
    torch.save(state, buf)
    body = buf.getvalue()
    write_bytes_atomic(path, MAGIC + hashlib.sha256(body).digest() + body)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    # The rename is durable only once the directory entry is on disk too.
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_verified(path: Path) -> Any:
    data = Path(path).read_bytes()
    if len(data) < 36 or data[:4] != MAGIC:
        raise CheckpointError(f"{path}: not a geofed checkpoint (too short or bad magic)")
    digest, body = data[4:36], data[36:]
    if hashlib.sha256(body).digest() != digest:
        raise CheckpointError(f"{path}: checksum mismatch (truncated or corrupt)")
    try:
        return torch.load(io.BytesIO(body), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means an unusable file
        raise CheckpointError(f"{path}: cannot load: {exc}") from None


def checkpoint_path(directory: Path, round_: int) -> Path:
    return Path(directory) / f"ckpt-{round_:08d}.pt"


def list_rounds(directory: Path) -> list[int]:
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for p in directory.iterdir() if (m := _NAME.match(p.name)))


def load_latest(directory: Path, *, at_most: int | None = None) -> tuple[int, Any] | None:
    """Newest checkpoint that verifies (round <= at_most); corrupt ones are reported and skipped."""
    for r in reversed(list_rounds(directory)):
        if at_most is not None and r > at_most:
            continue
        try:
            return r, load_verified(checkpoint_path(directory, r))
        except CheckpointError as exc:
            log.warning("skipping checkpoint: %s", exc)
    return None


def prune(directory: Path, keep: int) -> None:
    for r in list_rounds(directory)[:-keep]:
        checkpoint_path(directory, r).unlink(missing_ok=True)
