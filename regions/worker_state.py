"""The evaluation and state half of RegionWorker (regions/worker.py): evaluating the live or
synchronised model, what a checkpoint holds, restoring it, and catching up from a peer.

A mixin: it works on the worker's attributes (cfg, region, run_dir, model, params, inner,
algorithm, exchanger, transport, task, precision, completed_round, _eval_model, _data_start,
batches_drawn) and on LocalSteps' _seek_data.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import torch

from geofed.p2p.admission import Refusal
from geofed.p2p.rejoin import STATE_DONORS, check_state, combine_states, fetch_checked_states

from . import checkpoint
from .export import result_state
from .sketch import count_sketch


class RegionState:
    """Evaluation, checkpoints and catch-up of one region."""

    def evaluate(self) -> dict[str, Any]:
        """The task's metric of the region's live model as it stands (evaluate_synced: the synchronised one)."""
        r = self.task.evaluate(self.model)
        return {"metric": r.metric, "value": r.value, "higher_is_better": r.higher_is_better}

    def evaluate_synced(self) -> dict[str, Any]:
        """The metric of the algorithm's synchronised model (DiLoCo: the global model after the
        last outer step) on a scratch copy: training state, RNG and an overlapped exchange in
        flight are left untouched, so a run trains the same model with or without evaluation."""
        return self.evaluate_params(self.algorithm.eval_params())

    def evaluate_params(self, params, *, restore_rng: bool = True) -> dict[str, Any]:
        """Evaluate `params` (in the model's parameter order) on a scratch copy of the model. Off
        the training thread pass restore_rng=False: the generator is shared with training, so a
        task's evaluate must draw nothing from it (the built-in tasks draw nothing)."""
        if self._eval_model is None:
            self._eval_model = copy.deepcopy(self.model)  # deepcopy draws no random numbers
        with torch.no_grad():
            for dst, src in zip([p for p in self._eval_model.parameters() if p.requires_grad], params):
                dst.copy_(src)
            for dst, src in zip(self._eval_model.buffers(), self.model.buffers()):
                dst.copy_(src)  # running statistics are the region's own (they are not synced)
        rng = torch.get_rng_state() if restore_rng else None
        try:
            r = self.task.evaluate(self._eval_model)
        finally:
            if rng is not None:
                torch.set_rng_state(rng)  # a task may sample while evaluating: training must not see it
        return {"metric": r.metric, "value": r.value, "higher_is_better": r.higher_is_better}

    def sketch(self) -> torch.Tensor:
        """A count sketch of the synchronised model (regions/sketch.py): 32 KiB, whatever its size."""
        return count_sketch(self.algorithm.eval_params(), seed=self.cfg.run.seed)

    def result_state(self) -> dict[str, torch.Tensor]:
        """The region's result as a state_dict: the algorithm's eval_params (DiLoCo: the global
        model) over the model's buffers (regions/export.py)."""
        return result_state(self.model, self.algorithm.eval_params())

    def get_params(self) -> list[torch.Tensor]:
        """Detached copies of the trainable parameters, in host memory (the driver may have no GPU)."""
        return [p.detach().to("cpu", copy=True) for p in self.params]

    def state_dict(self) -> dict[str, Any]:
        """Everything a restore needs to go on exactly: model, inner optimizer, algorithm, exchanger (codec
        and link state), the data stream's position and the global RNG.
        """
        return {"round": self.completed_round, "model": self.model.state_dict(), "inner": self.inner.state_dict(),
                "algorithm": self.algorithm.state_dict(), "exchanger": self.exchanger.state_dict(),
                "data": {"start": self._data_start, "drawn": self.batches_drawn},
                "torch_rng": torch.get_rng_state(), "precision": self.precision.state_dict()}  # dropout and other draws from the global generator

    def state_bytes(self) -> bytes:
        """What FetchState serves to a rejoining peer: the model and the algorithm's shared state."""
        buf = io.BytesIO()
        torch.save({"round": self.completed_round, "model": self.model.state_dict(),
                    "algorithm": self.algorithm.state_dict()}, buf)
        return buf.getvalue()

    def catch_up(self, peers: list[str], *, timeout_s: float | None = None,
                 before_round: int | None = None, rounds_apart: int | None = None) -> tuple[str, int]:
        """Pull current parameters from `peers` (FetchState; each joiner tries the donors in its own
        order, so rejoins spread across peers); returns (donor, round of its state).

        A donor is one member and may be hostile (issue 36, N1): each state is checked like an
        update (p2p/rejoin.py check_state: layout, finite, security.max_update_value, distance to
        this region's own state within the norm rule, per round apart); a refused one is counted
        (`bad_state`) and the next donor asked. Where regions share one model (DiLoCo, all-reduce)
        up to three donors are asked and their coordinate-wise median taken (the donor reported is
        the one closest to it). `rounds_apart`: how many rounds this region's state may lag the
        donors' (default: the rounds between its completed round and theirs, at least 1); the
        distance bound is the norm rule's x (rounds apart + 1 + resyncs failed since the last good one).

        The region's own inner optimizer, codec states and data position stay (they are its own,
        not the model's); the state is checked whole before any of it is loaded."""
        timeout_s = self.cfg.sync.deadline.max_s if timeout_s is None else timeout_s
        mailbox = getattr(self.transport, "mailbox", None)
        if before_round is not None and mailbox is not None:
            mailbox.look_ahead(before_round)  # its peers push that round while this fetch runs
        own = self._shared_state()
        want = STATE_DONORS if self.cfg.sync.algorithm in ("diloco", "allreduce") else 1
        try:
            got = fetch_checked_states(self.transport, peers, timeout_s=timeout_s, want=want,
                                       check=lambda peer, data: self._checked_state(peer, data, own, rounds_apart),
                                       on_refused=self._count_bad_state)
        except ValueError:
            # The region goes on drifting from the donors while its resyncs fail: the next check
            # allows one round more per failure (reset by a resync that succeeds).
            self._failed_resyncs = getattr(self, "_failed_resyncs", 0) + 1
            raise
        self._failed_resyncs = 0
        index, state = combine_states([s for _, s in got], own)
        peer = got[index][0]
        # An overlapped exchange from before (the round before an absence) must not be applied on
        # top of the state taken now: finish it here; the donor's state then replaces its result.
        self.finish_pending()
        try:
            round_ = int(state["round"])
            self.model.load_state_dict(state["model"])
            self.algorithm.load_state_dict(state["algorithm"])
        except Exception as exc:  # noqa: BLE001 - a bad donor must not take the region down with it
            raise ValueError(f"state from {peer} is unusable: {exc}") from None
        # Queued ahead of round `before_round`, the donor may have finished that round meanwhile: the
        # region still runs it (its mailbox stays open for it), from the newer model.
        self._set_completed(round_ if before_round is None else min(round_, before_round - 1))
        return peer, self.completed_round

    def _shared_state(self) -> dict[str, Any]:
        """This region's own counterpart of a donor's state (what state_bytes serves), for the check."""
        return {"round": self.completed_round, "model": self.model.state_dict(), "algorithm": self.algorithm.state_dict()}

    def _checked_state(self, peer: str, data: bytes, own: dict[str, Any], rounds_apart: int | None) -> dict[str, Any]:
        """A donor's FetchState bytes loaded (tensors only) and checked against `own`; Refusal `bad_state` if not fit."""
        try:
            state = checkpoint.load_tensors(data, what=f"state from {peer}")  # refuses code, in our words
        except checkpoint.CheckpointError as exc:
            raise Refusal("bad_state", str(exc)) from None
        try:
            donor_round = int(state["round"])
        except (TypeError, KeyError, ValueError):
            raise Refusal("bad_state", f"the state from {peer} has no round") from None
        bound = self.admission.bound()
        apart = rounds_apart if rounds_apart is not None else donor_round - self.completed_round
        if bound is not None:
            # An honest region that missed an update in the round it resyncs after drifted by that
            # round's mix, and its outer step and momentum carry the difference on: one round more
            # than the rounds it lags (x1 refused an honest donor at 1.31 x it in bench attack),
            # and every resync that failed since the last good one a round more. Twice that: both
            # sides move while they are apart (an outage, a round alone), so their honest distance is
            # up to two updates a round (the short soak refused honest donors at 1.06x the one-sided
            # bound and left a region on its own model); a random state still lies far beyond it.
            bound *= 2 * (max(1, apart) + 1 + getattr(self, "_failed_resyncs", 0))
        check_state(state, own, max_value=self.cfg.security.max_update_value, bound=bound, donor=peer)
        return state

    def _count_bad_state(self, peer: str, refusal: Refusal) -> None:
        """A refused donor state, counted with the region's refusals (metrics.jsonl, summary.json)."""
        mailbox = getattr(self.transport, "mailbox", None)
        if mailbox is not None:
            mailbox.count_refusal(refusal, peer, self.completed_round)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s state and take up the run after its round (the data stream replays to the
        same batch)."""
        self.model.load_state_dict(state["model"])
        self.inner.load_state_dict(state["inner"])
        self.algorithm.load_state_dict(state["algorithm"])
        self.exchanger.load_state_dict(state.get("exchanger", {}))
        self._seek_data(state["data"]["start"], int(state["data"]["drawn"]))
        torch.set_rng_state(state["torch_rng"])
        self.precision.load_state_dict(state.get("precision") or {})
        self._set_completed(int(state["round"]))

    def _set_completed(self, round_: int) -> None:
        """Take up the run at `round_`: the mailbox closes every round up to it, so peers pushing
        round_ + 1 are inside its window at once (a fresh mailbox would call them future rounds)."""
        self.completed_round = round_
        # Peers still finishing (or re-sending) the rounds around this one are refused `late`, and a
        # resumed run's first round runs cold: expected, so logged quietly on both sides.
        self.exchanger.quiet_late_upto = round_ + 1
        if getattr(self.transport, "mailbox", None) is not None:
            self.transport.mailbox.quiet_late_upto = round_ + 1
        closed = self.transport.stats().get("closed_upto", -1)
        if round_ > closed:
            self.transport.mailbox.expect(round_, [])
            self.transport.receive(round_, 0.0)

    def save_checkpoint(self) -> str:
        """Write the state of the completed round atomically under RUN_DIR/checkpoints/<region>/ and keep
        the newest run.keep_checkpoints; returns the file's path.
        """
        d = self.run_dir / "checkpoints" / self.region
        path = checkpoint.checkpoint_path(d, self.completed_round)
        checkpoint.save_atomic(path, self.state_dict())
        checkpoint.prune(d, self.cfg.run.keep_checkpoints)
        return str(path)

    def restore_checkpoint(self, at_most: int | None = None) -> dict[str, Any]:
        """Load the newest verified checkpoint (<= at_most). Returns {"round": its round, or -1
        when there is none, "skipped": [why, ...] for newer files that failed verification}."""
        skipped: list[str] = []
        found = checkpoint.load_latest(self.run_dir / "checkpoints" / self.region, at_most=at_most,
                                       on_skip=lambda path, why: skipped.append(why))
        if found is None:
            return {"round": -1, "skipped": skipped}
        self.load_state_dict(found[1])
        return {"round": found[0], "skipped": skipped}

