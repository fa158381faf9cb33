"""What the driver can tell about regions.device before anything starts.

On a local run (no ``ray.address``, no ``--address``) the regions' node is this machine, so a
GPU the config asks for and this machine lacks is a bad config (exit 2), not a placement error
after Ray has started. On a cluster only the region's node knows (regions/device.py says so there).
"""

from __future__ import annotations

from . import RunConfig


def local_device_problem(cfg: RunConfig) -> str | None:
    """One line naming the key when a local run asks for a GPU this machine does not have; else None."""
    rc = cfg.regions
    if cfg.ray.address or not (rc.device.startswith("cuda") or rc.num_gpus > 0):
        return None
    import torch  # only now: `geofed validate` of a CPU config stays fast

    if not torch.cuda.is_available():
        key = "regions.device" if rc.device.startswith("cuda") else "regions.num_gpus"
        value = rc.device if key == "regions.device" else rc.num_gpus
        return (f"{key}: {value!r} asks for a GPU, but this machine (a local run's only node) has none "
                f"(torch.cuda.is_available() is False); use regions.device: cpu or auto and regions.num_gpus: 0")
    n = torch.cuda.device_count()
    if ":" in rc.device and int(rc.device.split(":")[1]) >= n:
        return f"regions.device: {rc.device!r} but this machine has {n} CUDA device(s)"
    return None
