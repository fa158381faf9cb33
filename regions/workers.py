"""The workers inside one region (`regions.workers: N`, docs/regions-as-clusters.md).

A region of N workers is N Ray actors placed alike (the region's label, its CPUs and GPUs each):
worker 0 is the region's own actor (regions/actor.py: RegionActor), the one the driver talks to;
workers 1..N-1 are RegionWorkerActor there, each a Region that only trains. They form one torch.distributed process group inside the region
(gloo on the CPU, nccl on cuda) through a TCP store that worker 0 opens on its own node at a port
the OS picks; the driver hands its address to the others. Nothing of it crosses the WAN, and no
port is fixed.

Worker 0 leads, the others follow its commands over the group:

- STEP, every inner step (with the plan's learning-rate scale): each worker draws its own batch
  (every N-th of the region's data stream: `split`), runs forward and backward, the gradients (and
  the loss) are averaged over the group with `dist.all_reduce`, and each takes the same optimizer
  step, so the workers' models stay bitwise equal, as DDP's do. A region of N workers thus
  trains on N x sync.inner.batch_size examples a step.
- SYNC, at the end of each round: worker 0 alone ran the round's exchange and outer step, and
  broadcasts its model (one flat tensor per dtype).
- STATE, in place of SYNC, or before the next step, when worker 0's state changed beyond a step
  and the model (a catch-up, a restore, a rollback, an exchange finished between rounds): its
  whole `Region.state_dict()` (inner optimizer, algorithm, data position) by
  `dist.broadcast_object_list`.
- CHECK, at each checkpoint of worker 0: every worker's model digest (SHA-256 of its tensors'
  bytes) gathered, and a GroupError naming those that differ from worker 0's, instead of a
  checkpoint that stands for models the region does not hold.
- STOP, when the region closes.

With regions.shard_exchange (regions/shards.py) the exchange is sharded: worker 0's SHARD (with the
round's plan) starts every worker's exchange of its shard over its own gRPC server; the mixed shards
are gathered (one broadcast from each worker) and every worker takes the same outer step, so SYNC
then sends only the model's buffers. PEERS hands each follower its shard's peers (ShardPeers).
Without it worker 0 sends and receives the region's whole update.

A worker that dies (a SIGKILL, an OOM kill) breaks every collective of the others: gloo sees the
closed connection at once, and a collective that hears nothing gives up at regions.group_timeout_s
(the group's timeout), so no call waits without a deadline. Each survivor's collective then raises
GroupLost and leaves the group; the driver counts the region as failed and rebuilds it
(orchestrator/driver/regroup.py): worker 0 in a fresh process, the survivors joining the new group,
worker 0's whole state broadcast before the first step (`join(..., rebuilt=True)`).
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

STEP, SYNC, STATE, CHECK, STOP, SHARD, PEERS = 1, 2, 3, 4, 5, 6, 7


class GroupError(RuntimeError):
    """A region's workers could not form their process group (or lost it), named by region and worker."""


class GroupLost(GroupError):
    """A collective failed (a worker of the region died, or one passed regions.group_timeout_s): this
    worker left the group. Not a fault of the run: the driver fails the region and rebuilds its group."""


class WorkerGroup:
    """One worker's side of its region's process group: rank `rank` of `size`, in `region`.

    Worker 0 (the leader) calls `open`, `join`, then `lead_step` each inner step and `lead_sync` at
    the end of each round; the others call `join` then `follow`. A process holds one such group
    (torch.distributed's default group: one region worker is one actor process).
    """

    def __init__(self, region: str, rank: int, size: int, *, timeout_s: float, sharded: bool = False):
        assert 0 <= rank < size and size >= 2, (rank, size)
        self.region, self.rank, self.size = region, rank, size
        # regions.shard_exchange: each worker exchanges its shard over its own server (regions/shards.py)
        self.sharded = sharded
        self.shard_addresses: list[str | None] = []  # every worker's gRPC address, gathered at join (sharded)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = torch.device("cpu")
        self.joined = False
        self._store: Any = None
        self._stale = False

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def who(self) -> str:
        return f"region {self.region}: worker {self.rank} of {self.size}"

    # -- forming the group ----------------------------------------------------------------
    def open(self, host: str) -> str:
        """Worker 0: the group's TCP store on this node, at a port the OS picks; its HOST:PORT."""
        assert self.leader
        self._store = dist.TCPStore(host, 0, world_size=self.size, is_master=True, timeout=self.timeout,
                                    wait_for_workers=False)
        return f"{host}:{self._store.port}"

    def join(self, address: str, device: torch.device, *, rebuilt: bool = False, serves: str | None = None,
             node_ip: str | None = None) -> None:
        """Join the group at `address` (worker 0's `open`) within regions.group_timeout_s; GroupError
        naming the region and this worker otherwise. A first all_reduce checks every worker is in.
        `rebuilt` (a group formed again after a worker died): worker 0's first command is its whole
        state, since the survivors hold whatever their last step left and a new worker its seed's model.
        `serves` (sharded): this worker's gRPC address, gathered by every worker (worker 0 hands them to the driver).
        `node_ip`: this worker's node address (Ray's), which gloo's connections must use (_gloo_interface)."""
        self.device = device
        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "gloo" and node_ip:
            _gloo_interface(node_ip)
        host, _, port = address.rpartition(":")
        t0 = time.monotonic()
        try:
            store = self._store if self.leader else dist.TCPStore(host, int(port), world_size=self.size, is_master=False,
                                                                  timeout=self.timeout)
            dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.size, timeout=self.timeout)
            count = torch.ones(1, device=device)
            dist.all_reduce(count)
            if int(count.item()) != self.size:
                raise RuntimeError(f"{int(count.item())} workers answered")
            if self.sharded:
                gathered: list[Any] = [None] * self.size
                dist.all_gather_object(gathered, serves)
                self.shard_addresses = list(gathered)
        except Exception as exc:  # noqa: BLE001 - said once, in the region's words
            self._destroy()
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise GroupError(f"{self.who()} did not join the region's process group ({backend}) at {address} "
                             f"within {self.timeout.total_seconds():g}s (regions.group_timeout_s; waited "
                             f"{time.monotonic() - t0:.1f}s): {detail}") from None
        self.joined = True
        self._stale = self._stale or (rebuilt and self.leader)

    def close(self) -> None:
        """Worker 0 tells the others to stop; every worker leaves the group. Best effort: a worker
        already gone must not keep the region from closing."""
        if self.joined and self.leader:
            try:
                self._command(STOP)
            except Exception:  # noqa: BLE001 - the others may be dead already
                pass
        self._destroy()

    def _destroy(self) -> None:
        self.joined = False
        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = None

    # -- the data ----------------------------------------------------------------------------
    def split(self, stream: Iterator[Any]) -> Iterator[Any]:
        """This worker's batches of the region's stream: every N-th from its rank (each worker draws
        the whole stream, so each knows where it is with one count, as a restore replays it)."""
        return itertools.islice(stream, self.rank, None, self.size)

    # -- worker 0's side ------------------------------------------------------------------------
    def mark_stale(self) -> None:
        """Worker 0's state changed beyond its steps and model: its next broadcast is the whole state."""
        self._stale = True

    def lead_step(self, region: Any, lr_scale: float) -> None:
        """Before each of worker 0's inner steps: the others take one too (its state first, if stale)."""
        self._check_joined()
        with self._collective("an inner step"):
            if self._stale:
                self._send_state(region)
            self._command(STEP, lr_scale)

    def lead_sync(self, region: Any) -> None:
        """At the end of worker 0's round: the others take its model (its whole state, if stale)."""
        self._check_joined()
        with self._collective("the round's model broadcast"):
            if self._stale:
                self._send_state(region)
                return
            self._command(SYNC)
            if self.sharded:  # every worker took the same outer step (regions/shards.py): its buffers only
                self._broadcast_buffers(region.model)
            else:
                self._broadcast_model(region.model)

    def lead_shard(self, plan: Any, metrics: dict[str, Any]) -> None:
        """Worker 0, after the round's inner steps: every worker starts its shard's exchange of `plan`,
        with the steps' metrics (the payload hooks read them: pacing's step weight)."""
        self._check_joined()
        with self._collective("the start of the sharded exchange"):
            if self._stale:  # lead_step sent it before the round's first step: a round without one is a bug
                raise GroupError(f"{self.who()}: its state changed after the round's steps, before its shard exchange")
            self._command(SHARD)
            dist.broadcast_object_list([(plan, dict(metrics))], src=0, device=self._object_device())

    def lead_peers(self, peers: Any) -> None:
        """Worker 0: each follower connects to worker k of every peer region (a ShardPeers, between rounds)."""
        self._check_joined()
        with self._collective("the shard peers' addresses"):
            self._command(PEERS)
            dist.broadcast_object_list([peers], src=0, device=self._object_device())

    def gather_shards(self, flat: torch.Tensor, bounds: list[tuple[int, int]]) -> None:
        """Every worker's shard into every worker's `flat` (on this group's device), in place: worker k
        holds its own in `flat[bounds[k][0]:bounds[k][1]]` and the others' arrive there, one broadcast
        from each (the shards' sizes differ, which all_gather does not allow)."""
        with self._collective("the gather of the mixed shards"):
            for k, (a, b) in enumerate(bounds):
                dist.broadcast(flat[a:b], src=k)

    def gather_metrics(self, own: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Every worker's exchange metrics, on worker 0 (None on the others)."""
        every: list[Any] = [None] * self.size
        with self._collective("the gather of the shard exchanges' metrics"):
            dist.all_gather_object(every, own)
        return every if self.leader else None

    def check(self, region: Any) -> None:
        """Worker 0, at a checkpoint: every worker holds its model bitwise, or GroupError naming who does not."""
        self._check_joined()
        with self._collective("the checkpoint's digest check"):
            if self._stale:
                self._send_state(region)
            self._command(CHECK)
            differ = self._compare(region.model)
        if differ:
            raise GroupError(f"region {self.region}: worker(s) {', '.join(map(str, differ))} of {self.size} hold "
                             f"another model than worker 0's (the workers' steps went apart)")

    def _compare(self, model: torch.nn.Module) -> list[int]:
        """Every worker's model digest gathered; the ranks whose digest is not worker 0's."""
        digests: list[Any] = [None] * self.size
        dist.all_gather_object(digests, _digest(model))
        return [k for k, d in enumerate(digests) if d != digests[0]]

    def _send_state(self, region: Any) -> None:
        self._command(STATE)
        dist.broadcast_object_list([region.state_dict()], src=0, device=self._object_device())
        self._stale = False


    def _command(self, op: int, arg: float = 0.0) -> None:
        dist.broadcast(torch.tensor([float(op), arg], dtype=torch.float64, device=self.device), src=0)

    def _check_joined(self) -> None:
        if not self.joined:  # lost: a collective failed before, and the driver has not formed it again yet
            raise GroupLost(f"{self.who()} holds no process group: its region's group was lost, or never formed")

    @contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        """Collectives of this worker: one that fails (a worker died: gloo's closed connection, or
        regions.group_timeout_s passed) leaves the group and raises GroupLost, in the region's words."""
        try:
            yield
        except GroupError:
            raise
        except Exception as exc:  # noqa: BLE001 - gloo's and nccl's errors have no common type
            self._destroy()
            raise GroupLost(f"{self.who()} lost its region's process group during {what}: {_first_line(exc)}") from None

    # -- every worker -------------------------------------------------------------------------
    def average_grads(self, params: list[torch.Tensor], loss: torch.Tensor) -> float:
        """After backward: every parameter's gradient, and the loss, averaged over the region's
        workers (one all_reduce per dtype of a flat copy); the region's mean loss."""
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params] + [loss.detach().reshape(1).to(params[0].dtype)]
        with self._collective("the gradient all_reduce"):
            for group in _by_dtype(grads):
                flat = torch.cat([g.reshape(-1) for g in group])
                dist.all_reduce(flat)
                flat.div_(self.size)
                for g, piece in zip(group, flat.split([g.numel() for g in group])):
                    g.copy_(piece.view_as(g))
        return float(grads[-1].item())

    def _broadcast_model(self, model: torch.nn.Module) -> None:
        """Worker 0's model state (parameters and buffers) into every worker's, a flat tensor per dtype."""
        for group in _by_dtype(list(model.state_dict().values())):
            if self.leader:
                flat = torch.cat([t.reshape(-1) for t in group])
            else:
                flat = torch.empty(sum(t.numel() for t in group), dtype=group[0].dtype, device=group[0].device)
            dist.broadcast(flat, src=0)
            if not self.leader:
                for t, piece in zip(group, flat.split([t.numel() for t in group])):
                    t.copy_(piece.view_as(t))

    def _broadcast_buffers(self, model: torch.nn.Module) -> None:
        """Worker 0's buffers (running statistics) and frozen parameters into every worker's: what the
        workers' own steps do not keep equal (each saw its own batches)."""
        tensors = [t.detach() for t in model.buffers()] + [p.detach() for p in model.parameters() if not p.requires_grad]
        for group in _by_dtype(tensors):
            flat = torch.cat([t.reshape(-1) for t in group]) if self.leader else \
                torch.empty(sum(t.numel() for t in group), dtype=group[0].dtype, device=group[0].device)
            dist.broadcast(flat, src=0)
            if not self.leader:
                for t, piece in zip(group, flat.split([t.numel() for t in group])):
                    t.copy_(piece.view_as(t))

    def _object_device(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None

    # -- workers 1..N-1 -------------------------------------------------------------------------
    def follow(self, region: Any) -> int:
        """A follower's whole run: worker 0's commands until STOP; the steps it took."""
        self._check_joined()
        steps = 0
        try:
            while True:
                cmd = torch.zeros(2, dtype=torch.float64, device=self.device)
                dist.broadcast(cmd, src=0)
                op, arg = int(cmd[0].item()), float(cmd[1].item())
                if op == STEP:
                    region.forward_backward()
                    region.optimizer_step(arg)
                    steps += 1
                elif op == SYNC:
                    if self.sharded:
                        self._broadcast_buffers(region.model)
                    else:
                        self._broadcast_model(region.model)
                elif op == SHARD:
                    plan_box: list[Any] = [None]
                    dist.broadcast_object_list(plan_box, src=0, device=self._object_device())
                    _shard_round(region, *plan_box[0])
                elif op == PEERS:
                    peers_box: list[Any] = [None]
                    dist.broadcast_object_list(peers_box, src=0, device=self._object_device())
                    region.connect(peers_box[0].for_rank(self.rank))
                elif op == STATE:
                    box: list[Any] = [None]
                    dist.broadcast_object_list(box, src=0, device=self._object_device())
                    region.load_state_dict(box[0])
                elif op == CHECK:
                    self._compare(region.model)
                elif op == STOP:
                    return steps
                else:
                    raise GroupError(f"{self.who()}: unknown command {op} from worker 0")
        except GroupLost as exc:
            raise GroupLost(f"{exc} (after {steps} steps)") from None
        except GroupError:
            raise
        except Exception as exc:  # noqa: BLE001 - worker 0 gone, a collective past its deadline
            raise GroupLost(f"{self.who()} lost its region's process group after {steps} steps: {_first_line(exc)}") from None
        finally:
            self._destroy()


def _gloo_interface(node_ip: str) -> None:
    """Gloo's connections leave from the address this host's name resolves to; where that is a loopback
    address while the node's own (Ray's) is not (nodes in network namespaces that share one hostname,
    a host whose name maps to 127.0.1.1), the workers of other nodes would be told to dial 127.0.0.1.
    GLOO_SOCKET_IFNAME (read when a group is made) then names the interface that holds the node's
    address. A value the user set is kept."""
    import ipaddress
    import os
    import socket

    if os.environ.get("GLOO_SOCKET_IFNAME") or ipaddress.ip_address(node_ip).is_loopback:
        return
    try:
        resolved = socket.gethostbyname(socket.gethostname())
    except OSError:
        resolved = "127.0.0.1"
    if not ipaddress.ip_address(resolved).is_loopback:
        return
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == node_ip for a in addrs):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return


def _shard_round(region: Any, plan: Any, metrics: dict[str, Any]) -> None:
    """A follower's part of worker 0's round `plan` (regions/shards.py): its shard's exchange. Its
    mailbox first takes up the run where worker 0's is (after a restore or a rejoin, worker 0's
    state came with STATE; a new worker's mailbox would call the round a future one)."""
    if plan.members is not None:
        region.set_members(plan.members)
    if region.completed_round < plan.round - 1:
        region.take_up(plan.round - 1)
    region.algorithm.exchange_shard(plan, metrics)
    region.completed_round = plan.round


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _digest(model: torch.nn.Module) -> str:
    """SHA-256 of the model's state (names, dtypes, shapes and bytes), read on the host."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().to("cpu").reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors in groups of one dtype and device, in order of first appearance."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())
