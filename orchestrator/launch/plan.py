"""`geofed launch plan CONFIG --out DIR`: what an operator needs to bring up a multi-region Ray cluster.

The plan is computed here (pure: config in, `LaunchPlan` out); launch_render.py writes it as
scripts and a README; benchmarks/bench/local_cluster.py brings the same plan up on one machine (tests, try-outs).

Why `ray start` commands and not one cluster-launcher YAML: the launcher takes one
`provider.region` per cluster, and a geofed cluster spans several regions.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from geofed.p2p.wan.links import LinkTable
from geofed.p2p.wan.presets import load_preset

from ..config import RunConfig
from ..config.strict import ConfigError

REGION_LABEL = "ray.io/availability-region"   # what RAY_NODE_REGION sets
PLAN_VERSION = 2   # 2: setup is data (setup.sh renders it), torch index per node
_LOOPBACK = ("127.", "localhost", "::1")
# Ray's defaults (health checks: ray._raylet.Config of ray 2.60; GCS reconnects: src/ray/common/ray_config_def.h,
# whose note says gcs_grpc_min_reconnect_backoff_ms is also the connect timeout, > 4x the latency). Never lowered.
HEALTH_PERIOD_MS, HEALTH_TIMEOUT_MS, HEALTH_FAILURES = 3000, 10000, 5
MIN_BACKOFF_MS, MAX_BACKOFF_MS, RECONNECT_TIMEOUT_S, CONNECT_TIMEOUT_S = 1000, 2000, 60, 5


@dataclass(frozen=True, kw_only=True)
class NodePlan:
    """One kind of node: the head, or a worker of one region (run its script on each such node)."""

    name: str                       # file stem: head, worker-<region>
    region: str
    head: bool
    label: str                      # value of regions.label_key on this node
    env: dict[str, str]             # exported before `ray start`
    options: dict[str, Any]         # `ray start` options without --address/--node-ip-address
    rtt_to_head_ms: float
    gpu: bool = False               # a region here trains on a GPU (regions.device, regions.num_gpus)
    torch_index_url: str | None = None  # where setup.sh on this node takes torch from (null: PyPI)


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    """Everything `geofed launch plan` computes for a config: nodes, ports, Ray settings sized by RTT, driver,
    setup and TLS."""

    version: int
    config_path: str
    run_name: str
    head_region: str
    label_key: str
    regions: list[str]
    rtt_ms: dict[str, dict[str, Any]]          # "a<->b" -> {rtt_ms, source}
    worst_rtt_to_head_ms: float
    ray_settings: dict[str, dict[str, Any]]    # RAY_<name> -> {value, default, why}
    nodes: list[NodePlan]
    ports: dict[str, Any]
    driver: dict[str, Any]
    venv: str
    setup: dict[str, Any]                      # what setup.sh does on a node: setup_plan()
    tls: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    wheel: str | None = None                   # file name of the geofed wheel write_plan builds into the folder

    def node(self, name: str) -> NodePlan:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str) -> LaunchPlan:
        data = json.loads(text)
        if data.get("version") != PLAN_VERSION:
            raise ValueError(f"version: plan.json version {data.get('version')!r}, this geofed reads {PLAN_VERSION}")
        data["nodes"] = [NodePlan(**n) for n in data["nodes"]]
        return cls(**data)



def build_plan(cfg: RunConfig, *, config_path: str = "CONFIG") -> LaunchPlan:
    """The launch plan of `cfg` (pure: nothing is contacted); ConfigError when the config cannot run multi-node."""
    _check_config(cfg, config_path)
    regions = list(cfg.regions.names)
    head = cfg.launch.head_region or regions[0]
    rtts = region_rtts(cfg)
    to_head = {r: (0.0 if r == head else rtts[_pair_key(head, r)]["rtt_ms"]) for r in regions}
    worst = max(to_head.values())
    settings = ray_settings(worst, cfg.launch.tolerate_outage_s)
    base_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": cfg.launch.auth_token_path,
                **{name: str(s["value"]) for name, s in settings.items()}}
    nodes = [_node(cfg, head, head=True, env=base_env, rtt=0.0)]
    nodes += [_node(cfg, r, head=False, env=base_env, rtt=to_head[r]) for r in regions]
    ports = cfg.launch.ports
    lo, hi = cfg.network.port_range  # _check_config: set
    return LaunchPlan(
        version=PLAN_VERSION, config_path=config_path, run_name=cfg.run.name, head_region=head,
        label_key=cfg.regions.label_key, regions=regions, rtt_ms=rtts, worst_rtt_to_head_ms=worst,
        ray_settings=settings, nodes=nodes,
        ports={"between_nodes": {"gcs (head only)": ports.gcs, "node_manager": ports.node_manager,
                                 "object_manager": ports.object_manager,
                                 "dashboard_agent_grpc": ports.dashboard_agent_grpc,
                                 "ray_workers": [ports.min_worker, ports.max_worker],
                                 "geofed_grpc": [lo, hi]},
               "operator_only": {"dashboard (head, via ssh tunnel)": ports.dashboard,
                                 "client_server (head, only for a ray:// driver)": ports.client_server},
               "node_local": {"runtime_env_agent": ports.runtime_env_agent, "metrics_export": ports.metrics_export,
                              "dashboard_agent_listen": ports.dashboard_agent_listen}},
        driver={"node": "head", "env": dict(base_env),
                "command": ["geofed", "run", "CONFIG", "--address", f"$HEAD_IP:{ports.gcs}"],
                # a machine that only drives trains nothing: `setup.sh driver` installs this torch there
                "torch_index_url": torch_index_url(cfg, gpu=False)},
        venv=cfg.launch.setup.venv, setup=setup_plan(cfg), tls=_tls_note(cfg), warnings=_warnings(cfg, rtts, worst),
        wheel=None if cfg.launch.setup.package else wheel_name())


def _check_config(cfg: RunConfig, source: str) -> None:
    """What cannot work across regions is an error naming the key (exit 2), not a plan that fails later."""
    net, rc = cfg.network, cfg.regions
    head = cfg.launch.head_region
    if head is not None and head not in rc.names:
        raise ConfigError("launch.head_region", f"{head!r} is not one of regions.names ({', '.join(rc.names)})", source=source)
    if net.bind_host.startswith(_LOOPBACK):
        raise ConfigError("network.bind_host", f"{net.bind_host} is unreachable from other regions; use 0.0.0.0 "
                          "(each region then advertises its node's Ray address)", source=source)
    if net.port_range is None:
        raise ConfigError("network.port_range", "set [first, last] so that the firewall can open geofed's gRPC "
                          "ports between regions (ephemeral ports cannot be opened in advance)", source=source)
    if net.advertised_host is not None and len(rc.names) > 1:
        raise ConfigError("network.advertised_host", "one address cannot be every region's; leave it null (each "
                          "node advertises its Ray address) or set GEOFED_ADVERTISED_HOST on a node", source=source)
    if net.emulation.mode != "none":
        raise ConfigError("network.emulation.mode", f"{net.emulation.mode!r} shapes links on the driver's machine; "
                          "across real regions set none (the preset still gives the plan its RTTs)", source=source)
    lo, hi = net.port_range
    p = cfg.launch.ports
    clash = [name for name, port in p.single().items() if lo <= port <= hi]
    if clash or not (hi < p.min_worker or lo > p.max_worker):
        what = ", ".join(f"launch.ports.{c}" for c in clash) or "launch.ports.min_worker..max_worker"
        raise ConfigError("network.port_range", f"[{lo}, {hi}] overlaps {what}", source=source)


def region_rtts(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """RTT of every region pair: network.emulation.links, else the preset's measurement, else
    network.emulation.default; the source says which (the plan sizes Ray's timers from these)."""
    em = cfg.network.emulation
    preset = load_preset(em.preset) if em.preset else None
    table = LinkTable(em, list(cfg.regions.names), preset)
    overridden = {p for key in em.links for p in table.targets(key)}
    out = {}
    names = list(cfg.regions.names)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            rtt = table.configured(a, b).latency_ms + table.configured(b, a).latency_ms
            if (a, b) in overridden or (b, a) in overridden:
                source = "network.emulation.links"
            elif preset is not None and preset.link(a, b) is not None:
                source = f"preset {preset.name} ({preset.sources.get((preset.canonical(a), preset.canonical(b)), '')})"
            else:
                source = "network.emulation.default (no measurement: check it)"
            out[_pair_key(a, b)] = {"rtt_ms": round(rtt, 1), "source": source}
    return out


def _pair_key(a: str, b: str) -> str:
    return f"{min(a, b)}<->{max(a, b)}"


def _ceil(ms: float, step: int = 100) -> int:
    return int(math.ceil(ms / step) * step)


def ray_settings(rtt_ms: float, tolerate_outage_s: float) -> dict[str, dict[str, Any]]:
    """Ray's health-check and GCS reconnect settings for a cluster whose worst node-to-head RTT is
    `rtt_ms`, as RAY_<name> environment variables (read by every Ray process on a node).

    gRPC's minimum reconnect backoff is also its connect timeout, and a worker 260 ms away failed
    to join with the defaults (Ray #15389): the backoffs go above 4x the RTT (5x here). Health
    checks keep Ray's defaults until the RTT makes them tight; the failure threshold makes a
    node survive `tolerate_outage_s` of silence (a WAN blip) before Ray declares it dead.
    """
    backoff = max(MIN_BACKOFF_MS, _ceil(5 * rtt_ms))
    period = max(HEALTH_PERIOD_MS, _ceil(10 * rtt_ms))
    timeout = max(HEALTH_TIMEOUT_MS, _ceil(20 * rtt_ms))
    failures = max(HEALTH_FAILURES, math.ceil(tolerate_outage_s * 1000 / period))
    reconnect = max(RECONNECT_TIMEOUT_S, math.ceil(2 * tolerate_outage_s))
    connect = max(CONNECT_TIMEOUT_S, math.ceil(20 * rtt_ms / 1000))
    rows = [
        ("health_check_period_ms", period, HEALTH_PERIOD_MS, "GCS checks each node this often: max(default, 10 x RTT)"),
        ("health_check_timeout_ms", timeout, HEALTH_TIMEOUT_MS, "one check may take this long: max(default, 20 x RTT)"),
        ("health_check_failure_threshold", failures, HEALTH_FAILURES,
         f"failed checks in a row before a node is dead: covers launch.tolerate_outage_s={tolerate_outage_s:g}"),
        ("gcs_grpc_initial_reconnect_backoff_ms", backoff, 100, "first reconnect to the GCS: above 4 x RTT (Ray #15389)"),
        ("gcs_grpc_min_reconnect_backoff_ms", backoff, 1000, "gRPC's minimum backoff is also its connect timeout: above 4 x RTT"),
        ("gcs_grpc_max_reconnect_backoff_ms", max(MAX_BACKOFF_MS, 2 * backoff), MAX_BACKOFF_MS, "backoff cap: 2 x the minimum"),
        ("gcs_rpc_server_reconnect_timeout_s", reconnect, RECONNECT_TIMEOUT_S,
         "a node gives up on an unreachable GCS after this: 2 x launch.tolerate_outage_s"),
        ("gcs_rpc_server_connect_timeout_s", connect, CONNECT_TIMEOUT_S, "first connection to the GCS: max(default, 20 x RTT)"),
    ]
    return {f"RAY_{name}": {"value": value, "default": default, "why": why} for name, value, default, why in rows}


def _node(cfg: RunConfig, region: str, *, head: bool, env: dict[str, str], rtt: float) -> NodePlan:
    rc, p = cfg.regions, cfg.launch.ports
    label = rc.label_of(region)
    env = dict(env)
    options: dict[str, Any] = {}
    if rc.label_key == REGION_LABEL:
        env["RAY_NODE_REGION"] = label  # Ray's own way to set ray.io/availability-region
    else:
        options["--labels"] = f"{rc.label_key}={label}"
    if head:
        options.update({"--head": None, "--port": p.gcs, "--ray-client-server-port": p.client_server,
                        "--dashboard-host": "127.0.0.1", "--dashboard-port": p.dashboard})
    options.update({"--node-manager-port": p.node_manager, "--object-manager-port": p.object_manager,
                    "--dashboard-agent-grpc-port": p.dashboard_agent_grpc,
                    "--dashboard-agent-listen-port": p.dashboard_agent_listen,
                    "--runtime-env-agent-port": p.runtime_env_agent, "--metrics-export-port": p.metrics_export,
                    "--min-worker-port": p.min_worker, "--max-worker-port": p.max_worker,
                    "--disable-usage-stats": None})
    gpu = wants_gpu(cfg, region)
    return NodePlan(name="head" if head else f"worker-{region}", region=region, head=head, label=label,
                    env=env, options=options, rtt_to_head_ms=rtt, gpu=gpu,
                    torch_index_url=torch_index_url(cfg, gpu=gpu))


def ray_start_argv(node: NodePlan, *, ray: str = "ray", node_ip: str, head_address: str | None,
                   extra: dict[str, Any] | None = None) -> list[str]:
    """The exact `ray start` command of a node; `extra` adds or replaces options (a value of
    None is a flag)."""
    if not node.head and not head_address:
        raise ValueError(f"head_address: a worker node ({node.name}) needs the head's HOST:PORT")
    options = {**node.options, **(extra or {})}
    argv = [ray, "start", "--node-ip-address", node_ip]
    if not node.head:
        argv += ["--address", head_address]
    for key, value in options.items():
        argv += [key] if value is None else [key, str(value)]
    return argv


# Searched on the node after the plan maker's own pythonX.Y (Ray needs one Python version on every
# node and the driver, so the version the plan was made with is the one to prefer).
PYTHON_SEARCH = ("python3.13", "python3.12", "python3.11", "python3")
PYTHON_MINIMUM = (3, 11)
SYSCTL_FILE = "/etc/sysctl.d/60-geofed.conf"
# FIELD-NOTES: with reno/cubic Linux restarts slow start after every idle gap between rounds.
SYSCTL = {"net.ipv4.tcp_slow_start_after_idle": "0"}


def wants_gpu(cfg: RunConfig, region: str) -> bool:
    """Whether `region` trains on a GPU, so that its node needs a CUDA build of torch.

    `auto` takes a GPU only where the actor reserves one: Ray hides every GPU from an actor with
    regions.num_gpus 0. `cpu` with GPUs reserved never uses them. (regions.device is one value
    for every region today; `region` is here so that a per-region device changes only this.)"""
    rc = cfg.regions
    assert region in rc.names, region
    return rc.device.startswith("cuda") or (rc.device == "auto" and rc.num_gpus > 0)


def torch_index_url(cfg: RunConfig, *, gpu: bool) -> str | None:
    """The index a node takes torch from: launch.setup.torch_index_url when set, else the CUDA or
    the CPU index by what the node's regions train on."""
    s = cfg.launch.setup
    if s.torch_index_url is not None:
        return s.torch_index_url
    return s.torch_cuda_index_url if gpu else s.torch_cpu_index_url


def setup_plan(cfg: RunConfig) -> dict[str, Any]:
    """What setup.sh does on a node, as data (render.setup_script turns it into the script): the
    Python it looks for, the venv, the requirements in install order, the sysctl it persists."""
    import sys
    from importlib.metadata import version

    s = cfg.launch.setup
    maker = f"{sys.version_info.major}.{sys.version_info.minor}"
    search = [] if s.python else [f"python{maker}", *(p for p in PYTHON_SEARCH if p != f"python{maker}")]
    return {
        "python": {"configured": s.python, "search": search, "minimum": "%d.%d" % PYTHON_MINIMUM,
                   "plan_maker": maker},
        "venv": s.venv,
        # torch before geofed: an unpinned torch from PyPI is a multi-GB CUDA build
        "torch": s.torch,
        "ray": s.ray or f"ray[default]=={version('ray')}",
        # Never the bare name: a wheel shipped next to the script, or the operator's requirement.
        "package": s.package,
        "sysctl": dict(SYSCTL),
        "sysctl_file": SYSCTL_FILE,
        "extra_commands": list(s.extra_commands),
        # what the per-node torch choice was made from (setup.sh says it on each node)
        "device": {"regions.device": cfg.regions.device, "regions.num_gpus": cfg.regions.num_gpus},
        "torch_index_override": s.torch_index_url is not None,
    }


def wheel_name() -> str:
    """The file name of the wheel built from this checkout (pure Python: one wheel for every node)."""
    from importlib.metadata import version

    return f"geofed-{version('geofed')}-py3-none-any.whl"


def _tls_note(cfg: RunConfig) -> dict[str, Any]:
    return {
        "geofed_grpc": ("mutual TLS" if cfg.security.tls else "PLAINTEXT (security.tls is false)"),
        "how": ("geofed run makes a fresh CA and one certificate per region in RUN_DIR/tls on the driver; "
                "it sends each region actor its own certificate and key (and the CA certificate) in the "
                "actor's creation arguments, once, over Ray's control plane. No node needs geofed TLS "
                "files in advance, no shared filesystem is needed, and the CA key never leaves the driver."),
        "ray_control_plane": ("authenticated by Ray's token (RAY_AUTH_MODE=token); not encrypted unless Ray's "
                              "own TLS is on (RAY_USE_TLS=1 with RAY_TLS_SERVER_CERT, RAY_TLS_SERVER_KEY, "
                              "RAY_TLS_CA_CERT on every node and the driver). Across the public internet "
                              "turn it on or keep the cluster inside a private network (VPC peering, VPN)."),
    }


def _warnings(cfg: RunConfig, rtts: dict[str, dict], worst_to_head: float) -> list[str]:
    out = []
    if not cfg.security.tls:
        out.append("security.tls is false: updates would cross regions in plaintext, unauthenticated")
    guessed = [k for k, v in rtts.items() if v["source"].startswith("network.emulation.default")]
    if guessed:
        out.append(f"no measured RTT for {', '.join(guessed)}: sized with network.emulation.default "
                   f"(set network.emulation.links to the RTTs you measure)")
    worst = max((v["rtt_ms"] for v in rtts.values()), default=0.0)
    if cfg.sync.deadline.min_s * 1000 < 2 * worst:
        out.append(f"sync.deadline.min_s={cfg.sync.deadline.min_s:g}s is under 2 x the worst RTT ({worst:g} ms): "
                   "the adaptive deadline could drop updates that are merely far away")
    lo, hi = cfg.network.port_range
    if hi - lo + 1 < 2:
        out.append("network.port_range holds one port: a region actor Ray restarts on the same node cannot bind "
                   "while the old server's port is still held")
    if worst_to_head > 250:
        out.append(f"a region is {worst_to_head:g} ms from the head: every driver-to-actor call pays that; "
                   "consider launch.head_region nearer the middle")
    forced = cfg.launch.setup.torch_index_url
    if forced and forced.rstrip("/").endswith("/cpu") and any(wants_gpu(cfg, r) for r in cfg.regions.names):
        out.append(f"launch.setup.torch_index_url: {forced} is a CPU index, and regions.device "
                   f"{cfg.regions.device} with regions.num_gpus {cfg.regions.num_gpus:g} trains on GPUs: every region "
                   "would fail to start (leave it null for a CUDA build on those nodes)")
    return out
