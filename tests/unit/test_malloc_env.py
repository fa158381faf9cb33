"""Region processes start with glibc's malloc tuned for model-sized tensors (regions/actor.py
MALLOC_ENV; measured in docs/bench-memory.md), unless the user's environment says otherwise."""

from __future__ import annotations

from geofed.regions.actor import MALLOC_ENV, malloc_env, region_actor_class


def test_region_processes_start_with_a_fixed_mmap_threshold_and_two_arenas(monkeypatch):
    for k in MALLOC_ENV:
        monkeypatch.delenv(k, raising=False)
    env = region_actor_class(num_cpus=1, max_restarts=0)._default_options["runtime_env"]["env_vars"]
    assert env["MALLOC_MMAP_THRESHOLD_"] == "4194304" and env["MALLOC_ARENA_MAX"] == "2"


def test_a_users_own_malloc_setting_is_kept(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")  # Ray passes the driver's environment on; ours must not override it
    assert malloc_env() == {"MALLOC_MMAP_THRESHOLD_": "4194304"}
