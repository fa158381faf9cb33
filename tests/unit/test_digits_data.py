"""mlp-digits loads sklearn's digits and splits them without importing sklearn (a cold start's
largest cost): the arrays must be exactly those of sklearn's own load_digits and train_test_split."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from geofed.regions.tasks.digits import DigitsConfig, DigitsTask
from geofed.regions.tasks.digits_data import bundled_digits_file, load_digits_arrays, stratified_split


def test_the_bundled_file_is_found_and_read_as_load_digits_does():
    assert bundled_digits_file() is not None
    data, target = load_digits_arrays()
    ref = load_digits()
    assert data.dtype == ref.data.dtype and data.shape == (1797, 64)
    assert np.array_equal(data, ref.data)
    assert target.dtype == np.int64 and np.array_equal(target, ref.target)


@pytest.mark.parametrize("fraction", [0.05, 0.1, 0.25, 0.3, 0.5, 0.77, 0.9])
@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_the_split_is_train_test_split_stratified(fraction, seed):
    data, y = load_digits_arrays()
    idx = np.arange(len(y))
    ref_train, ref_test = train_test_split(idx, test_size=fraction, random_state=seed, stratify=y)
    train, test = stratified_split(y, fraction, seed)
    assert np.array_equal(train, ref_train) and np.array_equal(test, ref_test)


def test_the_task_holds_the_arrays_it_held_with_sklearn():
    cfg = DigitsConfig(test_fraction=0.25)
    task = DigitsTask(cfg)
    ref = load_digits()
    x = (ref.data / 16.0).astype(np.float32)
    y = ref.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    for got, want in [(task.x_train, x_tr), (task.x_test, x_te), (task.y_train, y_tr), (task.y_test, y_te)]:
        assert got.dtype == want.dtype and np.array_equal(got, want)


def test_building_the_task_does_not_import_sklearn():
    code = ("import sys; from geofed.regions.tasks.digits import DigitsConfig, DigitsTask; DigitsTask(DigitsConfig()); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_without_the_bundled_file_sklearn_loads_the_same_arrays(monkeypatch):
    import geofed.regions.tasks.digits_data as dd

    want = dd.load_digits_arrays()
    monkeypatch.setattr(dd, "bundled_digits_file", lambda: None)
    got = dd.load_digits_arrays()
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(got, want))
