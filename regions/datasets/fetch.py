"""Fetch a dataset into the cache (download, verify, convert) and verify what the cache holds."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .cache import data_root, dataset_dir, product_path, raw_dir
from .download import Deadline, FetchOptions, fetch_file, sha256_of
from .planetoid import convert_planetoid
from .registry import Dataset, get_dataset


def fetch_dataset(name: str, opts: FetchOptions | None = None, root: Path | None = None) -> Path:
    """Download (or reuse verified copies of) `name`'s files, build what its task reads; returns that path."""
    ds = get_dataset(name)
    opts = opts or FetchOptions()
    root = root or data_root()
    raw = raw_dir(ds, root)
    deadline = Deadline(opts.deadline_s)  # one for the dataset: a slow file leaves less time to the next
    for remote in ds.files:
        fetch_file(remote, raw / remote.name, opts, deadline=deadline)
    out = product_path(ds, root)
    if ds.kind == "planetoid":
        write_graph_npz(convert_planetoid(raw, ds.name), out)
    return out


def write_graph_npz(arrays: dict[str, np.ndarray], out: Path) -> Path:
    """Write graph arrays as a compressed .npz, atomically (tmp file in the same folder, then rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez_compressed(f, **arrays)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


@dataclass(frozen=True, kw_only=True)
class FileCheck:
    """The state of one cached file: ok, missing, or a digest that does not match."""

    path: Path
    status: str  # "ok", "missing", "mismatch", "invalid"
    detail: str = ""


def verify_dataset(name: str, root: Path | None = None) -> list[FileCheck]:
    """Check every raw file's SHA-256 and that the task's file exists and loads."""
    ds: Dataset = get_dataset(name)
    root = root or data_root()
    checks = []
    for remote in ds.files:
        path = raw_dir(ds, root) / remote.name
        if not path.is_file():
            checks.append(FileCheck(path=path, status="missing"))
            continue
        got = sha256_of(path)
        checks.append(FileCheck(path=path, status="ok") if got == remote.sha256 else
                      FileCheck(path=path, status="mismatch", detail=f"expected {remote.sha256}, got {got}"))
    out = product_path(ds, root)
    if ds.kind == "planetoid":
        if not out.is_file():
            checks.append(FileCheck(path=out, status="missing"))
        else:
            from geofed.regions.graph.data import load_graph_npz

            try:
                load_graph_npz(out)
                checks.append(FileCheck(path=out, status="ok"))
            except ValueError as exc:
                checks.append(FileCheck(path=out, status="invalid", detail=str(exc)))
    return checks


def cached(name: str, root: Path | None = None) -> bool:
    """Whether `name`'s task file is in the cache."""
    return product_path(name, root).is_file()


__all__ = ["FileCheck", "cached", "dataset_dir", "fetch_dataset", "verify_dataset", "write_graph_npz"]
