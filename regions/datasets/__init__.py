"""Datasets a user can get: a registry of public files with pinned SHA-256, a per-user cache,
a careful downloader, and conversions into the formats the tasks read (docs/data.md)."""

from .cache import ENV_DATA, DatasetMissing, data_root, fetch_command, product_path, resolve_dataset
from .download import ENV_MIRROR, ChecksumError, FetchError, FetchOptions
from .fetch import FileCheck, cached, fetch_dataset, verify_dataset, write_graph_npz
from .registry import DATASETS, Dataset, RemoteFile, get_dataset

__all__ = [
    "DATASETS", "ENV_DATA", "ENV_MIRROR", "ChecksumError", "Dataset", "DatasetMissing", "FetchError", "FetchOptions",
    "FileCheck", "RemoteFile", "cached", "data_root", "fetch_command", "fetch_dataset", "get_dataset",
    "product_path", "resolve_dataset", "verify_dataset", "write_graph_npz",
]
