"""Atomic, checksummed checkpoints: temp file, fsync, rename; a torn or corrupt file is detected.

File layout: ``GFCK`` magic, 32-byte SHA-256 of the body, then the body (``torch.save`` of a
state of tensors and plain values, loaded back with ``weights_only=True`` so a checkpoint can
never run code).

Files are written 0600 in folders created 0700 (checkpoints hold the model and its optimizer state).

A process killed while writing leaves at most a ``.ckpt-*.tmp-<pid>`` file (never a torn
``ckpt-*.pt``: the rename is the commit); ``prune`` removes such leftovers. A file that is torn
or corrupt anyway (disk error, a copy gone wrong) fails the checksum: ``load_latest`` reports it
and falls back to the previous checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from .inputfiles import InputFileError, open_regular

MAGIC = b"GFCK"
_NAME = re.compile(r"^ckpt-(\d+)\.pt$")
_TMP = re.compile(r"^\.ckpt-\d+\.pt\.tmp-\d+$")
PRIVATE_FILE, PRIVATE_DIR = 0o600, 0o700  # what a run writes is its owner's alone (docs/RUNDIR.md)
_GLOBAL = re.compile(r"GLOBAL ([A-Za-z_][\w.]*)")
# A checkpoint holds a model and its optimizer state; past this it is not one a geofed run wrote
# on these machines, and reading it whole would take the host's memory (load_verified's cap).
MAX_CHECKPOINT_BYTES = 64 << 30
log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint file that cannot be trusted (truncated, corrupt, wrong format)."""


def save_atomic(path: Path, state: Any) -> None:
    """Write `state` as a checksummed checkpoint at `path`: whole or absent, readable by its owner only.

    torch.save streams into the temp file through a hashing writer, and the digest goes into the
    place kept for it last: no copy of the body in memory. Through a BytesIO a checkpoint cost
    three (the buffer as it grew, getvalue, the header's concatenation): 24 B/param of state made
    a 72 B/param peak, what OOM-killed an 85M region in save_checkpoint (issue 39)."""
    import torch  # here, not at the top: the driver's run-directory readers need none of it

    def fill(f: BinaryIO) -> None:
        f.write(MAGIC + bytes(32))
        hashing = _HashingWriter(f)
        torch.save(state, hashing)
        f.seek(len(MAGIC))
        f.write(hashing.sha.digest())

    _write_atomic(path, fill)


class _HashingWriter:
    """A write-only file for torch.save: passes every byte on to `f` and into a SHA-256."""

    def __init__(self, f: BinaryIO):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data: Any) -> int:
        self.sha.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Temp file (0600), fsync, rename, directory fsync: the file is whole or absent, and private
    (a run's files hold models and the addresses of its regions)."""
    _write_atomic(path, lambda f: f.write(data))


def _write_atomic(path: Path, fill: Callable[[BinaryIO], Any]) -> None:
    """`fill(f)` writes the file's bytes into a private temp file, then fsync, rename, directory fsync."""
    path = Path(path)
    make_private_dirs(path.parent)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, PRIVATE_FILE)
        with open(fd, "wb") as f:
            os.fchmod(fd, PRIVATE_FILE)  # a leftover temp file of a reused pid keeps its old mode
            fill(f)
            f.flush()
            os.fsync(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    # The rename is durable only once the directory entry is on disk too.
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_private_dirs(path: Path) -> None:
    """mkdir -p where every folder created is 0700 (Path.mkdir gives parents the umask's mode).
    Folders that exist keep their mode: they may be the operator's."""
    path = Path(path)
    missing = []
    while not path.exists():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, PRIVATE_DIR)
        except FileExistsError:
            pass  # made meanwhile (another region of this run on this node)


def read_bounded(path: Path, *, max_bytes: int) -> bytes:
    """The bytes of a regular file of at most `max_bytes` (inputfiles.open_regular: a FIFO, a device
    or a link to one is refused before it is opened), read in pieces: a file that reports a size
    it does not hold (``/proc``) or grows is cut off past the cap instead of filling memory, and
    nothing is allocated up front for a cap far above the file's size."""
    with open_regular(path, max_bytes=max_bytes) as f:
        size = os.fstat(f.fileno()).st_size
        chunks, total = [], 0
        while True:
            # Its size first (one read for the usual file), then what a lying file adds, 8 MiB at a time.
            want = size + 1 - total if total <= size else 8 << 20
            chunk = f.read(min(want, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise InputFileError(path, f"holds more than {max_bytes} bytes; the limit is {max_bytes}", size=total)
    return b"".join(chunks)


def checkpoint_cap() -> int:
    """The largest checkpoint this host can load: half its memory (the file's bytes and the tensors
    loaded from them are both held at once), at most MAX_CHECKPOINT_BYTES."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return MAX_CHECKPOINT_BYTES
    return min(MAX_CHECKPOINT_BYTES, memory // 2)


def load_verified(path: Path, *, max_bytes: int | None = None) -> Any:
    """Load a checkpoint after checking its magic and checksum; CheckpointError for any file that
    fails, and for one that is not a regular file (a FIFO would block, ``/dev/zero`` never ends: a
    run directory can be someone else's) or is larger than `max_bytes` (default checkpoint_cap())."""
    try:
        data = read_bounded(Path(path), max_bytes=checkpoint_cap() if max_bytes is None else max_bytes)
    except InputFileError as exc:
        raise CheckpointError(f"{path}: {exc.reason}") from None
    except MemoryError:
        raise CheckpointError(f"{path}: too large to read into this host's memory") from None
    if len(data) < 36 or data[:4] != MAGIC:
        raise CheckpointError(f"{path}: not a geofed checkpoint (too short or bad magic)")
    digest, body = data[4:36], data[36:]
    if hashlib.sha256(body).digest() != digest:
        raise CheckpointError(f"{path}: checksum mismatch (truncated or corrupt)")
    return load_tensors(body, what=str(path))


def load_tensors(body: bytes, *, what: str) -> Any:
    """``torch.load(weights_only=True)`` of `body` (a checkpoint's, or a peer's FetchState
    state), with our own message on failure: torch's names the way to load the file anyway
    ("re-run torch.load with weights_only set to False"), which for a hostile file is the one
    thing never to do."""
    import torch

    try:
        # Host memory first: a checkpoint written on a GPU loads on a node without one; the
        # loader copies each tensor into the model where it lives (regions.device).
        return torch.load(io.BytesIO(body), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        found = _GLOBAL.search(str(exc))
        thing = f"a Python object ({found.group(1)})" if found else "a Python object"
        raise CheckpointError(f"{what}: refused: it holds {thing} that loading would construct, i.e. run code; "
                              "geofed loads only tensors and plain values, and what geofed writes never holds "
                              "one: this was made or altered by someone else") from None
    except Exception as exc:  # noqa: BLE001 - any other failure means an unusable file
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip() and "weights_only" not in ln]
        detail = f": {lines[0][:200]}" if lines else ""
        raise CheckpointError(f"{what}: cannot load ({type(exc).__name__}{detail})") from None


def checkpoint_path(directory: Path, round_: int) -> Path:
    """The file of round `round_`'s checkpoint in `directory` (zero-padded: names sort by round)."""
    return Path(directory) / f"ckpt-{round_:08d}.pt"


def list_rounds(directory: Path) -> list[int]:
    """Rounds that have a checkpoint file in `directory`, ascending (files not verified; [] without the folder)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for p in directory.iterdir() if (m := _NAME.match(p.name)))


def load_latest(directory: Path, *, at_most: int | None = None,
                on_skip: Callable[[Path, str], None] | None = None) -> tuple[int, Any] | None:
    """Newest checkpoint that verifies (round <= at_most), or None.

    Each newer file that fails verification is logged and passed to ``on_skip(path, why)`` (the
    runner writes it to events.jsonl), then the previous one is tried.
    """
    for r in reversed(list_rounds(directory)):
        if at_most is not None and r > at_most:
            continue
        path = checkpoint_path(directory, r)
        try:
            return r, load_verified(path)
        except CheckpointError as exc:
            log.warning("skipping checkpoint: %s", exc)
            if on_skip is not None:
                on_skip(path, str(exc))
    return None


def prune(directory: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints; remove temp files a killed writer left behind."""
    if keep < 1:
        raise ValueError(f"keep: must be >= 1, got {keep}")
    directory = Path(directory)
    for r in list_rounds(directory)[:-keep]:
        checkpoint_path(directory, r).unlink(missing_ok=True)
    if directory.is_dir():
        mine = f".tmp-{os.getpid()}"
        for p in directory.iterdir():
            if _TMP.match(p.name) and not p.name.endswith(mine):
                p.unlink(missing_ok=True)
