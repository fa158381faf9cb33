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
    text = (written / "setup.sh").read_text()
    assert "TORCH_REQ=torch==2.13.0\n" in text and "TORCH_INDEX=https://download.pytorch.org/whl/cpu\n" in text
    assert f"RAY_REQ='ray[default]=={version('ray')}'\n" in text
    install = text[text.index("install_packages() {"):]
    assert install.index('pip_install "${torch_args[@]}"') < install.index('pip_install "$RAY_REQ" "$PACKAGE"')
    assert "SYSCTL_KEYS=(net.ipv4.tcp_slow_start_after_idle)\nSYSCTL_VALUES=(0)\n" in text


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
    installs = [line for line in text.splitlines() if "pip install" in line or line.startswith("PACKAGE=")]
    assert installs and not any(re.search(r"""['"\s]geofed(['"\s=<>\[]|$)""", line) for line in installs), installs
    wheel = written / wheel_name()
    assert wheel.is_file() and f'PACKAGE="$PLAN_DIR/{wheel_name()}"\n' in text
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
    assert plan.setup["package"] == "git+https://example.org/me/geofed@v0.1.0"
    from geofed.orchestrator.launch.render import setup_script

    assert "PACKAGE=git+https://example.org/me/geofed@v0.1.0\n" in setup_script(plan)  # shlex-safe: unquoted


CPU_INDEX, CUDA_INDEX = "https://download.pytorch.org/whl/cpu", "https://download.pytorch.org/whl/cu130"


@pytest.mark.parametrize("device, num_gpus, region_index", [
    ("auto", 0.0, CPU_INDEX),    # Ray hides every GPU from an actor that reserves none: it trains on the CPU
    ("cpu", 1.0, CPU_INDEX),     # a reserved GPU the region never uses
    ("auto", 0.25, CUDA_INDEX),
    ("cuda", 1.0, CUDA_INDEX),
    ("cuda:1", 2.0, CUDA_INDEX),
])
def test_torch_build_is_chosen_per_node_from_regions_device(device, num_gpus, region_index):
    """Issue 37 item 5: every node got the CPU index (launch.setup.torch_index_url), GPU nodes too.
    Failed before with AttributeError: 'NodePlan' object has no attribute 'torch_index_url'."""
    plan = build_plan(_base(regions__device=device, regions__num_gpus=num_gpus))
    for node in plan.nodes:
        assert node.torch_index_url == region_index, node.name
        assert node.gpu == (region_index == CUDA_INDEX)
    assert plan.driver["torch_index_url"] == CPU_INDEX   # a driver-only machine trains nothing
    setup = (_render_setup(plan))
    assert CUDA_INDEX in setup if region_index == CUDA_INDEX else CUDA_INDEX not in setup


def test_torch_index_url_still_overrides_every_node():
    """Failed before with AttributeError (no per-node torch index in the plan)."""
    mirror = "https://mirror.example.org/torch/cu130"
    cfg = _base(regions__device="cuda", regions__num_gpus=1, launch__setup__torch_index_url=mirror)
    plan = build_plan(cfg)
    assert {n.torch_index_url for n in plan.nodes} | {plan.driver["torch_index_url"]} == {mirror}
    assert CPU_INDEX not in _render_setup(plan) and CUDA_INDEX not in _render_setup(plan)


def _render_setup(plan) -> str:
    from geofed.orchestrator.launch.render import setup_script

    return setup_script(plan)


def _run_setup(plan, tmp_path, *args, env=None):
    script = tmp_path / "setup.sh"
    script.write_text(_render_setup(plan))
    # Nothing may download here: pip reads no config (no mirror, no find-links) and no index.
    quiet = {"PATH": os.environ["PATH"], "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "HOME": str(tmp_path)}
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=60,
                          env={**quiet, **(env or {})})


def test_setup_sh_needs_its_node_and_names_them(tmp_path):
    """setup.sh installs the torch build of the node it runs on, so it must be told which node that is.
    Failed before: it ignored its arguments and went on to install (here exit 1 at pip's torch step: assert 1 == 2)."""
    plan = build_plan(_base(regions__device="cuda", regions__num_gpus=1, launch__setup__venv=str(tmp_path / "venv")))
    for args in ([], ["worker-mars-1"]):
        done = _run_setup(plan, tmp_path, *args)
        assert done.returncode == 2, done
        assert "usage: bash setup.sh NODE" in done.stderr
        assert "head worker-us-east-1 worker-eu-west-1 driver" in done.stderr
        assert "venv" not in done.stdout  # nothing was installed


def test_setup_sh_refuses_a_configured_python_older_than_311(tmp_path):
    """launch.setup.python names the one interpreter to use: one older than 3.11 stops setup.sh with a message
    naming the key. Failed before: setup.sh ran `<it> -m venv` whatever its version, then exit 127 (no venv/bin/pip)."""
    old = tmp_path / "bin" / "python3.10"
    old.parent.mkdir()
    old.write_text("#!/bin/sh\necho 3.10\n")   # answers the version probe the way a Python 3.10 would
    old.chmod(0o755)
    plan = build_plan(_base(launch__setup__python=str(old), launch__setup__venv=str(tmp_path / "venv")))
    done = _run_setup(plan, tmp_path, "head")
    assert done.returncode == 1, done
    assert f"launch.setup.python: {old} is Python 3.10; geofed needs 3.11 or newer" in done.stderr


def test_plan_keeps_setup_as_data(written):
    """plan.json says how each node installs: candidates of the Python search, the sysctl it persists.
    Failed before with TypeError: the setup was a list of shell lines."""
    plan = LaunchPlan.from_json((written / "plan.json").read_text())
    maker = f"python{sys.version_info.major}.{sys.version_info.minor}"  # Ray wants it on every node: first
    rest = [p for p in ("python3.13", "python3.12", "python3.11", "python3") if p != maker]
    assert plan.setup["python"]["search"] == [maker, *rest]
    assert plan.setup["python"]["minimum"] == "3.11"
    assert plan.setup["sysctl"] == {"net.ipv4.tcp_slow_start_after_idle": "0"}
    assert plan.setup["sysctl_file"] == "/etc/sysctl.d/60-geofed.conf"


def test_rendered_scripts_are_shellcheck_clean(written, tmp_path):
    """Every script a plan renders (CPU and GPU nodes, a configured package) passes shellcheck. Failed before on
    the plan with launch.setup.package set: SC2034, PLAN_DIR appears unused (setup.sh of the default plan passed)."""
    import shutil

    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install -y shellcheck)")
    from geofed.orchestrator.launch.render import driver_script, node_script, setup_script

    gpu = build_plan(_base(regions__device="cuda", regions__num_gpus=1,
                           launch__setup__package="https://example.org/geofed-0.1.0-py3-none-any.whl",
                           launch__setup__python="/usr/bin/python3.12"))
    scripts = list(written.glob("*.sh"))
    for name, text in [("setup-gpu.sh", setup_script(gpu)), ("driver-gpu.sh", driver_script(gpu)),
                       *[(f"{n.name}-gpu.sh", node_script(gpu, n)) for n in gpu.nodes]]:
        (tmp_path / name).write_text(text)
        scripts.append(tmp_path / name)
    done = subprocess.run(["shellcheck", "--shell=bash", "--severity=style", *map(str, scripts)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout


def test_a_cpu_index_forced_onto_gpu_regions_warns():
    """launch.setup.torch_index_url set to a CPU index while regions train on a GPU would make every region
    fail at start (regions.device cuda, and torch without CUDA). Failed before: no warning (plan.warnings == [])."""
    cfg = _base(regions__device="cuda", regions__num_gpus=1,
                launch__setup__torch_index_url="https://download.pytorch.org/whl/cpu",
                sync__deadline__min_s=5.0)
    plan = build_plan(cfg)
    assert any(w.startswith("launch.setup.torch_index_url: https://download.pytorch.org/whl/cpu is a CPU index")
               for w in plan.warnings), plan.warnings
    assert not any("torch_index_url" in w for w in build_plan(_base(regions__device="cuda", regions__num_gpus=1)).warnings)
