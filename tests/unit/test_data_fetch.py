"""`geofed data`'s downloader against a real HTTP mirror on 127.0.0.1: a good fetch, a checksum
mismatch, a truncated download that resumes, a server that hangs, no network at all."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from geofed.regions.datasets import (ChecksumError, FetchError, FetchOptions, fetch_dataset, get_dataset,
                                     verify_dataset)
from geofed.regions.datasets.download import fetch_file, sha256_of

from conftest import DATASETS, NO_DATA

needs_mirror = pytest.mark.skipif(not DATASETS.is_dir(), reason=NO_DATA.format(DATASETS))


def _opts(server, **kw) -> FetchOptions:
    return FetchOptions(mirror=server.url, **{"retries": 0, "backoff_s": 0.01, **kw})


def test_fetch_converts_cora_to_the_reference_npz(data_mirror, tmp_path):
    out = fetch_dataset("cora", _opts(data_mirror), root=tmp_path)
    assert out == tmp_path / "cora" / "cora.npz"
    ref, got = np.load(DATASETS / "planetoid" / "cora.npz"), np.load(out)
    assert sorted(got.files) == sorted(ref.files)
    for key in ref.files:
        assert got[key].dtype == ref[key].dtype and np.array_equal(got[key], ref[key]), key
    assert {c.status for c in verify_dataset("cora", root=tmp_path)} == {"ok"}
    # every file came over HTTP, from the mirror's planetoid/raw/ layout
    assert {p for p, _ in data_mirror.requests} == {f"planetoid/raw/{f.name}" for f in get_dataset("cora").files}


def test_a_second_fetch_downloads_nothing(data_mirror, tmp_path):
    fetch_dataset("tinyshakespeare", _opts(data_mirror), root=tmp_path)
    n = len(data_mirror.requests)
    fetch_dataset("tinyshakespeare", _opts(data_mirror), root=tmp_path)
    assert len(data_mirror.requests) == n


@needs_mirror
def test_a_mirror_with_bare_file_names_is_found(tmp_path):
    from support.httpmirror import MirrorServer

    with MirrorServer(DATASETS / "planetoid" / "raw") as server:  # ind.cora.x at the top
        out = fetch_dataset("cora", _opts(server), root=tmp_path)
    assert out.is_file()


@needs_mirror
def test_checksum_mismatch_is_refused_and_the_file_deleted(tmp_path):
    from support.httpmirror import MirrorServer

    remote = get_dataset("cora").files[0]
    with MirrorServer(DATASETS, mode="corrupt") as server, pytest.raises(ChecksumError) as exc:
        fetch_file(remote, tmp_path / remote.name, _opts(server))
    msg = str(exc.value)
    assert remote.name in msg and remote.sha256 in msg and "got " in msg
    got = msg.rsplit("got ", 1)[1].split(";")[0]
    assert len(got) == 64 and got != remote.sha256
    assert list(tmp_path.iterdir()) == []  # neither the file nor its .part is left


@needs_mirror
def test_a_truncated_download_resumes_with_a_range_request(tmp_path):
    from support.httpmirror import MirrorServer

    remote = get_dataset("tinyshakespeare").files[0]
    with MirrorServer(DATASETS, mode="truncate") as server:
        out = fetch_file(remote, tmp_path / remote.name, _opts(server, retries=2))
    assert sha256_of(out) == remote.sha256
    (first, r1), (second, r2) = server.requests
    assert first == second == remote.mirror_path and r1 is None
    assert r2 == f"bytes={1115394 // 2}-"  # it asked only for what it had not got


def test_a_hanging_server_times_out(tmp_path):
    from support.httpmirror import MirrorServer

    remote = get_dataset("cora").files[0]
    with MirrorServer(DATASETS, mode="hang") as server:
        t0 = time.monotonic()
        with pytest.raises(FetchError) as exc:
            fetch_file(remote, tmp_path / remote.name, _opts(server, timeout_s=0.5, retries=1))
        elapsed = time.monotonic() - t0
    assert "timed out" in str(exc.value) and "tried 2 times" in str(exc.value)
    assert elapsed < 5
    assert len(server.requests) == 2


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_network_is_a_clear_error(tmp_path, monkeypatch):
    # No internet here: the environment's proxy (honoured by the downloader) is a port nobody
    # listens on, so the canonical https URL cannot be reached, as on an air-gapped host.
    for var in ("no_proxy", "NO_PROXY", "GEOFED_DATA_MIRROR"):
        monkeypatch.delenv(var, raising=False)
    proxy = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("https_proxy", proxy)
    monkeypatch.setenv("HTTPS_PROXY", proxy)
    remote = get_dataset("cora").files[0]
    with pytest.raises(FetchError) as exc:
        fetch_file(remote, tmp_path / remote.name, FetchOptions(retries=1, backoff_s=0.01, timeout_s=2))
    msg = str(exc.value)
    assert remote.url in msg and "refused" in msg.lower() and "--mirror" in msg
    assert not (tmp_path / remote.name).exists()


def test_a_mirror_folder_without_the_file_names_what_it_looked_for(tmp_path):
    with pytest.raises(FetchError, match=r"ind\.cora\.x: not in the mirror folder"):
        fetch_dataset("cora", FetchOptions(mirror=str(tmp_path / "empty")), root=tmp_path)


# -- issue 36, N7 and N10: bounded downloads, and a .part that is never written through ---------

def test_every_registry_file_pins_its_size():
    """N7: the size cap needs each file's size in the registry (the mirror's copies agree)."""
    from geofed.regions.datasets import DATASETS

    for ds in DATASETS.values():
        for remote in ds.files:
            assert isinstance(remote.size, int) and remote.size > 0, remote.name
            local = DATASETS_DIR / remote.mirror_path
            if local.is_file():
                assert local.stat().st_size == remote.size, remote.name


DATASETS_DIR = DATASETS


@needs_mirror
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["endless", "oversize"])
def test_a_body_longer_than_the_pinned_size_is_cut_off_and_deleted(tmp_path, mode):
    """N7: an endless body wrote 300 MB for a 1.1 MB file and left the .part behind; before the fix
    this mirror's 64 MiB reached the disk and ended in a ChecksumError (endless), or the whole
    1,000x Content-Length was read (oversize)."""
    from support.httpmirror import MirrorServer

    remote = get_dataset("cora").files[1]  # ind.cora.y, 4,054 bytes
    with MirrorServer(DATASETS, mode=mode) as server:
        with pytest.raises(FetchError) as exc:
            fetch_file(remote, tmp_path / remote.name, _opts(server, retries=2))
    assert not isinstance(exc.value, ChecksumError)
    assert f"more than the pinned {remote.size} bytes" in str(exc.value), str(exc.value)
    assert len(server.requests) == 1  # not retried: more tries get the same answer
    assert server.sent < 8 << 20, server.sent  # the client hung up; it did not read to the end
    assert list(tmp_path.iterdir()) == []


@needs_mirror
@pytest.mark.timeout(60)
def test_a_dripping_server_is_stopped_by_the_total_deadline(tmp_path):
    """N7: one byte every 0.2 s never trips a 1 s per-read timeout; before the fix the fetch went on
    until this mirror gave up (10 s) and left the .part behind."""
    from support.httpmirror import MirrorServer

    remote = get_dataset("cora").files[1]
    with MirrorServer(DATASETS, mode="drip", drip_s=0.2) as server:
        t0 = time.monotonic()
        with pytest.raises(FetchError) as exc:
            fetch_file(remote, tmp_path / remote.name, _opts(server, timeout_s=1.0, deadline_s=1.5, retries=3))
        elapsed = time.monotonic() - t0
    assert "deadline of 1.5 s" in str(exc.value) and remote.name in str(exc.value), str(exc.value)
    assert elapsed < 4, elapsed
    assert list(tmp_path.iterdir()) == []


def test_the_deadline_covers_the_retries_and_their_pauses(tmp_path):
    """N7: a hanging server with retries 5 and pauses of 1, 2, 4 s used to take ~4 x timeout plus
    the pauses; the deadline ends it, whatever the retries would still allow."""
    from support.httpmirror import MirrorServer

    remote = get_dataset("cora").files[1]
    with MirrorServer(DATASETS, mode="hang") as server:
        t0 = time.monotonic()
        with pytest.raises(FetchError, match=r"deadline of 2 s"):
            fetch_file(remote, tmp_path / remote.name, _opts(server, timeout_s=1.0, deadline_s=2, retries=5,
                                                             backoff_s=1.0))
        assert time.monotonic() - t0 < 4
    assert list(tmp_path.iterdir()) == []


@needs_mirror
def test_a_failed_fetch_leaves_no_part_behind(tmp_path):
    """N7: a connection cut short with no retries left kept its .part (before the fix)."""
    from support.httpmirror import MirrorServer

    remote = get_dataset("tinyshakespeare").files[0]
    with MirrorServer(DATASETS, mode="truncate") as server, pytest.raises(FetchError):
        fetch_file(remote, tmp_path / remote.name, _opts(server, retries=0))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("target", ["existing", "dangling"])
def test_a_symlink_planted_at_the_part_path_is_never_written_through(data_mirror, tmp_path, target):
    """N10: before the fix the download opened the link and overwrote its target (or created it, for
    a dangling link), and the rename then left the cache file a link to it."""
    remote = get_dataset("cora").files[1]
    cache = tmp_path / "cache"
    cache.mkdir()
    victim = tmp_path / "victim.txt"
    if target == "existing":
        victim.write_text("precious")
    (cache / (remote.name + ".part")).symlink_to(victim)
    out = fetch_file(remote, cache / remote.name, _opts(data_mirror))
    assert not out.is_symlink() and sha256_of(out) == remote.sha256
    assert [p.name for p in cache.iterdir()] == [remote.name]
    if target == "existing":
        assert victim.read_text() == "precious"
    else:
        assert not victim.exists()


def test_a_stale_part_is_removed_not_resumed(data_mirror, tmp_path):
    """N10: a regular .part left from before (or planted) is deleted and the file fetched whole;
    before the fix its bytes were kept and only the rest asked for (a ChecksumError here)."""
    remote = get_dataset("cora").files[1]
    (tmp_path / (remote.name + ".part")).write_bytes(b"x" * 100)
    out = fetch_file(remote, tmp_path / remote.name, _opts(data_mirror))
    assert sha256_of(out) == remote.sha256
    assert data_mirror.requests[-1][1] is None  # no Range request


def test_a_mirror_folder_file_over_the_pinned_size_is_refused(tmp_path):
    """N7 for --mirror DIR: a file there larger than the pinned size is refused before it is copied."""
    remote = get_dataset("cora").files[1]
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / remote.name).write_bytes(bytes(remote.size + 1))
    cache = tmp_path / "cache"
    with pytest.raises(FetchError, match=rf"is {remote.size + 1} bytes; the pinned size is {remote.size}"):
        fetch_file(remote, cache / remote.name, FetchOptions(mirror=str(mirror)))
    assert list(cache.iterdir()) == []


@needs_mirror
@pytest.mark.timeout(60)
def test_geofed_data_fetch_takes_a_deadline(tmp_path, monkeypatch, capsys):
    """N7 through the CLI: --deadline ends a dripping fetch (exit 1, one line, no .part); a
    deadline of 0 is a user error (exit 2). Before the fix --deadline was an unknown option (exit 2)."""
    from support.httpmirror import MirrorServer

    from geofed.orchestrator.datacmd import main

    monkeypatch.setenv("GEOFED_DATA", str(tmp_path))
    with MirrorServer(DATASETS, mode="drip", drip_s=0.2) as server:
        t0 = time.monotonic()
        rc = main(["fetch", "cora", "--mirror", server.url, "--quiet", "--timeout", "1", "--deadline", "1.5"])
        assert time.monotonic() - t0 < 5
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1 and "not done within the deadline of 1.5 s (--deadline)" in err, err
    assert [p.name for p in (tmp_path / "cora" / "raw").iterdir()] == []
    assert main(["fetch", "cora", "--deadline", "0"]) == 2
    assert "--deadline: must be > 0, got 0.0" in capsys.readouterr().err


def test_a_part_swapped_during_the_download_is_neither_renamed_nor_deleted(data_mirror, tmp_path):
    """N10: a file put at the .part path while the download writes (another fetch of the same file,
    or an attacker) is not what was checked, so it is not renamed into the cache; and it is not
    ours, so it is left alone. Before this check the failed fetch deleted the other one's file."""
    remote = get_dataset("cora").files[1]
    part = tmp_path / (remote.name + ".part")

    def swap(name, done, total):
        if not part.is_symlink() and part.read_bytes() != b"theirs":
            part.unlink()
            part.write_bytes(b"theirs")

    with pytest.raises(FetchError, match="was replaced while it was being written"):
        fetch_file(remote, tmp_path / remote.name, _opts(data_mirror, progress=swap))
    assert part.read_bytes() == b"theirs" and not (tmp_path / remote.name).exists()
