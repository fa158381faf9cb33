"""The Planetoid files are pickles: the converter's unpickler admits only the numpy/scipy classes
they hold; a pickle naming anything else is refused before any of it runs."""

from __future__ import annotations

import os
import pickle
import shutil

import numpy as np
import pytest

from geofed.regions.datasets.planetoid import UnsafePickleError, convert_planetoid, load_pickle

from conftest import DATASETS

RAW = DATASETS / "planetoid" / "raw"


class _Boom:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_would_run_a_command_is_refused(tmp_path):
    marker = tmp_path / "ran"
    evil = tmp_path / "ind.cora.x"
    evil.write_bytes(pickle.dumps(_Boom(marker), protocol=2))
    with pytest.raises(UnsafePickleError) as exc:
        load_pickle(evil)
    assert "refused" in str(exc.value) and "system" in str(exc.value) and str(evil) in str(exc.value)
    assert not marker.exists()


@pytest.mark.parametrize("payload", [
    b"\x80\x02cbuiltins\neval\nX\x0b\x00\x00\x00print('hi')\x85R.",
    b"\x80\x02c__builtin__\ngetattr\n.",
    b"\x80\x02cnumpy\nload\n.",  # a numpy function, not one of the admitted classes
    b"\x80\x02cscipy.sparse\nload_npz\n.",
])
def test_any_other_global_is_refused(tmp_path, payload):
    path = tmp_path / "p"
    path.write_bytes(payload)
    with pytest.raises(UnsafePickleError, match="refused"):
        load_pickle(path)


def test_a_refused_file_stops_the_conversion(tmp_path):
    if not RAW.is_dir():
        pytest.skip(f"no raw Planetoid files at {RAW}")
    for f in RAW.glob("ind.cora.*"):
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "ind.cora.graph").write_bytes(pickle.dumps(_Boom(tmp_path / "ran"), protocol=2))
    with pytest.raises(UnsafePickleError):
        convert_planetoid(tmp_path, "cora")
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("name", ["cora", "citeseer"])
def test_the_real_files_load_and_convert_to_the_reference_npz(name):
    if not RAW.is_dir():
        pytest.skip(f"no raw Planetoid files at {RAW}")
    got = convert_planetoid(RAW, name)
    ref = np.load(DATASETS / "planetoid" / f"{name}.npz", allow_pickle=False)
    assert sorted(got) == sorted(ref.files)
    for key in ref.files:
        assert got[key].dtype == ref[key].dtype and got[key].shape == ref[key].shape, key
        assert np.array_equal(got[key], ref[key]), key
    split = [int(got[k].sum()) for k in ("train_mask", "val_mask", "test_mask")]
    assert split == ([140, 500, 1000] if name == "cora" else [120, 500, 1000])
    if name == "citeseer":  # the 15 isolated ids missing from the test index: no label, no split
        assert int((got["y"] == -1).sum()) == 15
