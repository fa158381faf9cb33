"""The `launch` config section: what `geofed launch plan` needs beyond the run itself.

Ports are fixed (not Ray's random defaults) so that an operator can open exactly them between
regions; the defaults are the ones Ray's "Configuring ports" page uses as examples where it
gives one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

_RAY_DOCS = "https://docs.ray.io/en/latest/ray-core/configure.html#ports-configurations"


def _doc(text: str) -> dict:
    return {"doc": text}


@dataclass(frozen=True, kw_only=True)
class RayPorts:
    """``launch.ports``: the fixed Ray ports, so a firewall can open exactly them; checked for range and clashes."""

    gcs: int = field(default=6379, metadata=_doc("head: GCS port (`ray start --port`); every node and the driver dial it"))
    client_server: int = field(default=10001, metadata=_doc("head: Ray Client port, for a driver joining with ray://"))
    dashboard: int = field(default=8265, metadata=_doc("head: dashboard / job API, bound to localhost (reach it over ssh)"))
    node_manager: int = field(default=8076, metadata=_doc("every node: raylet port"))
    object_manager: int = field(default=8077, metadata=_doc("every node: object manager port"))
    dashboard_agent_grpc: int = field(default=8078, metadata=_doc("every node: dashboard agent gRPC port"))
    runtime_env_agent: int = field(default=8079, metadata=_doc("every node: runtime env agent port (node-local)"))
    metrics_export: int = field(default=8080, metadata=_doc("every node: Prometheus metrics port (node-local unless scraped)"))
    dashboard_agent_listen: int = field(default=52365, metadata=_doc("every node: dashboard agent HTTP port (node-local)"))
    min_worker: int = field(default=10002, metadata=_doc("every node: first port of Ray worker processes"))
    max_worker: int = field(default=10999, metadata=_doc("every node: last port of Ray worker processes (one per worker process)"))

    def __post_init__(self):
        singles = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("min_worker", "max_worker")}
        for name, port in {**singles, "min_worker": self.min_worker, "max_worker": self.max_worker}.items():
            if not 1 <= port <= 65535:
                raise ValueError(f"{name}: must be in [1, 65535], got {port}")
        if self.min_worker > self.max_worker:
            raise ValueError(f"min_worker: must be <= max_worker, got {self.min_worker} > {self.max_worker}")
        seen: dict[int, str] = {}
        for name, port in singles.items():
            if port in seen:
                raise ValueError(f"{name}: port {port} is also {seen[port]}")
            if self.min_worker <= port <= self.max_worker:
                raise ValueError(f"{name}: port {port} lies in the worker range {self.min_worker}..{self.max_worker}")
            seen[port] = name

    def single(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("min_worker", "max_worker")}


# `geofed`, `geofed[mlflow]`, `geofed==0.1.0`, `geofed >= 0.1`: names an index would resolve.
_BARE_GEOFED = re.compile(r"geofed\s*(\[[^\]]*\])?\s*([=<>!~].*)?", re.IGNORECASE)


@dataclass(frozen=True, kw_only=True)
class SetupSection:
    """``launch.setup``: how every node installs geofed (venv, Python, torch, the package, Ray, extra commands)."""

    venv: str = field(default="/opt/geofed/venv", metadata=_doc("virtual environment created on every node"))
    python: str | None = field(
        default=None, metadata=_doc(
            "interpreter the venv is made from on every node, a name on PATH or an absolute path, 3.11 or newer (null: "
            "setup.sh takes the first Python 3.11+ with its venv module among pythonX.Y of the machine making the "
            "plan, python3.13, python3.12, python3.11, python3; Ray needs one Python version on every node and the "
            "driver)"))
    torch: str = field(default="torch==2.13.0", metadata=_doc("torch requirement, installed first so that pip does not pull another build"))
    torch_index_url: str | None = field(
        default=None,
        metadata=_doc("index of the torch wheel on every node, overriding the per-node choice (null: per node, "
                      "torch_cuda_index_url where a region of the node trains on a GPU by regions.device and "
                      "regions.num_gpus, torch_cpu_index_url elsewhere; https://pypi.org/simple for PyPI's build)"))
    torch_cpu_index_url: str = field(
        default="https://download.pytorch.org/whl/cpu",
        metadata=_doc("index of the torch wheel on a node whose regions train on the CPU (and a driver-only machine): "
                      "keeps it from pulling a multi-GB CUDA build"))
    torch_cuda_index_url: str = field(
        default="https://download.pytorch.org/whl/cu130",
        metadata=_doc("index of the torch wheel on a node with a region that trains on a GPU; its CUDA version must "
                      "be one the nodes' NVIDIA driver runs (cu130 needs driver 580+; cu128 and cu126 are the older "
                      "builds PyTorch publishes)"))
    package: str | None = field(default=None, metadata=_doc(
        "pip requirement that installs geofed (a wheel path or URL, a git URL, a name on an index you publish to); "
        "null: a wheel built from this checkout by `geofed launch plan`, shipped in the plan folder. Never the bare "
        "name `geofed`: it is not published on the package index, and anyone could take it there"))
    ray: str | None = field(
        default=None, metadata=_doc("Ray requirement (null: ray[default]==the version installed where the plan is made; every node and the driver must run the same Ray)"))
    extra_commands: tuple[str, ...] = field(default=(), metadata=_doc("more shell commands run on every node after installing (data, sysctl, ...)"))

    def __post_init__(self):
        for key in ("venv", "python", "torch", "package", "ray", "torch_index_url", "torch_cpu_index_url",
                    "torch_cuda_index_url"):
            if getattr(self, key) is not None and not getattr(self, key).strip():
                raise ValueError(f"{key}: must not be empty")
        if self.package is not None and _BARE_GEOFED.fullmatch(self.package.strip()):
            raise ValueError(f"package: {self.package!r} would install whatever the package index serves under the "
                             "name geofed, which this project does not publish; leave it null (a wheel built from "
                             "this checkout ships in the plan folder) or give a wheel path, a URL or a git URL")
        if not self.venv.startswith("/"):
            raise ValueError(f"venv: must be an absolute path, got {self.venv!r}")


@dataclass(frozen=True, kw_only=True)
class LaunchSection:
    """``launch``: the head region, Ray's ports, how long a node may be unreachable, the auth token's path, node
    setup."""

    head_region: str | None = field(default=None, metadata=_doc("region whose node runs the Ray head and the driver (null: the first of regions.names)"))
    ports: RayPorts = field(default_factory=RayPorts, metadata=_doc(f"fixed Ray ports, so a firewall can open exactly them ({_RAY_DOCS})"))
    tolerate_outage_s: float = field(
        default=30.0, metadata=_doc("how long a region's node may be unreachable before Ray declares it dead (sets the health-check failure threshold)"))
    auth_token_path: str = field(
        default="/etc/geofed/ray-auth-token", metadata=_doc("where each node and the driver keep Ray's auth token (mode 0600; RAY_AUTH_TOKEN_PATH)"))
    setup: SetupSection = field(default_factory=SetupSection, metadata=_doc("how every node installs geofed"))

    def __post_init__(self):
        if not 1 <= self.tolerate_outage_s <= 3600:
            raise ValueError(f"tolerate_outage_s: must be in [1, 3600], got {self.tolerate_outage_s}")
        if not self.auth_token_path.startswith("/"):
            raise ValueError(f"auth_token_path: must be an absolute path, got {self.auth_token_path!r}")
