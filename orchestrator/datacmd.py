"""`geofed data`: list, fetch, verify and locate the standard datasets; convert a user's graph.

Exit codes: 0 done, 1 a fetch or a verification failed (network, checksum), 2 bad input
(an unknown dataset, a missing one for `path`, unreadable files for convert-graph).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from geofed.regions.datasets import (DATASETS, ENV_DATA, ENV_MIRROR, FetchError, FetchOptions, cached, data_root,
                                     fetch_dataset, get_dataset, resolve_dataset, verify_dataset, write_graph_npz)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="geofed data", description=(
        f"Datasets in the per-user cache (${ENV_DATA}, default ~/.cache/geofed); docs/data.md."))
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    sub.add_parser("list", help="the datasets geofed knows, and which are in the cache")
    f = sub.add_parser("fetch", help="download, verify (SHA-256) and convert datasets into the cache")
    f.add_argument("names", nargs="+", metavar="NAME", help=", ".join(sorted(DATASETS)))
    f.add_argument("--mirror", metavar="URL|DIR", help=f"fetch from a mirror: a base URL or a folder holding the files "
                   f"(default: ${ENV_MIRROR}, else each file's canonical URL)")
    f.add_argument("--timeout", type=float, default=30.0, metavar="S", help="seconds per connect and per read (30)")
    f.add_argument("--retries", type=int, default=4, metavar="N", help="retries on network errors, with backoff (4)")
    f.add_argument("--deadline", type=float, default=600.0, metavar="S",
                   help="seconds in all for each dataset: every file, try and pause (600)")
    f.add_argument("--quiet", action="store_true", help="no progress bar")
    v = sub.add_parser("verify", help="check the cached files' SHA-256 and the converted files")
    v.add_argument("names", nargs="*", metavar="NAME", help="default: every dataset in the cache")
    pa = sub.add_parser("path", help="print the file a task reads for NAME (exit 2 if not fetched)")
    pa.add_argument("name", metavar="NAME")
    g = sub.add_parser("convert-graph", help="your own graph (edge-list CSV, features, labels) to the graph .npz")
    g.add_argument("--edges", required=True, help="CSV, one 'source,target' pair of 0-based node ids per line")
    g.add_argument("--features", required=True, help="CSV (one row per node) or a 2-D .npy")
    g.add_argument("--labels", required=True, help="CSV/text (one class id per line, -1: unlabelled) or a 1-D .npy")
    g.add_argument("--out", required=True, help="the .npz to write (then: task.path: OUT)")
    g.add_argument("--train-per-class", type=int, default=20, help="labelled training nodes per class (20)")
    g.add_argument("--val", type=int, default=500, help="validation nodes (500)")
    g.add_argument("--test", type=int, default=1000, help="test nodes (1000)")
    g.add_argument("--seed", type=int, default=0, help="seed of the split (0)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """`geofed data ...`; returns the exit code."""
    try:
        args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        return _ACTIONS[args.action](args)
    except FetchError as exc:
        print(f"geofed data: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"geofed data: {exc}", file=sys.stderr)
        return 2


def _list(args) -> int:
    print(f"cache: {data_root()} (${ENV_DATA})")
    for name, ds in sorted(DATASETS.items()):
        state = "cached " if cached(name) else "-      "
        print(f"  {name:16s} {state} {','.join(ds.tasks):14s} {ds.description}  [{ds.source}]")
    return 0


def _fetch(args) -> int:
    for name in args.names:
        get_dataset(name)  # an unknown name is exit 2 before anything is downloaded
    for flag, value in (("--timeout", args.timeout), ("--deadline", args.deadline), ("--retries", args.retries + 1)):
        if not value > 0:  # --retries is checked as retries + 1 tries
            raise ValueError(f"{flag}: must be > {-1 if flag == '--retries' else 0}, got "
                             f"{args.retries if flag == '--retries' else value}")
    with _progress(args.quiet) as report:
        opts = FetchOptions(mirror=args.mirror, timeout_s=args.timeout, deadline_s=args.deadline, retries=args.retries,
                            progress=report)
        for name in args.names:
            out = fetch_dataset(name, opts)
            print(f"{name}: {out}")
    return 0


class _progress:
    """A rich progress bar, one line per file (or nothing with --quiet); used as the fetch callback."""

    def __init__(self, quiet: bool):
        self.bar, self.tasks = None, {}
        if not quiet:
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                                console=Console(stderr=True))

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
            return self.update
        return None

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def update(self, name: str, done: int, total: int | None) -> None:
        if name not in self.tasks:
            self.tasks[name] = self.bar.add_task(name, total=total)
        self.bar.update(self.tasks[name], completed=done, total=total)


def _verify(args) -> int:
    names = args.names or [n for n in sorted(DATASETS) if (data_root() / n).is_dir()]
    if not names:
        print(f"geofed data: no dataset in the cache ({data_root()}); fetch one with: geofed data fetch NAME")
        return 0
    bad = 0
    for name in names:
        for check in verify_dataset(name):
            bad += check.status != "ok"
            detail = f" ({check.detail})" if check.detail else ""
            print(f"{name}: {check.status:8s} {check.path}{detail}")
    if bad:
        print(f"geofed data: {bad} file(s) missing or wrong; fetch again with: geofed data fetch {' '.join(names)}",
              file=sys.stderr)
    return 1 if bad else 0


def _path(args) -> int:
    print(resolve_dataset(args.name))
    return 0


def _convert_graph(args) -> int:
    from geofed.regions.datasets.owngraph import SplitSizes, read_user_graph
    from geofed.regions.graph.data import load_graph_npz

    split = SplitSizes(train_per_class=args.train_per_class, val=args.val, test=args.test, seed=args.seed)
    arrays = read_user_graph(Path(args.edges), Path(args.features), Path(args.labels), split)
    out = write_graph_npz(arrays, Path(args.out))
    g = load_graph_npz(out)  # what the task will read: the same checks
    print(f"{out}: {g.num_nodes} nodes, {g.num_edges // 2} undirected edges, {g.num_features} features, "
          f"{g.num_classes} classes; split {int(g.train_mask.sum())}/{int(g.val_mask.sum())}/{int(g.test_mask.sum())}")
    return 0


_ACTIONS = {"list": _list, "fetch": _fetch, "verify": _verify, "path": _path, "convert-graph": _convert_graph}
