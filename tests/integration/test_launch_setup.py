"""A launch plan's setup.sh run for real as a user without root, in a fresh venv (issue 37 item 5).

The user is `nobody`, switched to with setpriv: no sudo, no home, no pyenv (/root is closed to it),
so setup.sh must find the stock image's Python itself. GEOFED_SETUP_DRY_RUN=1 leaves out only
what downloads (pip's installs from an index are printed): the Python search, the venv, the
geofed wheel from the plan folder (installed without its dependencies), the per-node torch choice
and the sysctl decision all run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "multi-region.yaml"
NOBODY = 65534
SYSCTL_FILE = Path("/etc/sysctl.d/60-geofed.conf")
CPU_INDEX, CUDA_INDEX = "https://download.pytorch.org/whl/cpu", "https://download.pytorch.org/whl/cu130"

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to the user nobody (setpriv)"),
    pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux) to run as nobody"),
]


@pytest.fixture(scope="module")
def area():
    """A folder nobody can read (pytest's tmp_path is root's, mode 0700), with a home it owns."""
    root = Path(tempfile.mkdtemp(prefix="gfsetup", dir="/tmp"))
    root.chmod(0o755)
    home = root / "home"
    home.mkdir()
    os.chown(home, NOBODY, NOBODY)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def gpu_plan(area):
    """The multi-region plan with GPU regions, its venv where nobody can write; the wheel is built here."""
    out = area / "plan"
    venv = area / "home" / "venv"
    done = subprocess.run([sys.executable, "-m", "geofed.orchestrator.cli", "launch", "plan", str(CONFIG),
                           "--out", str(out), "--set", "regions.device=cuda", "--set", "regions.num_gpus=1",
                           "--set", f"launch.setup.venv={venv}"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return out, venv


def _as_nobody(script: Path, *args: str, path: str, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    # Should the dry run ever reach for an index, pip has none: no config (mirrors, find-links), --no-index.
    env = {"PATH": path, "HOME": str(script.parent.parent / "home"), "LANG": "C.UTF-8",
           "GEOFED_SETUP_DRY_RUN": "1", "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", **(extra_env or {})}
    argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all",
            "env", "-i", *(f"{k}={v}" for k, v in env.items()), "/bin/bash", str(script), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_setup_runs_as_nobody_in_a_fresh_venv_with_the_torch_of_its_node(gpu_plan):
    """Failed before: setup.sh took no node and ran `python3.11 -m venv` then `pip install`, `sysctl -w`
    unconditionally: as nobody on this plan it stopped at the first pip step (exit 1) with
    "No matching distribution found for torch==2.13.0" (the CPU index on a GPU node), and would have
    failed on `sysctl -w` (permission denied) with nothing persisted."""
    plan, venv = gpu_plan
    sysctl_before = SYSCTL_FILE.read_bytes() if SYSCTL_FILE.exists() else None
    stock_path = "/usr/local/bin:/usr/bin:/bin"   # a stock image's: no pyenv, no project venv

    done = _as_nobody(plan / "setup.sh", "worker-eu-west-1", path=stock_path)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    # The Python search found the image's interpreter by itself, and the venv is this user's.
    found = next(line for line in out.splitlines() if line.startswith("setup.sh: Python "))
    version = found.split()[2].rstrip(":")
    assert tuple(int(x) for x in version.split(".")) >= (3, 11), found
    cfg = (venv / "pyvenv.cfg").read_text()
    assert f"version = {version}" in cfg or f"version_info = {version}" in cfg, cfg
    assert (venv / "bin" / "python").exists() and venv.stat().st_uid == NOBODY
    # A GPU node takes the CUDA build; the download itself is left out, its command said.
    assert f"torch for node worker-eu-west-1 from {CUDA_INDEX}: a region here trains on a GPU" in out
    assert f"dry run, not downloading: pip install torch==2.13.0 --index-url {CUDA_INDEX} \n" in out
    # geofed's wheel from the plan folder is in the fresh venv.
    assert list(venv.glob("lib/python*/site-packages/geofed-*.dist-info")), "geofed not installed into the venv"
    # No root, no sudo: the sysctl is neither set nor persisted, and setup.sh says so (exit 0: not fatal).
    assert "net.ipv4.tcp_slow_start_after_idle" in done.stderr + out
    assert "needs root" in done.stderr + out
    assert (SYSCTL_FILE.read_bytes() if SYSCTL_FILE.exists() else None) == sysctl_before

    # The same venv again, as the driver-only machine: reused, and the CPU build this time.
    again = _as_nobody(plan / "setup.sh", "driver", path=stock_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"venv {venv} exists (Python {version})" in again.stdout
    assert f"pip install torch==2.13.0 --index-url {CPU_INDEX}" in again.stdout


def test_setup_without_python_311_names_what_it_found(gpu_plan, area):
    """Failed before: setup.sh ran `python3.11 -m venv` and died with bash's "python3.11: command not found"
    (exit 127), saying nothing of what to install."""
    plan, _ = gpu_plan
    bin_dir = area / "oldbin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("dirname", "id", "cat"):
        link = bin_dir / tool
        if not link.exists():
            link.symlink_to(shutil.which(tool))
    old = bin_dir / "python3"
    # an interpreter that answers the version probe as a Python 3.10 would (the only one on this PATH)
    old.write_text("#!/bin/sh\necho 3.10\n")
    old.chmod(0o755)
    done = _as_nobody(plan / "setup.sh", "head", path=str(bin_dir))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "no Python 3.11 or newer with its venv module on this node" in done.stderr
    assert f"found: {old} (3.10)" in done.stderr
    assert "GEOFED_PYTHON" in done.stderr


def test_setup_as_root_persists_the_sysctl(gpu_plan, area):
    """As root setup.sh writes the sysctl to /etc/sysctl.d (read at every boot) and applies it. Run in a
    network namespace of its own (the TCP sysctls are per namespace) with a scratch folder bound over
    /etc/sysctl.d, so the host keeps its settings. Failed before: `sysctl -w` set the value until the
    next boot and nothing was written to /etc/sysctl.d (and the run stopped at pip, exit 1)."""
    if shutil.which("unshare") is None or not Path("/etc/sysctl.d").is_dir():
        pytest.skip("needs unshare (util-linux) and /etc/sysctl.d to run setup.sh as root away from the host")
    from geofed.orchestrator.config import load_config
    from geofed.orchestrator.launch.plan import build_plan
    from geofed.orchestrator.launch.render import setup_script

    made, _ = gpu_plan
    plan = build_plan(load_config(CONFIG, ["regions.device=cuda", "regions.num_gpus=1",
                                           f"launch.setup.venv={area / 'rootvenv'}"]))
    folder, etc = area / "rootplan", area / "sysctl.d"
    folder.mkdir()
    etc.mkdir()
    (folder / "setup.sh").write_text(setup_script(plan))
    shutil.copy(made / plan.wheel, folder / plan.wheel)
    proc = "/proc/sys/net/ipv4/tcp_slow_start_after_idle"
    host_before = SYSCTL_FILE.read_bytes() if SYSCTL_FILE.exists() else None
    inner = (f"mount --bind {etc} /etc/sysctl.d && echo 1 > {proc} && "
             f'bash {folder}/setup.sh worker-us-east-1 && echo "after: $(cat {proc})"')
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": str(area), "LANG": "C.UTF-8",
           "GEOFED_SETUP_DRY_RUN": "1", "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1"}
    probe = subprocess.run(["unshare", "--mount", "--net", "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"unshare --mount --net is not allowed here: {probe.stderr.strip()}")
    done = subprocess.run(["unshare", "--mount", "--net", "bash", "-c", inner], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (etc / "60-geofed.conf").read_text().splitlines()[1:] == ["net.ipv4.tcp_slow_start_after_idle = 0"]
    assert "net.ipv4.tcp_slow_start_after_idle set to 0 (was 1)" in done.stdout
    assert done.stdout.rstrip().endswith("after: 0")
    assert (SYSCTL_FILE.read_bytes() if SYSCTL_FILE.exists() else None) == host_before


def test_setup_as_nobody_with_the_default_venv_says_how_to_go_on(area):
    """The default venv (/opt/geofed/venv) is root's to create: without root or sudo setup.sh stops there,
    naming launch.setup.venv. Failed before with Python's own "Error: [Errno 13] Permission denied:
    '/opt/geofed'" from `python3.11 -m venv` (exit 1)."""
    from geofed.orchestrator.config import load_config
    from geofed.orchestrator.launch.plan import build_plan
    from geofed.orchestrator.launch.render import setup_script

    plan = build_plan(load_config(CONFIG))
    assert plan.venv == "/opt/geofed/venv"
    folder = area / "defaultplan"
    folder.mkdir()
    (folder / "setup.sh").write_text(setup_script(plan))
    done = _as_nobody(folder / "setup.sh", "head", path="/usr/local/bin:/usr/bin:/bin")
    assert done.returncode == 1, done.stdout + done.stderr
    assert ("/opt/geofed/venv: nobody cannot create it or write there and has no passwordless sudo; run setup.sh "
            "as root or with sudo, or set launch.setup.venv to a path this user can write") in done.stderr
