"""The `geofed` command line. Thin: it parses arguments and calls the library.

Exit codes: 0 success, 1 run failed, 2 bad input (config, arguments), 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

# `geofed bench ...` lives in a distribution of its own (geofed-bench, benchmarks/ in a clone) so that
# users' wheels do not carry it; it registers its `main(argv) -> int` under this entry point, and the
# core never imports it.
BENCH_ENTRY_POINT = ("geofed.commands", "bench")
BENCH_MISSING = ("geofed bench: the benchmarks are not installed (a distribution of their own, not in geofed's "
                 "wheel): from a clone of geofed, pip install -e ./benchmarks")


# driver/rundir.SAFE_ON_RESUME, spelled out here so that --help imports nothing (a test keeps them equal).
RESUMABLE_KEYS = ("run.rounds", "run.max_steps", "run.target", "run.eval_every", "run.checkpoint_every", "run.keep_checkpoints",
                  "run.report", "run.trackers", "run.on_region_failure", "regions.start_timeout_s", "regions.placement_timeout_s",
                  "regions.heartbeat_timeout_s", "ray.address", "ray.num_cpus", "ray.init_timeout_s",
                  "run.orphan_timeout_s")


SET_HELP = ("A relative path given here is from the working directory (one in the file: from the file's folder); "
            "setting a section's kind (sync.policy.kind=fixed) switches it to that kind's defaults, and other --set "
            "keys still apply (docs/CONFIG.md)")


def _add_run(sub) -> None:
    """`geofed run` and its options."""
    run = sub.add_parser("run", help="train: one Ray actor per region, updates exchanged over gRPC")
    run.add_argument("config", nargs="?", help="YAML run config (default: the embedded configs/local-wan.yaml); "
                     "with --resume only its plug-in task is read, to vouch for the one RUN_DIR names")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                     help="override a config key (repeatable), e.g. --set run.rounds=2. " + SET_HELP)
    run.add_argument("--out", help="run directory (default: <run.out_dir>/<run.name>-<UTC timestamp>)")
    run.add_argument("--address", help="join an existing Ray cluster: auto, HOST:PORT or ray://HOST:PORT")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last completed round; refused "
                     "(exit 2, the difference by key) when RUN_DIR/config.yaml or --set changes the run's config")
    run.add_argument("--allow-config-change", dest="allow_config_change", action="extend", nargs="+", default=[],
                     metavar="KEY", help="with --resume: accept a change of these keys (config.yaml edits or --set), "
                     "only keys that may change mid-run: " + ", ".join(RESUMABLE_KEYS)
                     + "; never security.* (TLS cannot be turned off on resume)")
    run.add_argument("--trust-run-dir", dest="trust_run_dir", action="store_true",
                     help="with --resume: import the plug-in task (task.kind python:...) RUN_DIR/config.yaml names "
                     "although no CONFIG of yours names it (its top-level code runs); without it, a plug-in is "
                     "imported only when CONFIG names the same one (kind and path), else exit 2")
    run.add_argument("--no-report", action="store_true", help="do not write report.html at the end")
    run.add_argument("--quiet", action="store_true", help="no progress (a bar on a terminal, else one line per round)")
    run.add_argument("--verbose", action="store_true", help="let Ray's own start-up messages through (its "
                     "token-auth warning, 'Started a local Ray instance'); without it only Ray's errors show")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="geofed", description="Geo-distributed and federated training orchestrator.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_run(sub)

    val = sub.add_parser("validate", help="check a config without running it")
    val.add_argument("config", help="YAML run config")
    val.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                     help="override a config key (repeatable), as `geofed run` does. " + SET_HELP)

    sub.add_parser("plan", help="predict round time, utilisation, bytes and egress $ per (H, codec) before a run",
                   add_help=False).add_argument("rest", nargs=argparse.REMAINDER)

    sub.add_parser("config-docs", help="print the table of every config key (docs/CONFIG.md)")

    # Its own parser lists the benches (`geofed bench -h`); main() hands everything after `bench` over.
    sub.add_parser("bench", help="benchmarks that print comparison tables (pip install -e ./benchmarks)",
                   add_help=False).add_argument("rest", nargs=argparse.REMAINDER)

    rep = sub.add_parser("report", help="write report.html and plots for a run directory")
    rep.add_argument("run_dir")
    rep.add_argument("--compare", nargs="+", default=[], metavar="RUN_DIR", help="overlay other runs")
    rep.add_argument("--out", help="output folder (default: RUN_DIR/report; with --compare RUN_DIR/compare-vs-<names>)")

    watch = sub.add_parser("watch", help="a live table of a run in progress, from its run directory's files")
    watch.add_argument("run_dir", metavar="RUN_DIR")
    watch.add_argument("--interval", type=float, default=2.0, metavar="S", help="seconds between refreshes (default 2)")
    watch.add_argument("--once", action="store_true", help="print one snapshot and exit (scripts, tests)")

    leave = sub.add_parser("leave", help="retire a region from a live run after its round in flight (docs/reliability.md)",
                           description="Ask a live run's driver (through RUN_DIR/control) to retire region NAME after "
                           "its round in flight: its update of that round is delivered, then its actor is closed for "
                           "good and the others go on without it. Prints the driver's answer (events.jsonl) as JSON. "
                           "Exit codes: 0 left, 1 refused by the driver (already left, the last region), 2 not a run "
                           "directory or an unknown region, 3 no driver runs RUN_DIR (ended, or its driver is gone), "
                           "4 no answer within --wait.")
    leave.add_argument("run_dir", metavar="RUN_DIR")
    leave.add_argument("region", metavar="NAME", help="the region to retire (one of the run's regions.names)")
    leave.add_argument("--wait", type=float, default=300.0, metavar="S",
                       help="seconds to wait for the driver's answer (default 300; 0: write the request and exit)")
    join = sub.add_parser("join", help="bring a region into a live run, back or under a new name (docs/reliability.md)",
                          description="Ask a live run's driver (through RUN_DIR/control) to bring region NAME into "
                          "the run: a new actor (placed with its label when the run pins labels, or on a node "
                          "labelled --label), its certificate from the run's CA in RUN_DIR/tls; the rounds go on "
                          "while it starts, and the round after it answers it takes the current model and outer "
                          "state from a peer, its links probed (the driver gives it regions.start_timeout_s). "
                          "Waits for that real join. NAME is one of the run's "
                          "regions that left or failed for good, or a new name (checked as regions.names' entries "
                          "are), which then joins the run's regions for topology and mixing from the next round. "
                          "Prints the driver's answer (events.jsonl) as JSON. Exit codes as geofed leave's: 0 "
                          "joined, 1 refused (with the reason), 2 not a run directory or a bad name or label, 3 no "
                          "driver runs RUN_DIR, 4 no answer within --wait.")
    join.add_argument("run_dir", metavar="RUN_DIR")
    join.add_argument("--region", required=True, metavar="NAME", help="the region that joins: back, or a new name")
    join.add_argument("--label", metavar="VALUE", help="place a new region's actor on a Ray node whose regions.label_key "
                      "is VALUE (the driver waits regions.placement_timeout_s for one); default: as the run places "
                      "its regions")
    join.add_argument("--wait", type=float, default=300.0, metavar="S",
                      help="seconds to wait for the driver's answer (default 300; 0: write the request and exit)")

    exp = sub.add_parser("export", help="write a checkpoint's averaged model as safetensors or a torch state_dict")
    exp.add_argument("run_dir", metavar="RUN_DIR")
    exp.add_argument("--round", type=int, help="the checkpoint's round (default: the newest)")
    exp.add_argument("--format", choices=("safetensors", "torch"), default="safetensors")
    exp.add_argument("--out", help="file to write (default: RUN_DIR/export/model-round<N>.safetensors or .pt); "
                     "its description goes next to it, as .json")

    data = sub.add_parser("data", help="datasets: list, fetch, verify, path, convert-graph (docs/data.md)",
                          add_help=False)
    data.add_argument("rest", nargs=argparse.REMAINDER)

    net = sub.add_parser("net", help="WAN emulation housekeeping")
    nsub = net.add_subparsers(dest="net_command", required=True, metavar="SUBCOMMAND")
    nsub.add_parser("cleanup", help="remove network namespaces left by kernel-mode runs that crashed",
                    add_help=False).add_argument("rest", nargs=argparse.REMAINDER)

    launch = sub.add_parser("launch", help="multi-region cloud launch helpers")
    lsub = launch.add_subparsers(dest="launch_command", required=True, metavar="SUBCOMMAND")
    plan = lsub.add_parser("plan", help="write what an operator needs to bring up a multi-region Ray cluster")
    plan.add_argument("config")
    plan.add_argument("--out", required=True, help="folder for the plan")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The `geofed` command line; returns the exit code (2: bad arguments or config, 130: interrupted)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["data"]:  # its own parser (and -h): argparse's REMAINDER would not take a leading option
        from .datacmd import main as data_main

        return data_main(argv[1:])
    try:
        if argv[:1] == ["plan"]:  # its own parser too
            from .plan.cli import main as plan_main

            return plan_main(argv[1:])
        if argv[:1] == ["bench"]:  # the bench distribution's parser, -h and NAME -h included
            return _bench(argv[1:])
        if len(argv) >= 2 and (argv[0], argv[1]) in _FORWARDED:
            # `geofed net cleanup ...` parses its own options, -h included.
            return _forward(argv[2:])
        try:
            args = _parser().parse_args(argv)
        except SystemExit as exc:  # argparse exits 2 on bad arguments, 0 on --help
            return int(exc.code or 0)
        return _dispatch(args)
    except _config_error() as exc:  # evaluated only when something raised: -h never imports the config package
        print(f"geofed: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("geofed: interrupted", file=sys.stderr)
        return 130


_FORWARDED = {("net", "cleanup")}


def _forward(rest: list[str]) -> int:
    from geofed.p2p.wan.kernel import cleanup_main

    try:
        return cleanup_main(rest)
    except SystemExit as exc:  # its argparse: 0 after -h, 2 on bad arguments
        return exc.code if isinstance(exc.code, int) else 1 if exc.code else 0


def _bench(rest: list[str]) -> int:
    from importlib.metadata import entry_points

    group, name = BENCH_ENTRY_POINT
    found = list(entry_points(group=group, name=name))
    try:
        bench_main = found[0].load() if found else None
    except ModuleNotFoundError as exc:
        # Its metadata without its code (a venv that sees another's site-packages: CI's wheel check);
        # a module missing under it is its own failure, told as is.
        if not (exc.name and (found[0].module + ".").startswith(exc.name + ".")):
            raise
        bench_main = None
    if bench_main is None:
        print(BENCH_MISSING, file=sys.stderr)
        return 2
    return int(bench_main(rest))


def _config_error() -> type[Exception]:
    from .config.errors import ConfigError

    return ConfigError


def _dispatch(args: argparse.Namespace) -> int:
    from .config.errors import ConfigError

    if args.command == "validate":
        from .config import load_config
        from .config.devicecheck import local_device_problem

        cfg = load_config(args.config, args.overrides)
        if (problem := local_device_problem(cfg)) is not None:
            raise ConfigError("", problem, source=args.config)
        from .driver.trackers import check_trackers

        check_trackers(cfg, source=args.config)
        if (check_data := getattr(cfg.task, "check_data", None)) is not None:  # a task's file, read as a run would
            try:
                check_data()
            except ValueError as exc:
                raise ConfigError("", str(exc), source=args.config) from None
        print(f"{args.config}: ok ({len(cfg.regions.names)} regions, task {cfg.task.kind}, {cfg.run.rounds} rounds)")
        return 0
    if args.command == "config-docs":
        from .config.docs import config_docs_markdown

        print(config_docs_markdown(), end="")
        return 0
    if args.command == "net":
        return _forward(args.rest)
    if args.command == "run":
        if args.allow_config_change and not args.resume:
            raise ConfigError("", "only with --resume RUN_DIR (a new run takes any config)", source="--allow-config-change")
        if args.trust_run_dir and not args.resume:
            raise ConfigError("", "only with --resume RUN_DIR (a new run imports only what its config names)",
                              source="--trust-run-dir")
        from .driver.entry import run_from_args

        return run_from_args(args)
    if args.command == "report":
        from .report import write_report

        print(write_report(args.run_dir, compare=args.compare, out=args.out))
        return 0
    if args.command == "watch":
        from .watch import watch

        return watch(args.run_dir, interval=args.interval, once=args.once)
    if args.command in ("leave", "join"):
        from .driver.membership import request_from_args

        return request_from_args(args, args.command)
    if args.command == "export":
        from .driver.export import export_from_args

        return export_from_args(args)
    if args.command == "launch":
        from .launch.render import plan_from_args

        return plan_from_args(args)
    raise AssertionError(args.command)


def entry() -> None:
    """The console script: main() as the process's exit status."""
    sys.exit(main())


if __name__ == "__main__":
    entry()
