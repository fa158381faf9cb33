"""Where fetched datasets live: ``$GEOFED_DATA``, default ``~/.cache/geofed``.

Layout: ``<root>/<dataset>/raw/<file>`` for what was downloaded (checksummed) and
``<root>/<dataset>/<product>`` for what a task reads (the converted ``.npz``, or the text).
"""

from __future__ import annotations

import os
from pathlib import Path

from .registry import Dataset, get_dataset

ENV_DATA = "GEOFED_DATA"


class DatasetMissing(ValueError):
    """A dataset a config names is not in the cache; the message gives the command that fetches it."""


def data_root() -> Path:
    """The cache folder: $GEOFED_DATA if set, else ~/.cache/geofed."""
    env = os.environ.get(ENV_DATA)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "geofed"


def dataset_dir(dataset: Dataset | str, root: Path | None = None) -> Path:
    """The dataset's folder in the cache."""
    ds = get_dataset(dataset) if isinstance(dataset, str) else dataset
    return (root or data_root()) / ds.name


def raw_dir(dataset: Dataset | str, root: Path | None = None) -> Path:
    """Where the dataset's downloaded files are kept."""
    return dataset_dir(dataset, root) / "raw"


def product_path(dataset: Dataset | str, root: Path | None = None) -> Path:
    """The file a task reads for this dataset (it may not exist yet)."""
    ds = get_dataset(dataset) if isinstance(dataset, str) else dataset
    return dataset_dir(ds, root) / ds.product


def fetch_command(name: str) -> str:
    """The command line a user runs to get `name`."""
    return f"geofed data fetch {name}"


def resolve_dataset(name: str) -> Path:
    """The path of `name`'s task file in the cache; DatasetMissing (a ValueError) says how to fetch it."""
    path = product_path(name)
    if not path.is_file():
        raise DatasetMissing(f"dataset {name!r} is not in the data cache ({dataset_dir(name)}); "
                             f"fetch it with: {fetch_command(name)}")
    return path


def task_data_path(dataset: str, task_kind: str) -> str:
    """The cached file of `dataset` for a task of kind `task_kind`, as a string; ValueError
    ("dataset: ...", one line with the fetch command) for an unknown, mismatched or unfetched one."""
    from .registry import DATASETS

    ds = DATASETS.get(dataset)
    fitting = sorted(n for n, d in DATASETS.items() if task_kind in d.tasks)
    if ds is None or task_kind not in ds.tasks:
        raise ValueError(f"dataset: {dataset!r} is not a {task_kind} dataset (known: {', '.join(fitting)}); "
                         "for your own file set path instead")
    try:
        return str(resolve_dataset(dataset))
    except DatasetMissing as exc:
        raise ValueError(f"dataset: {exc}") from None
