"""Test helpers for the policy tests: a full mesh of link estimates and one round's measurements."""

from geofed.orchestrator.policies import LinkEstimate, Measurements


def mesh(bw, rtt=0.08, n=4):
    """Full mesh of n regions; bw is one number or a function of the link name."""
    names = [f"r{i}" for i in range(n)]
    return {f"{a}->{b}": LinkEstimate(bandwidth_bps=bw(f"{a}->{b}") if callable(bw) else bw, rtt_s=rtt)
            for a in names for b in names if a != b}


def measurements(round_, links, *, numel, step=0.01, overlap=False, last_sync=None):
    return Measurements(now_s=float(round_), round=round_, step_time_s=step, loss=1.0, lr=1e-3, lr0=1e-3,
                        model_numel=numel, links=links, overlap=overlap, last_sync_s=last_sync)
