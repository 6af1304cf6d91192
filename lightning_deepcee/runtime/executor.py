"""The executor: runs one rank's lowered action list for one training (or evaluation) step.

It dispatches on the action kind and never decides order. The B/W split uses torch's own
``stage_backward_input`` / ``stage_backward_weight`` (torch.distributed.pipelining): B computes
the input gradient and keeps the intermediate gradients the weights need; W finishes the weight
gradients later from those, so splitting costs no recomputation. The first stage has no input
gradient to send, so its B is empty and its W runs the whole backward.

Rows: a :class:`~lightning_deepcee.runtime.routing.Router` says which rows of each micro-batch
this rank holds (all of them in a plain pipeline; a share of them when devices of a stage split
the work) and which pieces travel to which neighbour. A rank holding no rows of a micro-batch
skips it.

Gradient exactness: the rows this rank holds of a micro-batch, ``n`` of the step's ``N`` samples
(over every replica), have their mean loss scaled by ``n / N`` before backward, so gradients
summed over micro-batches, devices and replicas equal the gradient of the whole-batch mean loss,
whatever the (uneven) splits.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.profiler import record_function

from lightning_deepcee._compat import stage_backward_input, stage_backward_weight
from lightning_deepcee.runtime.routing import Piece, Router
from lightning_deepcee.runtime.stage import Stage, batch_size_of, split_batch
from lightning_deepcee.runtime.transport import P2PTransport, PeerLostError
from lightning_deepcee.schedule import Action, ActionKind, render

__all__ = ["PipelineExecutionError", "PipelineExecutor", "StepStats"]

K = ActionKind


class PipelineExecutionError(RuntimeError):
    """An action failed; the message shows this rank's schedule with the failing action marked."""


@dataclass
class StepStats:
    """Timings of one step on this rank, in seconds, by action kind."""

    seconds_by_kind: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    wall_s: float = 0.0
    timeline: list[tuple[Action, float, float]] = field(default_factory=list)
    """Every action run, as ``(action, start, end)`` in ``time.perf_counter()`` seconds (the
    monotonic clock, shared by the processes of one host): the measured counterpart of the
    simulator's timeline."""
    cpu_s_by_kind: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """This thread's CPU seconds (``time.thread_time``) inside each action kind: on a device
    held back by a CPU quota, wall time in an action is CPU plus stall, and only CPU is work."""
    cpu_s: float = 0.0
    """This thread's CPU seconds over the whole step (actions, and the work between them)."""
    grad_sync_s: float = 0.0
    """Wall seconds of the all-reduce that sums the stage's gradients over the devices sharing
    it (data parallelism inside a stage; 0 on a stage with one device). Set by
    ``DeepCEEStrategy.training_step`` after the executor ran: the measured counterpart of the
    cost model's ``Prediction.allreduce_s``."""

    @property
    def compute_s(self) -> float:
        return sum(self.seconds_by_kind.get(k.value, 0.0) for k in (K.F, K.B, K.W, K.BW))

    @property
    def transfer_s(self) -> float:
        return sum(
            self.seconds_by_kind.get(k.value, 0.0) for k in (K.SEND_F, K.RECV_F, K.SEND_B, K.RECV_B)
        ) + self.seconds_by_kind.get("WAIT_SENDS", 0.0)


@dataclass
class _MicroBatchState:
    batch: Any = None
    index: int = 0
    first_row: int = 0
    num_rows: int = 0
    weight: float = 1.0
    input: torch.Tensor | None = None
    output: torch.Tensor | None = None
    output_grad: torch.Tensor | None = None
    input_grad: torch.Tensor | None = None
    param_groups: list[dict[str, Any]] | None = None
    pending_full_backward: bool = False


class PipelineExecutor:
    """Runs ``actions`` (this rank's lowered schedule) for ``stage``.

    Args:
        stage: the local blocks.
        actions: the rank's lowered schedule.
        transport: point-to-point transport.
        router: rows and pieces exchanged with the neighbouring stages.
        loss_fn / input_fn / metrics_fn: from the model's :class:`PipelineSpec`.
        rank: this rank, for error messages.
        keep_outputs: prediction: keep the last stage's outputs, compute no loss.
    """

    def __init__(
        self,
        *,
        stage: Stage,
        actions: Sequence[Action],
        transport: P2PTransport,
        router: Router,
        loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
        input_fn: Callable[[Any], torch.Tensor],
        rank: int,
        metrics_fn: Callable[[torch.Tensor, Any], Mapping[str, torch.Tensor | float]] | None = None,
        keep_outputs: bool = False,
    ) -> None:
        self.stage = stage
        self.actions = list(actions)
        self.transport = transport
        self.router = router
        self.loss_fn = loss_fn
        self.input_fn = input_fn
        self.metrics_fn = metrics_fn
        self.rank = rank
        self.keep_outputs = keep_outputs
        self.last_outputs: list[tuple[int, int, torch.Tensor]] = []
        """``keep_outputs`` (prediction): the last stage's outputs of the last step, as
        ``(micro-batch index, first row, output)``."""
        self.last_metrics: dict[str, torch.Tensor | float] = {}
        """This rank's share of the last step's metrics: each micro-batch's mean weighted by
        its rows here over the step's rows (summed over ranks: the whole batch's mean)."""
        self.last_stats = StepStats()
        # Training and evaluation steps exchange different messages: the transport keeps the
        # payload sizes of each kind apart (its receive-ahead slots).
        training = any(a.kind in (K.B, K.W, K.BW) for a in self.actions)
        self._kind = "train" if training else "predict" if keep_outputs else "eval"

    def run(
        self,
        microbatches: Sequence[Any],
        total_rows: int,
        *,
        forward_context: Callable[[], contextlib.AbstractContextManager[Any]] = (
            contextlib.nullcontext
        ),
    ) -> torch.Tensor | None:
        """Run the schedule once; returns the weighted loss sum on the last stage, else ``None``.

        ``microbatches`` are whole micro-batches (this rank takes its rows of each);
        ``total_rows`` is the step's sample count over all replicas, the loss denominator.
        Gradients accumulate into the stage parameters' ``.grad``.
        """
        self.router.begin_step([batch_size_of(mb) for mb in microbatches])
        states = [self._state(k, mb, total_rows) for k, mb in enumerate(microbatches)]
        stats = StepStats()
        start, cpu_start = time.perf_counter(), time.thread_time()
        self.transport.records.clear()
        sources = self._sources(states) if self.transport.prefetch else []
        self.transport.begin_step(self._kind, sources)
        loss: torch.Tensor | None = None
        self.last_metrics = {}
        self.last_outputs = []
        for pos, action in enumerate(self.actions):
            st = states[action.microbatch]
            if st.num_rows == 0:
                continue  # this rank holds no rows of the micro-batch: nothing to do or send
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                with record_function(f"deepcee:{action}"):
                    out = self._dispatch(action, st, forward_context)
            except Exception as exc:
                raise PipelineExecutionError(
                    f"rank {self.rank}, stage {self.stage.stage_index}: action {action} "
                    f"(position {pos}) failed: {type(exc).__name__}: {exc}\n"
                    f"{render({self.rank: self.actions}, mark=(self.rank, pos))}"
                ) from exc
            t1 = time.perf_counter()
            stats.seconds_by_kind[action.kind.value] += t1 - t0
            stats.cpu_s_by_kind[action.kind.value] += time.thread_time() - c0
            stats.timeline.append((action, t0, t1))
            if out is not None:
                loss = out if loss is None else loss + out
        stats.seconds_by_kind["WAIT_SENDS"] += self.transport.wait_sends()
        self.transport.end_step()
        stats.wall_s = time.perf_counter() - start
        stats.cpu_s = time.thread_time() - cpu_start
        self.last_stats = stats
        return loss

    def _sources(self, states: Sequence[_MicroBatchState]) -> list[int]:
        """The sender of every message this step receives, in the order it receives them."""
        sources = []
        for action in self.actions:
            st = states[action.microbatch]
            if st.num_rows == 0:
                continue
            if action.kind == K.RECV_F:
                sources += [p.peer for p in self.router.prev_pieces(st.index)]
            elif action.kind == K.RECV_B:
                sources += [p.peer for p in self.router.next_pieces(st.index)]
        return sources

    def _state(self, index: int, microbatch: Any, total_rows: int) -> _MicroBatchState:
        rows = batch_size_of(microbatch)
        start, end = self.router.my_rows(index)
        local = microbatch
        if (start, end) != (0, rows):
            local = split_batch(microbatch, [start, end - start, rows - end])[1]
        return _MicroBatchState(
            batch=local,
            index=index,
            first_row=start,
            num_rows=end - start,
            weight=(end - start) / total_rows,
        )

    def _params(self) -> Iterator[torch.nn.Parameter]:
        return iter(self.stage.parameters())

    def _dispatch(
        self,
        action: Action,
        st: _MicroBatchState,
        forward_context: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> torch.Tensor | None:
        kind = action.kind
        if kind == K.F:
            return self._forward(st, forward_context)
        if kind == K.RECV_F:
            x = self._gather(self.router.prev_pieces(st.index), self.stage.stage_index - 1)
            st.input = x.requires_grad_(torch.is_grad_enabled() and x.is_floating_point())
        elif kind == K.SEND_F:
            assert st.output is not None
            self._scatter(st.output, self.router.next_pieces(st.index))
            if not torch.is_grad_enabled():
                st.output = None
        elif kind == K.RECV_B:
            st.output_grad = self._gather(
                self.router.next_pieces(st.index), self.stage.stage_index + 1
            )
        elif kind == K.SEND_B:
            assert st.input is not None
            grad = st.input_grad if st.input_grad is not None else torch.zeros_like(st.input)
            self._scatter(grad, self.router.prev_pieces(st.index))
            st.input_grad = None
            st.input = None
        elif kind == K.BW:
            self._backward_full(st)
        elif kind == K.B:
            self._backward_input(st)
        elif kind == K.W:
            self._backward_weight(st)
        return None

    def _gather(self, pieces: Sequence[Piece], peer_stage: int) -> torch.Tensor:
        try:
            parts = [self.transport.recv(p.peer) for p in pieces]
        except PeerLostError as exc:
            raise PeerLostError(
                exc.peer,
                f"lost rank {exc.peer} (stage {peer_stage}): it stopped answering; the device or "
                f"its link is down. {exc}",
            ) from exc
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _scatter(self, tensor: torch.Tensor, pieces: Sequence[Piece]) -> None:
        for p in pieces:
            whole = p.start == 0 and p.end == tensor.shape[0]
            self.transport.send(tensor if whole else tensor[p.start : p.end], p.peer)

    def _forward(
        self,
        st: _MicroBatchState,
        forward_context: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> torch.Tensor | None:
        x = self.input_fn(st.batch) if self.stage.is_first else st.input
        if x is None:
            raise RuntimeError("forward before the stage input arrived")
        with forward_context():
            y = self.stage.forward(x)
            if not self.stage.is_last:
                st.output = y
                return None
            if self.keep_outputs:
                self.last_outputs.append((st.index, st.first_row, y.detach()))
                return None
            loss = self.loss_fn(y, st.batch)
        if self.metrics_fn is not None:
            with torch.no_grad():
                for name, value in self.metrics_fn(y.detach(), st.batch).items():
                    # Kept as tensors: reading them here would wait for the device every
                    # micro-batch; the strategy reads the step's sums once.
                    share = value * st.weight
                    self.last_metrics[name] = self.last_metrics.get(name, 0.0) + share
        if loss.dim() != 0:
            raise ValueError(
                f"loss_fn must return a scalar (the mean over the micro-batch), got shape "
                f"{tuple(loss.shape)}."
            )
        st.output = loss.float() * st.weight
        return st.output.detach()

    def _grad_outputs(self, st: _MicroBatchState) -> torch.Tensor | None:
        if self.stage.is_last:
            return None
        if st.output_grad is None:
            raise RuntimeError("backward before the output gradient arrived")
        return st.output_grad

    def _backward_full(self, st: _MicroBatchState) -> None:
        assert st.output is not None
        if st.output.requires_grad:
            torch.autograd.backward(st.output, self._grad_outputs(st))
        if st.input is not None:
            st.input_grad = st.input.grad
        st.output = st.output_grad = None

    def _backward_input(self, st: _MicroBatchState) -> None:
        assert st.output is not None
        if self.stage.is_first or st.input is None or not st.input.requires_grad:
            # Nothing upstream needs a gradient: W runs the whole backward later.
            st.pending_full_backward = True
            return
        grad_out = self._grad_outputs(st)
        dinputs, st.param_groups = stage_backward_input(
            [st.output], None if grad_out is None else [grad_out], [st.input], self._params()
        )
        st.input_grad = dinputs[0]
        st.output = st.output_grad = None

    def _backward_weight(self, st: _MicroBatchState) -> None:
        if st.pending_full_backward:
            st.pending_full_backward = False
            self._backward_full(st)
            return
        if st.param_groups is None:
            raise RuntimeError("W before its B")
        stage_backward_weight(self._params(), st.param_groups)
        st.param_groups = None
