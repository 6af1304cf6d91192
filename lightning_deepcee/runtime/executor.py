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

Block values: a stage's output may be a tensor or a tuple/list/dict of tensors
(:mod:`~lightning_deepcee.runtime.values`). Its tensors travel one message each; the first
message to each peer carries the value's structure (and which tensors need a gradient), and
gradients come back for those tensors only. Both ends count the messages alike, so later steps
need no description, and receives can still be posted ahead.

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
from lightning_deepcee.runtime.measure.saved import SavedTensorsMeter
from lightning_deepcee.runtime.routing import Piece, Router
from lightning_deepcee.runtime.stage import Stage, batch_size_of, split_batch
from lightning_deepcee.runtime.transport import P2PTransport, PeerLostError
from lightning_deepcee.runtime.values import (
    Structure,
    decode_structure,
    detach_value,
    encode_structure,
    flatten_value,
    value_rows,
)
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
    peak_saved_bytes: int | None = None
    """The most bytes of tensors autograd held for backward at once during the step (each
    storage once, parameters and buffers excluded): the measured counterpart of the held part
    of ``Prediction.peak_memory_bytes``. ``None`` unless the executor runs with
    ``measure_saved=True``."""
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
    input: Any = None
    """The block value received from the previous stage."""
    input_tensors: list[torch.Tensor] | None = None
    """Its tensors that need a gradient (the ones the previous stage gets one for)."""
    output: torch.Tensor | None = None
    """The last stage's weighted loss; None on other stages (their output is below)."""
    output_tensors: list[torch.Tensor] | None = None
    output_structure: Structure | None = None
    output_grad: list[torch.Tensor] | None = None
    input_grad: list[torch.Tensor | None] | None = None
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
        measure_saved: track the bytes autograd saves for backward during each step
            (:class:`~lightning_deepcee.runtime.measure.SavedTensorsMeter`) and report their
            peak as ``StepStats.peak_saved_bytes``; costs a Python call per saved tensor.
    """

    def __init__(
        self,
        *,
        stage: Stage,
        actions: Sequence[Action],
        transport: P2PTransport,
        router: Router,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        input_fn: Callable[[Any], Any],
        rank: int,
        metrics_fn: Callable[[Any, Any], Mapping[str, torch.Tensor | float]] | None = None,
        keep_outputs: bool = False,
        measure_saved: bool = False,
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
        self.measure_saved = measure_saved
        self.last_outputs: list[tuple[int, int, Any]] = []
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
        self._sent: dict[int, Structure] = {}
        """The structure of the output value sent to each next-stage peer (sent once)."""
        self._received: dict[int, Structure] = {}
        """The structure of the input value received from each previous-stage peer."""
        self._runs = 0

    def run(
        self,
        microbatches: Sequence[Any],
        total_rows: int,
        *,
        forward_context: Callable[[], contextlib.AbstractContextManager[Any]] = (
            contextlib.nullcontext
        ),
        before_last_backward: Callable[[], None] | None = None,
    ) -> torch.Tensor | None:
        """Run the schedule once; returns the weighted loss sum on the last stage, else ``None``.

        ``microbatches`` are whole micro-batches (this rank takes its rows of each);
        ``total_rows`` is the step's sample count over all replicas, the loss denominator.
        Gradients accumulate into the stage parameters' ``.grad``. ``before_last_backward``
        runs right before the step's last action that computes weight gradients here (the
        stage copies' bucketed gradient sum arms its hooks then).
        """
        self.router.begin_step([batch_size_of(mb) for mb in microbatches])
        states = [self._state(k, mb, total_rows) for k, mb in enumerate(microbatches)]
        stats = StepStats()
        start, cpu_start = time.perf_counter(), time.thread_time()
        self.transport.records.clear()
        sources = self._sources(states) if self.transport.prefetch else []
        # The first step's messages cannot be counted ahead (structures travel in it): every
        # rank posts nothing then.
        self.transport.begin_step(self._kind, sources, post=self._runs > 0)
        self.last_metrics = {}
        self.last_outputs = []
        meter = self._saved_meter()
        with meter or contextlib.nullcontext():
            loss = self._run_actions(states, stats, forward_context, before_last_backward)
        if meter is not None:
            stats.peak_saved_bytes = meter.peak_bytes
        stats.seconds_by_kind["WAIT_SENDS"] += self.transport.wait_sends()
        self.transport.end_step()
        stats.wall_s = time.perf_counter() - start
        stats.cpu_s = time.thread_time() - cpu_start
        self.last_stats = stats
        self._runs += 1
        return loss

    def _saved_meter(self) -> SavedTensorsMeter | None:
        if not self.measure_saved:
            return None
        blocks = self.stage.blocks
        static = [t for block in blocks for t in (*block.parameters(), *block.buffers())]
        return SavedTensorsMeter(exclude=static)

    def _run_actions(
        self,
        states: Sequence[_MicroBatchState],
        stats: StepStats,
        forward_context: Callable[[], contextlib.AbstractContextManager[Any]],
        before_last_backward: Callable[[], None] | None = None,
    ) -> torch.Tensor | None:
        """Every action of the schedule, in order; the weighted loss sum on the last stage."""
        loss: torch.Tensor | None = None
        last_backward = -1  # where before_last_backward runs (looked up only when given)
        if before_last_backward is not None:
            last_backward = max(
                (
                    pos
                    for pos, a in enumerate(self.actions)
                    if a.kind in (K.W, K.BW) and states[a.microbatch].num_rows > 0
                ),
                default=-1,
            )
        for pos, action in enumerate(self.actions):
            st = states[action.microbatch]
            if st.num_rows == 0:
                continue  # this rank holds no rows of the micro-batch: nothing to do or send
            if pos == last_backward:
                assert before_last_backward is not None
                before_last_backward()
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
        return loss

    def _sources(self, states: Sequence[_MicroBatchState]) -> list[int]:
        """The sender of every message this step receives, in the order it receives them.

        Counted from the structures the first step exchanged; a peer whose messages this rank
        cannot count yet is left out (the transport then receives it as it comes).
        """
        sources = []
        first_sent = next(iter(self._sent.values()), None)
        grads = sum(first_sent.differentiable) if first_sent is not None else None
        for action in self.actions:
            st = states[action.microbatch]
            if st.num_rows == 0:
                continue
            if action.kind == K.RECV_F:
                for p in self.router.prev_pieces(st.index):
                    if p.peer in self._received:
                        sources += [p.peer] * self._received[p.peer].num_tensors
            elif action.kind == K.RECV_B and grads is not None:
                for p in self.router.next_pieces(st.index):
                    if p.peer in self._sent:
                        sources += [p.peer] * grads
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
            st.input, st.input_tensors = self._receive_value(st)
        elif kind == K.SEND_F:
            assert st.output_tensors is not None and st.output_structure is not None
            self._send_value(st.output_tensors, st.output_structure, st)
            if not torch.is_grad_enabled():
                st.output_tensors = None
        elif kind == K.RECV_B:
            assert st.output_structure is not None
            count = sum(st.output_structure.differentiable)
            st.output_grad = self._gather(
                self.router.next_pieces(st.index), self.stage.stage_index + 1, count
            )
        elif kind == K.SEND_B:
            assert st.input_tensors is not None
            grads = st.input_grad or [None] * len(st.input_tensors)
            self._scatter(
                [
                    g if g is not None else torch.zeros_like(t)
                    for g, t in zip(grads, st.input_tensors, strict=True)
                ],
                self.router.prev_pieces(st.index),
            )
            st.input_grad = None
            st.input = st.input_tensors = None
        elif kind == K.BW:
            self._backward_full(st)
        elif kind == K.B:
            self._backward_input(st)
        elif kind == K.W:
            self._backward_weight(st)
        return None

    def _recv(self, peer: int, peer_stage: int) -> torch.Tensor:
        try:
            return self.transport.recv(peer)
        except PeerLostError as exc:
            raise PeerLostError(
                exc.peer,
                f"lost rank {exc.peer} (stage {peer_stage}): it stopped answering; the device or "
                f"its link is down. {exc}",
            ) from exc

    def _receive_value(self, st: _MicroBatchState) -> tuple[Any, list[torch.Tensor]]:
        """The input value of micro-batch ``st`` from the previous stage's pieces, and its
        tensors that need a gradient (made leaves that require one, when training)."""
        peer_stage = self.stage.stage_index - 1
        pieces = self.router.prev_pieces(st.index)
        structure: Structure | None = None
        for p in pieces:
            if p.peer not in self._received:
                self._received[p.peer] = decode_structure(self._recv(p.peer, peer_stage))
            structure = self._received[p.peer]
        assert structure is not None
        tensors = self._gather(pieces, peer_stage, structure.num_tensors)
        wanted = []
        if torch.is_grad_enabled():
            for index, (t, grad) in enumerate(zip(tensors, structure.differentiable, strict=True)):
                if grad and t.is_floating_point():
                    tensors[index] = t.requires_grad_(True)
                    wanted.append(tensors[index])
        return structure.rebuild(tensors), wanted

    def _send_value(
        self, tensors: Sequence[torch.Tensor], structure: Structure, st: _MicroBatchState
    ) -> None:
        """Send this rank's output tensors to the next stage's pieces; the structure goes first
        to a peer that has not had it, and must not change afterwards."""
        for p in self.router.next_pieces(st.index):
            sent = self._sent.get(p.peer)
            if sent is None:
                self.transport.send(encode_structure(structure), p.peer)
                self._sent[p.peer] = structure
            elif sent != structure:
                raise ValueError(
                    f"the output of stage {self.stage.stage_index} (block "
                    f"{self.stage.block_range[1] - 1}) changed structure between micro-batches "
                    f"(first {sent.spec}, now {structure.spec}, or which tensors need gradients, "
                    "or its constants); a block must return the same kind of value every time."
                )
        self._scatter(list(tensors), self.router.next_pieces(st.index))

    def _gather(self, pieces: Sequence[Piece], peer_stage: int, count: int) -> list[torch.Tensor]:
        """``count`` tensors from each piece's peer, joined by rows piece after piece."""
        parts = [[self._recv(p.peer, peer_stage) for _ in range(count)] for p in pieces]
        if len(parts) == 1:
            return parts[0]
        return [torch.cat(list(column)) for column in zip(*parts, strict=True)]

    def _scatter(self, tensors: Sequence[torch.Tensor], pieces: Sequence[Piece]) -> None:
        for p in pieces:
            for tensor in tensors:
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
                what = f"the output of block {self.stage.block_range[1] - 1}"
                tensors, structure = flatten_value(y, what)
                if value_rows(y, what) != st.num_rows:
                    raise ValueError(
                        f"{what} has {value_rows(y, what)} rows for a micro-batch of "
                        f"{st.num_rows} samples; tensors passed between pipeline blocks keep "
                        "the samples as dimension 0."
                    )
                st.output_tensors, st.output_structure = tensors, structure
                return None
            if self.keep_outputs:
                self.last_outputs.append((st.index, st.first_row, detach_value(y)))
                return None
            loss = self.loss_fn(y, st.batch)
        if self.metrics_fn is not None:
            with torch.no_grad():
                for name, value in self.metrics_fn(detach_value(y), st.batch).items():
                    # Kept as tensors: reading them here would wait for the device every
                    # micro-batch; the strategy reads the step's sums once.
                    share = value * st.weight
                    self.last_metrics[name] = self.last_metrics.get(name, 0.0) + share
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"loss_fn must return a scalar tensor (the mean over the micro-batch), got {shape}."
            )
        st.output = loss.float() * st.weight
        return st.output.detach()

    def _roots(self, st: _MicroBatchState) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """What the backward of micro-batch ``st`` starts from: the weighted loss on the last
        stage; elsewhere the output tensors that need a gradient, with the arrived gradients."""
        if self.stage.is_last:
            assert st.output is not None
            return ([st.output] if st.output.requires_grad else []), None
        if st.output_tensors is None or st.output_structure is None:
            raise RuntimeError("backward before forward")
        roots = [
            t
            for t, grad in zip(st.output_tensors, st.output_structure.differentiable, strict=True)
            if grad
        ]
        if roots and st.output_grad is None:
            raise RuntimeError("backward before the output gradient arrived")
        return roots, st.output_grad if roots else None

    def _backward_full(self, st: _MicroBatchState) -> None:
        roots, grads = self._roots(st)
        if roots:
            torch.autograd.backward(roots, grads)
        if st.input_tensors is not None:
            st.input_grad = [t.grad for t in st.input_tensors]
        st.output = st.output_tensors = st.output_grad = None

    def _backward_input(self, st: _MicroBatchState) -> None:
        roots, grads = self._roots(st)
        if self.stage.is_first or not st.input_tensors or not roots:
            # Nothing upstream needs a gradient (or none flows): W runs the whole backward later.
            st.pending_full_backward = True
            return
        dinputs, st.param_groups = stage_backward_input(
            roots, grads, st.input_tensors, self._params()
        )
        st.input_grad = list(dinputs)
        st.output = st.output_tensors = st.output_grad = None

    def _backward_weight(self, st: _MicroBatchState) -> None:
        if st.pending_full_backward:
            st.pending_full_backward = False
            self._backward_full(st)
            return
        if st.param_groups is None:
            raise RuntimeError("W before its B")
        stage_backward_weight(self._params(), st.param_groups)
        st.param_groups = None
