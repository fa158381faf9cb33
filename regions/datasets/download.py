"""Download one file: timeouts, retries with backoff, resume, env proxies, atomic rename, SHA-256.

The bytes go to ``<dest>.part`` and are renamed onto ``<dest>`` only once their digest matches
the registry's, so a file in the cache is always a verified one. A ``.part`` left by an
interrupted fetch is resumed with an HTTP Range request where the server honours it (206);
a server that answers 200 instead sends the whole file again. Proxies come from the environment
(``http_proxy``, ``https_proxy``, ``no_proxy``) through urllib's default ProxyHandler.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .registry import RemoteFile

ENV_MIRROR = "GEOFED_DATA_MIRROR"
CHUNK = 1 << 16
USER_AGENT = "geofed-data/1"


class FetchError(RuntimeError):
    """A file could not be fetched (network, HTTP status, mirror without the file)."""


class ChecksumError(FetchError):
    """A fetched file's SHA-256 is not the pinned one; the file has been deleted."""


@dataclass(frozen=True, kw_only=True)
class FetchOptions:
    """How to fetch: from where (mirror), how patiently, and what to report progress to."""

    mirror: str | None = None  # a folder or a base URL; None: $GEOFED_DATA_MIRROR, else the canonical URL
    timeout_s: float = 30.0  # per connect and per read
    retries: int = 4  # tries after the first, on network errors
    backoff_s: float = 1.0  # first pause; doubles each retry
    # progress(file name, bytes so far, total or None); called as bytes arrive
    progress: Callable[[str, int, int | None], None] | None = None


def sha256_of(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def mirror_of(opts: FetchOptions) -> str | None:
    """The mirror in effect: the option, else $GEOFED_DATA_MIRROR, else None."""
    return opts.mirror or os.environ.get(ENV_MIRROR) or None


def fetch_file(remote: RemoteFile, dest: Path, opts: FetchOptions) -> Path:
    """Fetch `remote` to `dest` (verified) unless a verified copy is already there; returns `dest`."""
    if dest.is_file() and sha256_of(dest) == remote.sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    mirror = mirror_of(opts)
    if mirror and "://" not in mirror:
        source = _copy_from_dir(remote, Path(mirror).expanduser(), part, opts)
    else:
        urls = _mirror_urls(remote, mirror) if mirror else [remote.url]
        source = _download_first(remote, urls, part, opts)
    got = sha256_of(part)
    if got != remote.sha256:
        part.unlink(missing_ok=True)
        raise ChecksumError(f"{remote.name}: SHA-256 mismatch (from {source}): expected {remote.sha256}, got {got}; "
                            "the file was deleted")
    os.replace(part, dest)
    return dest


def _mirror_urls(remote: RemoteFile, base: str) -> list[str]:
    base = base.rstrip("/")
    return [f"{base}/{remote.mirror_path}", f"{base}/{remote.name}"]


def _copy_from_dir(remote: RemoteFile, root: Path, part: Path, opts: FetchOptions) -> str:
    for candidate in (root / remote.mirror_path, root / remote.name):
        if candidate.is_file():
            with open(candidate, "rb") as src, open(part, "wb") as out:
                shutil.copyfileobj(src, out, CHUNK)
            if opts.progress:
                opts.progress(remote.name, part.stat().st_size, part.stat().st_size)
            return str(candidate)
    raise FetchError(f"{remote.name}: not in the mirror folder {root} (looked for {remote.mirror_path} "
                     f"and {remote.name})")


def _download_first(remote: RemoteFile, urls: list[str], part: Path, opts: FetchOptions) -> str:
    """Try each URL in turn; a 404 moves on to the next, other failures are retried on the same URL."""
    for i, url in enumerate(urls):
        try:
            _download(url, part, remote.name, opts)
            return url
        except urllib.error.HTTPError as exc:
            if exc.code == 404 and i + 1 < len(urls):
                continue
            raise FetchError(f"{remote.name}: {url}: HTTP {exc.code} {exc.reason}") from None
    raise AssertionError("no URL to fetch")


def _download(url: str, part: Path, name: str, opts: FetchOptions) -> None:
    """GET `url` into `part`, resuming and retrying on network errors (HTTPError is raised at once)."""
    opener = urllib.request.build_opener()  # includes ProxyHandler(): the environment's proxies
    last: Exception | None = None
    for attempt in range(opts.retries + 1):
        if attempt:
            time.sleep(opts.backoff_s * 2 ** (attempt - 1))
        try:
            _get_once(opener, url, part, name, opts)
            return
        except urllib.error.HTTPError:
            raise
        except (urllib.error.URLError, OSError, http.client.HTTPException, socket.timeout) as exc:
            last = exc
    reason = getattr(last, "reason", None) or last
    raise FetchError(f"{name}: cannot download {url}: {reason} (tried {opts.retries + 1} times; no network? "
                     f"use --mirror DIR|URL or ${ENV_MIRROR})")


def _get_once(opener: urllib.request.OpenerDirector, url: str, part: Path, name: str, opts: FetchOptions) -> None:
    have = part.stat().st_size if part.is_file() else 0
    req = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    if have:
        req.add_header("Range", f"bytes={have}-")
    try:
        resp = opener.open(req, timeout=opts.timeout_s)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:  # the part is already whole: the checksum decides
            return
        raise
    with resp:
        resumed = have and resp.status == 206 and _range_start(resp.headers.get("Content-Range")) == have
        if not resumed:
            have = 0
        length = resp.headers.get("Content-Length")
        total = have + int(length) if length and length.isdigit() else None
        with open(part, "ab" if resumed else "wb") as out:
            got = have
            while True:
                block = resp.read(CHUNK)
                if not block:
                    break
                out.write(block)
                got += len(block)
                if opts.progress:
                    opts.progress(name, got, total)
        if total is not None and got < total:
            # the connection closed early: keep the part, the next try resumes from it
            raise http.client.IncompleteRead(b"", total - got)


def _range_start(content_range: str | None) -> int | None:
    """The first byte of 'bytes START-END/TOTAL', or None."""
    if not content_range or not content_range.startswith("bytes "):
        return None
    start = content_range[6:].split("-", 1)[0]
    return int(start) if start.isdigit() else None
