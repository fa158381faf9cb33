"""`geofed launch plan`: the plan for configs/multi-region.yaml is complete and agrees with the config."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from geofed.orchestrator.cli import main
from geofed.orchestrator.config import config_from_mapping, load_config
from geofed.orchestrator.launch.plan import (
    LaunchPlan,
    build_plan,
    ray_settings,
    ray_start_argv,
)
from geofed.orchestrator.config.strict import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "multi-region.yaml"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan")
    assert main(["launch", "plan", str(CONFIG), "--out", str(out)]) == 0
    return out


def _options(argv: list[str]) -> dict[str, str | None]:
    """`ray start` argv -> {option: value or None for a flag}."""
    out: dict[str, str | None] = {}
    i = 2
    while i < len(argv):
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[argv[i]] = argv[i + 1]
            i += 2
        else:
            out[argv[i]] = None
            i += 1
    return out


def test_every_region_has_a_node_with_its_label_and_the_head_is_the_configured_region(written):
    cfg = load_config(CONFIG)
    plan = LaunchPlan.from_json((written / "plan.json").read_text())
    assert plan.head_region == cfg.launch.head_region == "us-east-1"
    assert plan.label_key == "ray.io/availability-region"
    assert [n.name for n in plan.nodes] == ["head"] + [f"worker-{r}" for r in cfg.regions.names]
    for node in plan.nodes:
        # the default label key is the one RAY_NODE_REGION sets (Ray's documented way)
        assert node.env["RAY_NODE_REGION"] == node.label == cfg.regions.label_of(node.region)
        script = (written / f"{node.name}.sh").read_text()
        assert f"export RAY_NODE_REGION={node.region}\n" in script
    assert plan.node("head").region == "us-east-1" and plan.node("head").head


def test_scripts_start_ray_on_the_configured_ports(written):
    cfg = load_config(CONFIG)
    p = cfg.launch.ports
    head = (written / "head.sh").read_text().splitlines()[-1].split()
    opts = _options(head)
    assert head[:2] == ["/opt/geofed/venv/bin/ray", "start"] and "--head" in opts
    assert opts["--port"] == str(p.gcs) and opts["--node-ip-address"] == '"$NODE_IP"'
    assert opts["--dashboard-host"] == "127.0.0.1"
    for region in cfg.regions.names:
        opts = _options((written / f"worker-{region}.sh").read_text().splitlines()[-1].split())
        assert opts["--address"] == f'"$HEAD_IP:{p.gcs}"' and "--head" not in opts
        assert opts["--node-manager-port"] == str(p.node_manager)
        assert opts["--object-manager-port"] == str(p.object_manager)
        assert (opts["--min-worker-port"], opts["--max-worker-port"]) == (str(p.min_worker), str(p.max_worker))
    for script in written.glob("*.sh"):
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True, check=False).returncode == 0, script.name
        assert os.access(script, os.X_OK)


def test_ports_to_open_include_ray_and_geofeds_grpc_range(written):
    cfg = load_config(CONFIG)
    plan = LaunchPlan.from_json((written / "plan.json").read_text())
    between = plan.ports["between_nodes"]
    assert between["geofed_grpc"] == list(cfg.network.port_range) == [50051, 50060]
    assert between["gcs (head only)"] == 6379 and between["ray_workers"] == [10002, 10999]
    readme = (written / "README.md").read_text()
    assert "| 50051-50060 | geofed_grpc | every node of the cluster |" in readme
    assert "| 6379 | gcs (head only) | every node of the cluster |" in readme
    assert "8265" in readme and "the operator only" in readme


def test_ray_settings_are_sized_from_the_presets_rtts(written):
    cfg = load_config(CONFIG)
    plan = LaunchPlan.from_json((written / "plan.json").read_text())
    # aws preset: Virginia-Sydney 230 ms (2017 ping table), Virginia-Ireland 67 ms (DT-FM)
    assert plan.rtt_ms["ap-southeast-2<->us-east-1"]["rtt_ms"] == 230
    assert plan.rtt_ms["eu-west-1<->us-east-1"]["rtt_ms"] == 67
    assert plan.rtt_ms["eu-west-1<->us-east-1"]["source"].startswith("preset aws")
    assert plan.worst_rtt_to_head_ms == 230
    s = {k: v["value"] for k, v in plan.ray_settings.items()}
    assert s["RAY_gcs_grpc_min_reconnect_backoff_ms"] > 4 * 230
    assert s["RAY_gcs_grpc_initial_reconnect_backoff_ms"] > 4 * 230
    assert s["RAY_gcs_grpc_max_reconnect_backoff_ms"] >= s["RAY_gcs_grpc_min_reconnect_backoff_ms"]
    # a node survives launch.tolerate_outage_s of silence before Ray declares it dead
    assert s["RAY_health_check_failure_threshold"] * s["RAY_health_check_period_ms"] >= cfg.launch.tolerate_outage_s * 1000
    for v in plan.ray_settings.values():
        assert v["value"] >= v["default"]
    for node in plan.nodes:
        assert {k: node.env[k] for k in s} == {k: str(v) for k, v in s.items()}
    assert {k: plan.driver["env"][k] for k in s} == {k: str(v) for k, v in s.items()}


def test_settings_grow_with_the_rtt():
    near, far = ray_settings(20, 30), ray_settings(800, 30)
    assert near["RAY_gcs_grpc_min_reconnect_backoff_ms"]["value"] == 1000  # Ray's default is enough
    assert far["RAY_gcs_grpc_min_reconnect_backoff_ms"]["value"] >= 4000
    assert far["RAY_health_check_timeout_ms"]["value"] == 16000 and far["RAY_health_check_period_ms"]["value"] == 8000
    assert ray_settings(20, 300)["RAY_health_check_failure_threshold"]["value"] == 100


def test_every_ray_setting_is_a_real_ray_config_and_takes_effect(written):
    import ray

    plan = LaunchPlan.from_json((written / "plan.json").read_text())
    binary = (Path(ray.__file__).parent / "_raylet.so").read_bytes()
    for name in plan.ray_settings:
        assert name.startswith("RAY_") and name[4:].encode() in binary, name
    # Ray reads RAY_<name> at start: check it through the accessors Ray's Python exposes
    env = {**os.environ, **{k: str(v["value"] + 1) for k, v in plan.ray_settings.items()}}
    code = ("import ray._raylet as r; c = r.Config; "
            "print(c.health_check_period_ms(), c.health_check_timeout_ms(), c.health_check_failure_threshold())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    got = [int(x) for x in out.stdout.split()]
    assert got == [plan.ray_settings[f"RAY_health_check_{k}"]["value"] + 1 for k in ("period_ms", "timeout_ms", "failure_threshold")]


def test_token_auth_everywhere_and_no_secret_in_the_plan(written):
    cfg = load_config(CONFIG)
    plan = LaunchPlan.from_json((written / "plan.json").read_text())
    for env in [n.env for n in plan.nodes] + [plan.driver["env"]]:
        assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"] == cfg.launch.auth_token_path
    for f in written.iterdir():
        if f.suffix != ".whl":
            assert "RAY_AUTH_TOKEN=" not in f.read_text(), f.name
    for name in ("head", "worker-eu-west-1"):
        assert 'if [ ! -s "$RAY_AUTH_TOKEN_PATH" ]' in (written / f"{name}.sh").read_text()


def test_setup_installs_cpu_torch_first_and_the_same_ray(written):
    setup = (written / "setup.sh").read_text().splitlines()
    torch_line = next(i for i, line in enumerate(setup) if "'torch==2.13.0'" in line)
    geofed_line = next(i for i, line in enumerate(setup) if '"$PLAN_DIR/geofed-' in line)
    assert torch_line < geofed_line
    assert "--index-url https://download.pytorch.org/whl/cpu" in setup[torch_line]
    assert f"'ray[default]=={version('ray')}'" in setup[geofed_line]
    assert any("tcp_slow_start_after_idle=0" in line for line in setup)


def test_tls_material_travels_with_the_actor_not_a_shared_filesystem(written):
    readme = (written / "README.md").read_text()
    assert "mutual TLS" in readme and "creation arguments" in readme and "no shared filesystem" in readme
    assert "RAY_USE_TLS=1" in readme


def test_driver_joins_the_head_with_address(written):
    driver = (written / "driver.sh").read_text()
    assert driver.rstrip().endswith('run "$CONFIG" --address "$HEAD_IP:6379" "$@"')
    assert "export RAY_AUTH_MODE=token" in driver


def _base(**over):
    data = {"task": {"kind": "mlp-digits"},
            "regions": {"names": ["us-east-1", "eu-west-1"]},
            "network": {"bind_host": "0.0.0.0", "port_range": [50051, 50054], "emulation": {"mode": "none"}}}
    for dotted, value in over.items():
        node = data
        *path, last = dotted.split("__")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return config_from_mapping(data)


@pytest.mark.parametrize("over, key", [
    ({"network__bind_host": "127.0.0.1"}, "network.bind_host: 127.0.0.1 is unreachable from other regions"),
    ({"network__port_range": None}, "network.port_range: set [first, last]"),
    ({"network__emulation__mode": "proxy"}, "network.emulation.mode: 'proxy' shapes links"),
    ({"network__advertised_host": "10.0.0.1"}, "network.advertised_host: one address cannot be every region's"),
    ({"launch__head_region": "mars-1"}, "launch.head_region: 'mars-1' is not one of regions.names"),
    ({"network__port_range": [8070, 8090]}, "network.port_range: [8070, 8090] overlaps launch.ports.node_manager"),
    ({"network__port_range": [10500, 10600]}, "network.port_range: [10500, 10600] overlaps launch.ports.min_worker..max_worker"),
])
def test_configs_that_cannot_run_across_regions_are_refused_by_key(over, key):
    with pytest.raises(ConfigError) as info:
        build_plan(_base(**over))
    assert key in str(info.value)


def test_cli_exit_code_2_on_a_refused_config(tmp_path, capsys):
    code = main(["launch", "plan", str(CONFIG), "--out", str(tmp_path / "p"), "--set", "network.bind_host=127.0.0.1"])
    assert code == 2
    assert "network.bind_host" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_custom_label_key_uses_labels_and_unmeasured_pairs_warn():
    cfg = _base(regions__label_key="geofed.io/region", regions__labels={"eu-west-1": "europe"},
                regions__names=["us-east-1", "eu-west-1", "moon-1"])
    plan = build_plan(cfg)
    node = plan.node("worker-eu-west-1")
    assert node.options["--labels"] == "geofed.io/region=europe" and "RAY_NODE_REGION" not in node.env
    argv = ray_start_argv(node, node_ip="10.0.0.2", head_address="10.0.0.1:6379")
    assert argv[argv.index("--labels") + 1] == "geofed.io/region=europe"
    assert plan.rtt_ms["moon-1<->us-east-1"]["source"].startswith("network.emulation.default")
    assert any("moon-1<->us-east-1" in w for w in plan.warnings)
    with pytest.raises(ValueError, match="head_address"):
        ray_start_argv(node, node_ip="10.0.0.2", head_address=None)


def test_plan_json_round_trips(written):
    text = (written / "plan.json").read_text()
    assert LaunchPlan.from_json(text).to_json() == text
    bad = json.loads(text)
    bad["version"] = 99
    with pytest.raises(ValueError, match="version"):
        LaunchPlan.from_json(json.dumps(bad))


def test_setup_installs_the_wheel_shipped_in_the_folder_never_the_bare_name(written, tmp_path):
    """Issue 19: setup.sh ran `pip install geofed`, a name not published on the package index (anyone could take it)."""
    from geofed.orchestrator.launch.plan import wheel_name

    text = (written / "setup.sh").read_text()
    installs = [line for line in text.splitlines() if "pip install" in line]
    assert installs and not any(re.search(r"""['"\s]geofed(['"\s=<>\[]|$)""", line) for line in installs), installs
    wheel = written / wheel_name()
    assert wheel.is_file() and f'"$PLAN_DIR/{wheel_name()}"' in text
    assert 'PLAN_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"' == text.splitlines()[4]
    # The wheel holds this checkout's code: install it alone and import from it.
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=120)
    code = "import geofed.orchestrator.launch.wheel as w; print(w.__file__)"
    out = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(target)!r}); {code}"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.startswith(str(target))


@pytest.mark.parametrize("package", ["geofed", "geofed==0.1.0", "GeoFed[mlflow] >= 0.1", " geofed "])
def test_a_bare_geofed_requirement_is_refused(package):
    with pytest.raises(ConfigError, match=r"launch.setup.package: .* this project does not publish"):
        load_config(CONFIG, [f"launch.setup.package={package}"])


def test_a_configured_requirement_is_used_as_given(tmp_path):
    cfg = load_config(CONFIG, ["launch.setup.package=git+https://example.org/me/geofed@v0.1.0"])
    plan = build_plan(cfg)
    assert plan.wheel is None
    assert any("'git+https://example.org/me/geofed@v0.1.0'" in line for line in plan.setup)
