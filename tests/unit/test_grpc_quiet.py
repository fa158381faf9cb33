"""Issue 37, Why 8: `geofed run configs/multi-region.yaml` printed raw gRPC C-core lines in Ray's
coloured actor prefix, e.g. "(RegionActor pid=22963) E1206 11:29:45 add_port.cc:83] Failed to
add port to server: ... '0.0.0.0:50051' ... Address already in use": each busy port of
network.port_range that a region tried (and geofed then skipped, as it should) logged one.

Now a region actor's process starts with GRPC_VERBOSITY=NONE (Ray's runtime_env of the actor
class), ERROR with --verbose, or whatever the user exported. Before the fix the actor class had
no runtime_env (KeyError) and grpc_log_env did not exist (ImportError); the process test shows
that the environment it sets is what silences the line on this grpcio.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from geofed.regions.actor import grpc_log_env, region_actor_class

BUSY_PORT = """
import socket
s = socket.socket(); s.bind(("0.0.0.0", 0)); s.listen()
import grpc
from concurrent import futures
server = grpc.server(futures.ThreadPoolExecutor(1))
try:
    server.add_insecure_port(f"0.0.0.0:{s.getsockname()[1]}")
except RuntimeError:
    print("skipped the busy port")
"""


def _run(env_vars: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    done = subprocess.run([sys.executable, "-c", BUSY_PORT], env={**env, **env_vars}, capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.strip() == "skipped the busy port", done.stderr
    return done.stderr


def test_region_processes_start_with_grpc_logging_quiet(monkeypatch):
    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    cls = region_actor_class(num_cpus=1, max_restarts=0)
    env = {k: v for k, v in cls._default_options["runtime_env"]["env_vars"].items() if not k.startswith("MALLOC_")}
    assert env == {"GRPC_VERBOSITY": "NONE"}  # glibc's MALLOC_* beside it: tests/unit/test_malloc_env.py
    assert "add_port.cc" not in _run(env)
    assert "add_port.cc" in _run(grpc_log_env(verbose=True))  # --verbose shows them


@pytest.mark.parametrize("mine", ["DEBUG", "ERROR"])
def test_a_users_own_grpc_verbosity_is_kept(monkeypatch, mine):
    monkeypatch.setenv("GRPC_VERBOSITY", mine)
    assert grpc_log_env() == {"GRPC_VERBOSITY": mine}
