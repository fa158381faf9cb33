"""TLS material reaches a region with its actor's arguments, not through a shared RUN_DIR.

On a multi-node cluster the driver's RUN_DIR/tls is on the driver's disk only. These workers get
their material as arguments (what cluster.create_region_actors sends) and a run directory with
no tls/ in it, and still talk mutual TLS; the advertised address follows the node, not the config.
"""

from __future__ import annotations

import pytest
from geofed.orchestrator.config import config_from_mapping
from geofed.p2p.tls import make_pki
from geofed.regions.actor import ADVERTISED_HOST_ENV, advertised_host
from geofed.regions.region import Region
from geofed.p2p.prober import LinkProber

REGIONS = ["us-east-1", "eu-west-1"]


def _cfg(**network):
    return config_from_mapping({
        "task": {"kind": "mlp-digits", "hidden": 16},
        "regions": {"names": REGIONS},
        "network": {"bind_host": "127.0.0.1", "emulation": {"mode": "none"}, **network},
    })


def test_workers_with_material_as_arguments_talk_mtls_without_run_dir_tls(tmp_path):
    pki = make_pki(tmp_path / "driver" / "tls", REGIONS)      # the driver's disk
    node_dir = tmp_path / "node"                               # a node's: no tls/ here
    node_dir.mkdir()
    cfg = _cfg()
    workers = {r: Region(cfg, r, node_dir, tls=pki.material(r)) for r in REGIONS}
    try:
        addresses = {r: w.start() for r, w in workers.items()}
        for w in workers.values():
            w.connect(addresses)
        rtt = LinkProber(workers["us-east-1"].transport).ping("eu-west-1", timeout_s=10)
        assert 0 < rtt < 10
        assert all(w.transport_stats()["tls"] for w in workers.values())
    finally:
        for w in workers.values():
            w.close()
    assert not (node_dir / "tls").exists()


def test_without_material_a_worker_reads_run_dir_and_says_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="TLS file missing"):
        Region(_cfg(), "us-east-1", tmp_path)


def test_material_of_another_region_is_refused(tmp_path):
    pki = make_pki(tmp_path / "tls", REGIONS)
    with pytest.raises(ValueError, match="material is for 'eu-west-1'"):
        Region(_cfg(), "us-east-1", tmp_path, tls=pki.material("eu-west-1"))


def test_advertised_host_env_then_config_then_node_address(monkeypatch):
    import ray

    monkeypatch.delenv(ADVERTISED_HOST_ENV, raising=False)
    # bound to one address: peers dial that address (the transport's own default)
    assert advertised_host(_cfg()) is None
    # bound everywhere: the node's address as Ray knows it
    assert advertised_host(_cfg(bind_host="0.0.0.0")) == ray.util.get_node_ip_address()
    assert advertised_host(_cfg(bind_host="0.0.0.0", advertised_host="10.1.2.3")) == "10.1.2.3"
    monkeypatch.setenv(ADVERTISED_HOST_ENV, "203.0.113.7")  # a node behind NAT
    assert advertised_host(_cfg(bind_host="0.0.0.0", advertised_host="10.1.2.3")) == "203.0.113.7"
