"""Issue 15, finding 7 (and the helper finding 8 uses): files a config names are opened as
regular files only, their size checked before they are read, a graph .npz checked before a byte
is inflated, a text streamed from its start. Every FIFO here is released after a deadline."""

from __future__ import annotations

import os
import zipfile

import numpy as np
import pytest
from hostile_files import GIB, call_bounded, child_peak, deflate_bomb, npy_bytes, npy_header

from geofed.orchestrator.config.strict import build
from geofed.regions.graph.data import load_graph_npz
from geofed.regions.tasks import make_task, task_config_class

# New names (geofed.regions.inputfiles, charlm.read_text_prefix) are imported in the tests that
# use them, so that on the code before the fix the other tests fail for what they test.
pytestmark = pytest.mark.timeout(300)


def _task(kind: str, **keys):
    return make_task(build(task_config_class(kind), {"kind": kind, **keys}), batch_size=8, seed=0)


def _graph_arrays(n: int = 4) -> dict[str, np.ndarray]:
    return dict(
        x=np.ones((n, 3), dtype=np.float32), y=np.array([0, 1] * (n // 2), dtype=np.int64),
        edge_index=np.array([[0, 1], [1, 0]], dtype=np.int64), train_mask=np.array([1, 1] + [0] * (n - 2), dtype=bool),
        val_mask=np.zeros(n, dtype=bool), test_mask=np.array([0, 0] + [1] * (n - 2), dtype=bool))


# -- the helper: regular files only, bounded ------------------------------------------------------

def test_helper_refuses_what_is_not_a_regular_file_without_blocking(tmp_path):
    from geofed.regions.inputfiles import InputFileError, open_regular, read_regular

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    error = call_bounded(lambda: read_regular(fifo, max_bytes=100), fifo)
    assert isinstance(error, InputFileError) and error.reason == "is a FIFO (named pipe), not a regular file"
    for path, kind in (("/dev/zero", "a character device"), (str(tmp_path), "a directory")):
        with pytest.raises(InputFileError, match=f"is {kind}, not a regular file"):
            open_regular(path, max_bytes=None)
    with pytest.raises(InputFileError) as missing:
        read_regular(tmp_path / "absent", max_bytes=10)
    assert missing.value.strerror == "No such file or directory"


def test_helper_checks_the_size_before_reading_and_reads_at_most_the_cap(tmp_path):
    from geofed.regions.inputfiles import InputFileError, read_regular

    sparse = tmp_path / "sparse"
    with open(sparse, "wb") as f:
        f.truncate(GIB)  # 1 GiB, no disk blocks: only a stat could tell it apart from a small file
    with pytest.raises(InputFileError) as exc:
        read_regular(sparse, max_bytes=1 << 20)
    assert exc.value.size == GIB and exc.value.reason == f"is {GIB} bytes; the limit is {1 << 20}"
    small = tmp_path / "small"
    small.write_bytes(b"x" * 100)
    assert read_regular(small, max_bytes=100) == b"x" * 100
    link = tmp_path / "link"
    link.symlink_to("/dev/zero")  # a symlink is judged by what it points at
    with pytest.raises(InputFileError, match="character device"):
        read_regular(link, max_bytes=100)


# -- char-lm: a text is streamed from its start, from a regular file ---------------------------------

def test_char_lm_refuses_a_fifo_instead_of_hanging(tmp_path):
    fifo = tmp_path / "text.fifo"
    os.mkfifo(fifo)
    error = call_bounded(lambda: _task("char-lm", path=str(fifo)), fifo)
    assert isinstance(error, ValueError) and str(error) == f"path: {str(fifo)!r} is a FIFO (named pipe), not a regular file"


def test_char_lm_on_a_1_gib_sparse_file_reads_only_the_prefix_it_uses(tmp_path):
    """The issue's case: 1 GiB peaked at 2.2 GB in the driver and again in every region. The
    task now reads max_chars characters (at most 4 bytes each) whatever the file's size."""
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.write(("To be, or not to be. " * 100).encode())
        f.truncate(GIB)
    out = child_peak(f"t = geofed.regions.tasks.make_task(geofed.regions.tasks.charlm.CharLMConfig(path={str(big)!r}))\n"
                     "result['chars'] = len(t.train_ids) + len(t.test_ids)", cwd=tmp_path)
    assert "error" not in out, out
    assert out["chars"] == 300_000
    assert out["grew_mb"] < 150, f"peak RSS grew {out['grew_mb']:.0f} MB reading a 1 GiB file"


def test_char_lm_prefix_reads_like_read_text(tmp_path):
    from geofed.regions.tasks.charlm import read_text_prefix

    text = "héllo\r\nwörld ✓ 🙂\rend\n" * 200
    path = tmp_path / "t.txt"
    path.write_bytes(text.encode() + b"\xff\xfe broken")
    want = path.read_text(encoding="utf-8", errors="replace")
    assert read_text_prefix(str(path), 10**6) == want
    assert read_text_prefix(str(path), 1001) == want[:1001]
    task = _task("char-lm", path=str(path), max_chars=2000, seq_len=8)
    assert task.vocab == sorted(set(want[:2000]))
    ids = np.concatenate([task.train_ids.numpy(), task.test_ids.numpy()])
    assert "".join(task.vocab[i] for i in ids) == want[:2000]


def test_char_lm_refuses_a_file_of_more_distinct_characters_than_a_text_has(tmp_path):
    MAX_VOCAB = 65_536  # geofed.regions.tasks.charlm.MAX_VOCAB
    path = tmp_path / "wide.txt"
    chars = [chr(c) for c in range(0x4E00, 0x4E00 + 20_000)] + [chr(c) for c in range(0x20000, 0x20000 + MAX_VOCAB)]
    path.write_text("".join(chars), encoding="utf-8")
    with pytest.raises(ValueError, match=f"has {len(chars)} distinct characters; char-lm takes at most {MAX_VOCAB}"):
        _task("char-lm", path=str(path), max_chars=len(chars))


# -- gcn-planetoid: a graph .npz is bounded before it is inflated -------------------------------------

def test_npz_zip_bomb_is_refused_before_it_is_inflated(tmp_path):
    """The issue's case: a 2 MB .npz allocated 2 GiB before any size check. Its member declares
    2 GiB uncompressed, over the default task.max_mb (1024): refused from the zip directory."""
    others = {k: npy_bytes(v) for k, v in _graph_arrays().items() if k != "x"}
    bomb = deflate_bomb(tmp_path / "bomb.npz", "x", (1 << 28,), 1 << 31, others=others)
    assert bomb.stat().st_size < 3 << 20
    out = child_peak("cfg = geofed.regions.tasks.graph.GcnPlanetoidConfig(path='bomb.npz')\n"
                     "geofed.regions.tasks.make_task(cfg)", cwd=tmp_path)
    assert out.get("error") == ("ValueError: task.path: bomb.npz: x.npy: 2147483776 bytes uncompressed; "
                                "the limit is 1073741824 (task.max_mb: 1024)"), out
    assert out["grew_mb"] < 100, f"peak RSS grew {out['grew_mb']:.0f} MB on a refused zip bomb"


def test_npz_header_may_not_declare_more_than_its_member_holds(tmp_path):
    """An .npy header is what numpy allocates from: one declaring 1 TiB in a 100-byte member was
    a MemoryError traceback (or an allocation as large as the limit allows)."""
    arrays = {k: npy_bytes(v) for k, v in _graph_arrays().items()}
    liar = npy_header((131072, 1048576)) + bytes(64)
    path = tmp_path / "liar.npz"
    with zipfile.ZipFile(path, "w") as z:
        for k, raw in {**arrays, "x": liar}.items():
            z.writestr(k + ".npy", raw)
    with pytest.raises(ValueError, match=r"liar.npz: x.npy: its header declares 1099511627776 bytes of data, "
                                         r"the member holds \d+"):
        load_graph_npz(path)


@pytest.mark.parametrize("case", ["lzma", "encrypted_flag", "directory_bomb", "over_cap_on_disk"])
def test_npz_structure_that_could_inflate_without_bound_is_refused(tmp_path, case):
    arrays = {k: npy_bytes(v) for k, v in _graph_arrays().items()}
    path = tmp_path / "g.npz"
    method = zipfile.ZIP_LZMA if case == "lzma" else zipfile.ZIP_STORED
    with zipfile.ZipFile(path, "w", compression=method) as z:
        for k, raw in arrays.items():
            z.writestr(k + ".npy", raw)
        if case == "directory_bomb":  # every entry becomes a Python object when the zip is opened
            for i in range(25_000):
                z.writestr(f"pad{i:05d}-" + "p" * 20, b"")
    if case == "encrypted_flag":
        raw = bytearray(path.read_bytes())
        at = raw.find(b"PK\x01\x02")
        raw[at + 8] |= 1  # general purpose flag bit 0 of the first central directory entry
        path.write_bytes(bytes(raw))
    needle = {"lzma": "x.npy: zip compression method 14; graph files are stored or deflated",
              "encrypted_flag": "x.npy: encrypted",
              "directory_bomb": "its zip directory is",
              "over_cap_on_disk": "bytes; the limit is 1000"}[case]
    with pytest.raises(ValueError, match=needle):
        load_graph_npz(path, max_bytes=1000 if case == "over_cap_on_disk" else 1 << 30)


def test_graph_task_refuses_devices_and_fifos_and_reads_a_good_file(tmp_path):
    fifo = tmp_path / "g.fifo"
    os.mkfifo(fifo)
    error = call_bounded(lambda: _task("gcn-planetoid", path=str(fifo)), fifo)
    assert isinstance(error, ValueError) and "is a FIFO (named pipe), not a regular file" in str(error)
    with pytest.raises(ValueError, match="task.path: /dev/zero: is a character device, not a regular file"):
        _task("gcn-planetoid", path="/dev/zero")
    good = tmp_path / "good.npz"
    np.savez_compressed(good, **_graph_arrays(6))
    assert load_graph_npz(good).num_nodes == 6
    with pytest.raises(ValueError, match=r"task.max_mb: must be in \[1, 1048576\]"):
        build(task_config_class("gcn-planetoid"), {"kind": "gcn-planetoid", "max_mb": 0}, "task")


def test_the_real_datasets_still_load(cora_npz):
    from geofed.regions.datasets import resolve_dataset
    from geofed.regions.tasks.charlm import read_text_prefix

    graph = load_graph_npz(cora_npz)
    assert graph.num_nodes == 2708
    text = read_text_prefix(str(resolve_dataset("tinyshakespeare")), 300_000)
    assert len(text) == 300_000 and text.startswith("First Citizen")
