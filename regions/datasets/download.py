"""Download one file: timeouts, a total deadline, retries with backoff, resume, env proxies, a size
cap, atomic rename, SHA-256.

The bytes go to ``<dest>.part`` and are renamed onto ``<dest>`` only once their digest matches
the registry's, so a file in the cache is always a verified one. The ``.part`` is created anew
for each fetch (``O_CREAT|O_EXCL|O_NOFOLLOW``, after removing whatever was at that path, a
link itself and never what it points at) and written only through that descriptor, so a link
planted there is never written through; it is deleted whenever the fetch fails. Within one
fetch, a connection that breaks is resumed with an HTTP Range request where the server honours
it (206); a server that answers 200 instead sends the whole file again.

A server cannot make a fetch write more than the file's pinned size (the first byte past it
fails the fetch) nor last longer than the total deadline: reads return as soon as any bytes
arrive, so a server dripping a byte a second is cut off at the deadline, not at a per-read
timeout it never trips. Proxies come from the environment (``http_proxy``, ``https_proxy``,
``no_proxy``) through urllib's default ProxyHandler.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import socket
import stat
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from geofed.regions.inputfiles import InputFileError, open_regular

from .registry import RemoteFile

ENV_MIRROR = "GEOFED_DATA_MIRROR"
CHUNK = 1 << 16
USER_AGENT = "geofed-data/1"


class FetchError(RuntimeError):
    """A file could not be fetched (network, HTTP status, mirror without the file, size, deadline)."""


class ChecksumError(FetchError):
    """A fetched file's SHA-256 is not the pinned one; the file has been deleted."""


@dataclass(frozen=True, kw_only=True)
class FetchOptions:
    """How to fetch: from where (mirror), how patiently, and what to report progress to."""

    mirror: str | None = None  # a folder or a base URL; None: $GEOFED_DATA_MIRROR, else the canonical URL
    timeout_s: float = 30.0  # per connect and per read
    deadline_s: float = 600.0  # in all, for one dataset's files (all tries and pauses); a fetch_file alone: that file
    retries: int = 4  # tries after the first, on network errors
    backoff_s: float = 1.0  # first pause; doubles each retry
    # progress(file name, bytes so far, total or None); called as bytes arrive
    progress: Callable[[str, int, int | None], None] | None = None

    def __post_init__(self):
        for key in ("timeout_s", "deadline_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key}: must be > 0, got {getattr(self, key)}")
        if self.retries < 0:
            raise ValueError(f"retries: must be >= 0, got {self.retries}")


class Deadline:
    """The monotonic instant a whole fetch must end by."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        return self.at - time.monotonic()

    def expire(self) -> None:
        self.at = time.monotonic()

    def check(self, name: str, url: str, got: int | None = None, size: int | None = None) -> None:
        if self.left() <= 0:
            progress = f"; got {got} of {size} bytes" if got is not None else ""
            raise FetchError(f"{name}: {url}: not done within the deadline of {self.seconds:g} s (--deadline){progress}")


def sha256_of(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    with open(path, "rb") as f:
        return _sha256_stream(f)


def _sha256_stream(f: BinaryIO) -> str:
    h = hashlib.sha256()
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
    return h.hexdigest()


def mirror_of(opts: FetchOptions) -> str | None:
    """The mirror in effect: the option, else $GEOFED_DATA_MIRROR, else None."""
    return opts.mirror or os.environ.get(ENV_MIRROR) or None


def fetch_file(remote: RemoteFile, dest: Path, opts: FetchOptions, *, deadline: Deadline | None = None) -> Path:
    """Fetch `remote` to `dest` (verified) unless a verified copy is already there; returns `dest`.
    `deadline` is shared by the files of one dataset (default: opts.deadline_s for this file)."""
    if dest.is_file() and sha256_of(dest) == remote.sha256:
        return dest
    deadline = deadline or Deadline(opts.deadline_s)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    out = _create_part(part)
    mine = os.fstat(out.fileno())
    try:
        with out:
            mirror = mirror_of(opts)
            if mirror and "://" not in mirror:
                source = _copy_from_dir(remote, Path(mirror).expanduser(), out, opts)
            else:
                urls = _mirror_urls(remote, mirror) if mirror else [remote.url]
                source = _download_first(remote, urls, out, opts, deadline)
            out.seek(0)
            got = _sha256_stream(out)
            if got != remote.sha256:
                raise ChecksumError(f"{remote.name}: SHA-256 mismatch (from {source}): expected {remote.sha256}, "
                                    f"got {got}; the file was deleted")
        if not _is_ours(part, mine):  # swapped since (or a second fetch of the same file took over)
            raise FetchError(f"{remote.name}: {part} was replaced while it was being written; nothing was kept")
        os.replace(part, dest)
    except BaseException:
        if _is_ours(part, mine):  # unlinks the path itself; another fetch's part is left to it
            part.unlink(missing_ok=True)
        raise
    return dest


def _is_ours(part: Path, mine: os.stat_result) -> bool:
    try:
        here = os.lstat(part)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)


def _create_part(part: Path) -> BinaryIO:
    """A new, empty `part` opened for writing and reading: whatever was at that path before (a stale
    part, a planted symlink) is unlinked first, and the open neither follows a link nor reuses a
    file that appears in between."""
    try:
        st = os.lstat(part)
    except FileNotFoundError:
        pass
    else:
        if stat.S_ISDIR(st.st_mode):
            raise FetchError(f"{part}: a directory is in the way of the download; remove it")
        part.unlink()
    try:
        fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        raise FetchError(f"{part}: something was created at this path while the download started; "
                         "refusing to write through it") from None
    return os.fdopen(fd, "w+b")


def _mirror_urls(remote: RemoteFile, base: str) -> list[str]:
    base = base.rstrip("/")
    return [f"{base}/{remote.mirror_path}", f"{base}/{remote.name}"]


def _copy_from_dir(remote: RemoteFile, root: Path, out: BinaryIO, opts: FetchOptions) -> str:
    for candidate in (root / remote.mirror_path, root / remote.name):
        if candidate.is_file():
            try:
                with open_regular(candidate, max_bytes=remote.size) as src:
                    data = src.read(remote.size + 1)
            except InputFileError as exc:
                why = (f"is {exc.size} bytes; the pinned size is {remote.size}" if exc.size is not None
                       else exc.reason)
                raise FetchError(f"{remote.name}: {candidate} {why}") from None
            if len(data) > remote.size:  # it grew after the check
                raise FetchError(f"{remote.name}: {candidate} holds more than the pinned {remote.size} bytes")
            out.write(data)
            if opts.progress:
                opts.progress(remote.name, len(data), len(data))
            return str(candidate)
    raise FetchError(f"{remote.name}: not in the mirror folder {root} (looked for {remote.mirror_path} "
                     f"and {remote.name})")


def _download_first(remote: RemoteFile, urls: list[str], out: BinaryIO, opts: FetchOptions,
                    deadline: Deadline) -> str:
    """Try each URL in turn; a 404 moves on to the next, other failures are retried on the same URL."""
    for i, url in enumerate(urls):
        try:
            _download(url, out, remote, opts, deadline)
            return url
        except urllib.error.HTTPError as exc:
            if exc.code == 404 and i + 1 < len(urls):
                continue
            raise FetchError(f"{remote.name}: {url}: HTTP {exc.code} {exc.reason}") from None
    raise AssertionError("no URL to fetch")


def _download(url: str, out: BinaryIO, remote: RemoteFile, opts: FetchOptions, deadline: Deadline) -> None:
    """GET `url` into `out`, resuming and retrying on network errors (HTTPError is raised at once)."""
    opener = urllib.request.build_opener()  # includes ProxyHandler(): the environment's proxies
    last: Exception | None = None
    for attempt in range(opts.retries + 1):
        if attempt:
            pause = opts.backoff_s * 2 ** (attempt - 1)
            if pause >= deadline.left():  # the pause alone would pass the deadline: end now
                deadline.expire()
            else:
                time.sleep(pause)
        deadline.check(remote.name, url, out.tell(), remote.size)
        try:
            _get_once(opener, url, out, remote, opts, deadline)
            return
        except urllib.error.HTTPError:
            raise
        except (urllib.error.URLError, OSError, http.client.HTTPException, socket.timeout) as exc:
            last = exc
    deadline.check(remote.name, url, out.tell(), remote.size)
    reason = getattr(last, "reason", None) or last
    raise FetchError(f"{remote.name}: cannot download {url}: {reason} (tried {opts.retries + 1} times; no network? "
                     f"use --mirror DIR|URL or ${ENV_MIRROR})")


def _get_once(opener: urllib.request.OpenerDirector, url: str, out: BinaryIO, remote: RemoteFile,
              opts: FetchOptions, deadline: Deadline) -> None:
    name, size = remote.name, remote.size
    have = out.seek(0, os.SEEK_END)
    req = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    if have:
        req.add_header("Range", f"bytes={have}-")
    try:
        # the socket's per-read timeout never runs past the deadline either
        resp = opener.open(req, timeout=max(0.01, min(opts.timeout_s, deadline.left())))
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:  # the part is already whole: the checksum decides
            return
        raise
    with resp:
        resumed = have and resp.status == 206 and _range_start(resp.headers.get("Content-Range")) == have
        if not resumed:
            have = 0
            out.seek(0)
            out.truncate()
        length = resp.headers.get("Content-Length")
        total = have + int(length) if length and length.isdigit() else None
        if total is not None and total > size:
            raise FetchError(f"{name}: {url} announces {total} bytes, more than the pinned {size} bytes; "
                             "nothing was kept")
        got = have
        while True:
            # read1: whatever has arrived (up to CHUNK), so a dripping body returns to the deadline check
            block = resp.read1(CHUNK)
            if not block:
                break
            if got + len(block) > size:
                raise FetchError(f"{name}: {url} sent more than the pinned {size} bytes; nothing was kept")
            out.write(block)
            got += len(block)
            if opts.progress:
                opts.progress(name, got, total or size)
            deadline.check(name, url, got, size)
        if total is not None and got < total:
            # the connection closed early: keep the part, the next try resumes from it
            raise http.client.IncompleteRead(b"", total - got)


def _range_start(content_range: str | None) -> int | None:
    """The first byte of 'bytes START-END/TOTAL', or None."""
    if not content_range or not content_range.startswith("bytes "):
        return None
    start = content_range[6:].split("-", 1)[0]
    return int(start) if start.isdigit() else None
