"""Paths in a config: which keys hold one, and what a relative one is relative to.

A key that names a local file or folder the driver reads (a task's text, graph, tokenizer, model
config, a plug-in's folder) says so in its field's metadata, ``path="config"``. In a config file
such a path is relative to the file's folder, as docker-compose and most tools read theirs: a
config and its data move together, and `geofed run other/dir/x.yaml` finds what x.yaml names
from any working directory. A path given with `--set` comes from the command line, so it is
relative to the working directory, as a shell user expects. Both become absolute (``~``
expanded, ``..`` taken lexically as docker-compose does) before the config is built, so the run
directory's config.yaml names the same files wherever a resume or an export runs.

``run.out_dir`` is the exception, on purpose: run directories go where the user works (the
embedded default config lives inside the installation, and several configs of one project
share one runs/ folder), and `--out` puts one anywhere else. Paths on the cluster's nodes
(``launch.auth_token_path``, ``launch.setup.venv``) are absolute there and never resolved here.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .errors import join_key
from .strict import CONFIG_RELATIVE, section_class


def path_keys(data: Any, cls: type, prefix: str = "") -> Iterator[tuple[str, dict, str]]:
    """(dotted key, the mapping holding it, its name there) for every config-relative path key
    present in `data`, a mapping not yet built into `cls`; discriminated sections by their kind."""
    if not isinstance(data, dict):
        return
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init or f.name not in data:
            continue
        key = join_key(prefix, f.name)
        if f.metadata.get("path") == CONFIG_RELATIVE:
            yield key, data, f.name
            continue
        sub = section_class(f, hints[f.name], data[f.name])
        if sub is not None:
            yield from path_keys(data[f.name], sub, key)


def resolve(value: Any, base: Path) -> Any:
    """`value` as an absolute path against `base` when it is a relative one; anything else as it is
    (an empty string means 'no file', and a wrong type is the loader's to report)."""
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        return value
    return os.path.normpath(os.path.join(base, os.path.expanduser(value)))


def resolve_file_paths(data: dict, cls: type, folder: Path) -> None:
    """Resolve the path keys of a config file's mapping against the file's folder, in place."""
    base = Path(folder).absolute()
    for _, mapping, name in list(path_keys(data, cls)):
        mapping[name] = resolve(mapping[name], base)


def resolve_set_paths(data: dict, cls: type, set_keys: Sequence[str]) -> None:
    """Resolve the path keys that `--set` gave (the key itself or a section above it) against the
    working directory, in place."""
    if not set_keys:
        return
    base = Path.cwd()
    for key, mapping, name in list(path_keys(data, cls)):
        if any(key == k or key.startswith(k + ".") for k in set_keys):
            mapping[name] = resolve(mapping[name], base)
