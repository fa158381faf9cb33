"""The datasets `geofed data` knows: each file's canonical public URL, pinned SHA-256 and byte size.

A file is fetched from its URL, or from a mirror (a folder or a base URL) at ``mirror_path``
(the layout of the project's test mirror) or, failing that, at its bare file name. The pinned
size caps what a download may write: a server can send no more than it, however long its body.
"""

from __future__ import annotations

from dataclasses import dataclass

PLANETOID_URL = "https://raw.githubusercontent.com/kimiyoung/planetoid/master/data/"
TINYSHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


@dataclass(frozen=True, kw_only=True)
class RemoteFile:
    """One file of a dataset: where it comes from and the digest it must have."""

    name: str  # file name in the dataset's raw/ folder of the cache
    url: str
    sha256: str
    size: int  # bytes; a download stops, and fails, at the first byte past it
    mirror_path: str  # path under a mirror root (a bare-name fallback is tried too)


@dataclass(frozen=True, kw_only=True)
class Dataset:
    """A dataset: its raw files, what the task reads (``product``) and how it is made from them."""

    name: str
    description: str
    files: tuple[RemoteFile, ...]
    product: str  # file name of what a task reads, in the dataset's cache folder
    kind: str  # "planetoid": converted from the raw pickles; "text": the raw file itself
    tasks: tuple[str, ...]  # the task kinds that read it
    source: str  # citation / origin, for `geofed data list`


_PLANETOID_PINS = {  # part: (SHA-256, size in bytes)
    "cora": {
        "x": ("23cfa55d91c6f624233f5eb7b6e3f141f1bd2b2ae39608a63cf5d084bb27baab", 22119),
        "y": ("94465c14eb53e04ca262198dcbb2521ee8af60fb3f3d546cd6ca24a511b0e7d1", 4054),
        "tx": ("b9afbaa4a400df991f6f02ef677e1e44da55ffc04801fd02f9e673987829226a", 148025),
        "ty": ("41f5ac76596a1699cc33f53084a2419e92961c42bb75f36fc38e616d348532ad", 28135),
        "allx": ("9419ba2f26f5c35243db64aba110e0f35a04851609e0dc5433450676ca6b8543", 257305),
        "ally": ("2b998f5cc7fedc86e7f97ca2498f47a1ffc1462c29e2d578b23bf3f62b6e7d71", 47959),
        "graph": ("58f13302f39dde8852dad6fe6d15b89b077b6d7f837626bce671ef80344b383d", 59847),
        "test.index": ("297ce89af2b51a6a194181c7dbe1796c6a1cf9cd9349a88383b1b1e227867875", 5000),
    },
    "citeseer": {
        "x": ("d20de19150741e555de0ed037195630fc194114ebc7fd72ced62810148aa22f6", 31087),
        "y": ("8ba87e515d8e3ee3cf52f6d2c5b86aa73f11ecad825a808455209ec26cd54924", 3014),
        "tx": ("539a8906a2da97628d212f2fdd668c109a8b3f0d36574b59e5d3fd5b5303da21", 260321),
        "ty": ("55e5bd1ba1e733a04598753ad1a8d57957f4b8f89e74519f41f4f4938767e4ce", 24135),
        "allx": ("2ac30345d95c9ec933a817ee0bdd6a5f077f8c184a20e696910192d534414668", 595021),
        "ally": ("f704b2d986dde6c2669934de1f3ae5696a6cf9455c0f6b2646a2d135ea0a1c95", 55623),
        "graph": ("d79a4ef9d3e7169aee8946145f6b7306e35bc79bffad26346cfb94e10e9912a7", 61987),
        "test.index": ("2af990671580b6b2df5d158d1038f8292e30c9cd821b5453f399659b25b723d4", 5000),
    },
}
PLANETOID_PARTS = ("x", "y", "tx", "ty", "allx", "ally", "graph", "test.index")


def _planetoid(name: str, description: str) -> Dataset:
    files = tuple(
        RemoteFile(name=f"ind.{name}.{part}", url=f"{PLANETOID_URL}ind.{name}.{part}",
                   sha256=_PLANETOID_PINS[name][part][0], size=_PLANETOID_PINS[name][part][1], mirror_path=f"planetoid/raw/ind.{name}.{part}")
        for part in PLANETOID_PARTS)
    return Dataset(name=name, description=description, files=files, product=f"{name}.npz", kind="planetoid",
                   tasks=("gcn-planetoid",), source="Planetoid (Yang, Cohen, Salakhutdinov 2016), kimiyoung/planetoid")


DATASETS: dict[str, Dataset] = {
    "cora": _planetoid("cora", "citation graph: 2,708 nodes, 1,433 features, 7 classes; split 140/500/1000"),
    "citeseer": _planetoid("citeseer", "citation graph: 3,327 nodes, 3,703 features, 6 classes; split 120/500/1000"),
    "tinyshakespeare": Dataset(
        name="tinyshakespeare", description="1,115,394 characters of Shakespeare (UTF-8 text)",
        files=(RemoteFile(name="input.txt", url=TINYSHAKESPEARE_URL,
                          sha256="86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed", size=1_115_394,
                          mirror_path="tinyshakespeare/input.txt"),),
        product="raw/input.txt", kind="text", tasks=("char-lm", "gpt", "hf-causal-lm"), source="char-rnn (Karpathy), karpathy/char-rnn"),
}


def get_dataset(name: str) -> Dataset:
    """The registry entry of `name`; ValueError lists the known names."""
    try:
        return DATASETS[name]
    except KeyError:
        raise ValueError(f"unknown dataset {name!r} (known: {', '.join(sorted(DATASETS))})") from None
