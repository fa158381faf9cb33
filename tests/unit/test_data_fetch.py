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
