"""measure_blocks (single process): lengths, bytes, B/W split, and no side effects on the model."""

from __future__ import annotations

import itertools
import time
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from lightning_deepcee.runtime.measure import (
    BlockTimings,
    available_memory_bytes,
    measure_blocks,
    model_fingerprint,
    round_robin_rounds,
)
from lightning_deepcee.runtime.measure.blocks import _median_timings, _merged_ratio, fit_passes
from lightning_deepcee.runtime.measure.cluster import _device_profile
from lightning_deepcee.runtime.measure.passes import block_inputs, time_pass


def _mlp() -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Linear(8, 32),
        nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Dropout(0.5), nn.Tanh()),
        nn.Linear(64, 5),
    ]


def _snapshot(blocks: list[nn.Module]) -> list[torch.Tensor]:
    return [
        t.detach().clone() for b in blocks for t in itertools.chain(b.parameters(), b.buffers())
    ]


def _assert_untouched(blocks: list[nn.Module], before: list[torch.Tensor]) -> None:
    after = _snapshot(blocks)
    assert len(after) == len(before)
    for a, b in zip(after, before, strict=True):
        assert torch.equal(a, b)
    assert all(p.grad is None for b in blocks for p in b.parameters())


def test_mlp_times_bytes_and_no_side_effects() -> None:
    blocks = _mlp()
    before = _snapshot(blocks)
    sample = torch.randn(6, 8)
    rng_before = torch.random.get_rng_state()
    t = measure_blocks(blocks, sample, repeats=3, warmup=1)
    assert isinstance(t, BlockTimings)
    assert t.num_blocks == 3 and t.microbatch_size == 6
    for name in ("forward_s", "backward_input_s", "backward_weight_s"):
        assert len(getattr(t, name)) == 3
    assert all(0 < f < 1 for f in t.forward_s)
    # Block 0's input is the data: no input gradient, its whole backward counts as W.
    assert t.backward_input_s[0] == 0
    assert all(0 < b < 1 for b in t.backward_input_s[1:])
    assert all(0 < w < 1 for w in t.backward_weight_s)
    assert t.activation_bytes == (32 * 4, 64 * 4, 5 * 4)
    assert t.parameter_bytes == ((8 * 32 + 32) * 4, (32 * 64 + 64 + 2 * 64) * 4, (64 * 5 + 5) * 4)
    # The whole backward in one call: positive, never more than B + W.
    assert len(t.backward_s) == 3
    for merged, b, w in zip(t.backward_s, t.backward_input_s, t.backward_weight_s, strict=True):
        assert 0 < merged <= b + w
    _assert_untouched(blocks, before)
    assert torch.equal(torch.random.get_rng_state(), rng_before)


def test_optimizer_rate_times_an_adam_step_on_the_largest_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    blocks = _mlp()
    before = _snapshot(blocks)
    adam_step = torch.optim.Adam.step
    stepped: list[int] = []

    def slow_step(self: torch.optim.Adam, *args: Any, **kwargs: Any) -> Any:
        params = [p for group in self.param_groups for p in group["params"]]
        assert all(p.grad is not None and bool(p.grad.any()) for p in params)  # not all zero
        stepped.append(sum(p.numel() for p in params))
        time.sleep(0.005)
        return adam_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", slow_step)
    t = measure_blocks(blocks, torch.randn(6, 8), repeats=3, warmup=1, sustain_s=0.0)
    largest = max(t.parameter_bytes)
    assert set(stepped) == {largest // 4}  # clones of the largest block's parameters only
    assert len(stepped) == 1 + 1 + 3  # state creation, warm-up, timed repeats
    assert 0.005 <= t.optimizer_s_per_byte * largest < 0.5
    _assert_untouched(blocks, before)  # the model's own parameters are not stepped
    assert (
        measure_blocks(
            [nn.ReLU(), nn.Tanh()], torch.randn(4, 8), sustain_s=0.0
        ).optimizer_s_per_byte
        == 0.0
    )


class _Sleepy(nn.Module):
    """A linear layer whose forward also sleeps: a fixed per-call cost the batch cannot shrink.

    Every ``stall_every``-th forward sleeps ``stall_s`` more, like a CPU quota that throttles a
    process once it has run for a while: medians of single calls miss it, sustained runs do not.
    """

    def __init__(self, sleep_s: float, stall_every: int = 0, stall_s: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.sleep_s, self.stall_every, self.stall_s = sleep_s, stall_every, stall_s
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        time.sleep(self.sleep_s)
        if self.stall_every and self.calls % self.stall_every == 0:
            time.sleep(self.stall_s)
        return self.linear(x)


def test_fixed_cost_and_sustained_factor() -> None:
    blocks: list[nn.Module] = [_Sleepy(0.004), _Sleepy(0.0)]
    t = measure_blocks(blocks, torch.randn(16, 8), repeats=5, warmup=1, sustain_s=0.0)
    assert len(t.fixed_s) == 2 and t.sustained_factor == 1.0
    # The 4 ms sleep is fixed: block 0's intercept holds it; block 1 has almost no fixed cost.
    assert 0.003 < t.fixed_s[0] <= t.forward_s[0] + t.backward_weight_s[0]
    assert t.fixed_s[1] < 0.003
    stalled: list[nn.Module] = [_Sleepy(0.001, stall_every=3, stall_s=0.01)]
    s = measure_blocks(stalled, torch.randn(16, 8), repeats=5, warmup=1, sustain_s=0.2)
    # Bursts take ~1 ms; one call in three stalls 10 ms more, so passes average >= 4 ms.
    assert s.sustained_factor > 2.0
    assert s.forward_s[0] > 0.003
    # Too small for a second size: no fixed part is measured.
    assert measure_blocks(_mlp(), torch.randn(2, 8), repeats=1, warmup=0).fixed_s == ()


class _StallsAtFullSize(nn.Module):
    """A block whose every call on the full micro-batch stalls (a quota period spent)."""

    def __init__(self, rows: int, stall_s: float) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.rows, self.stall_s = rows, stall_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(x) == self.rows:
            time.sleep(self.stall_s)
        return self.linear(x)


def test_a_block_stalled_in_every_repeat_is_bounded_by_its_small_size_time() -> None:
    """The fastest of the repeats still carries the stall; the small size bounds it (x4)."""
    blocks: list[nn.Module] = [_StallsAtFullSize(16, 0.05), _Sleepy(0.002)]
    t = measure_blocks(blocks, torch.randn(16, 8), repeats=3, warmup=1, sustain_s=0.0)
    assert t.forward_s[0] < 0.02  # 4 x the unstalled 4-row forward, far below the 50 ms stall
    # The stall no longer inflates the burst sum the sustained factor divides by.
    s = measure_blocks(blocks, torch.randn(16, 8), repeats=3, warmup=1, sustain_s=0.3)
    assert s.sustained_factor > 2.0  # the sustained passes do pay the stall


class _Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(50, 12)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids)


class _MeanHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(12, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.mean(dim=1))


def test_embedding_model_with_loss() -> None:
    torch.manual_seed(0)
    blocks: list[nn.Module] = [_Embed(), nn.Sequential(nn.Linear(12, 12), nn.GELU()), _MeanHead()]
    existing = torch.ones(7, 12)
    blocks[2].proj.weight.grad = existing  # a pre-existing gradient must come back as it was
    ids = torch.randint(0, 50, (4, 10))
    targets = torch.randint(0, 7, (4,))
    before = _snapshot(blocks)
    t = measure_blocks(
        blocks,
        ids,
        loss_fn=lambda out, batch: nn.functional.cross_entropy(out, batch[1]),
        sample_batch=(ids, targets),
        repeats=2,
        warmup=1,
    )
    assert t.backward_input_s[0] == 0 and t.backward_weight_s[0] > 0
    assert all(v > 0 for v in t.forward_s + t.backward_input_s[1:] + t.backward_weight_s)
    assert t.activation_bytes == (10 * 12 * 4, 10 * 12 * 4, 7 * 4)
    assert t.parameter_bytes == (50 * 12 * 4, (12 * 12 + 12) * 4, (12 * 7 + 7) * 4)
    assert blocks[2].proj.weight.grad is existing
    blocks[2].proj.weight.grad = None
    _assert_untouched(blocks, before)


def test_parameterless_block_and_arguments() -> None:
    blocks: list[nn.Module] = [nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)]
    t = measure_blocks(blocks, torch.randn(2, 3), repeats=1, warmup=0)
    assert t.parameter_bytes[1] == 0 and t.activation_bytes == (16, 16, 8)
    with pytest.raises(ValueError, match="repeats: expected a positive integer, got 0"):
        measure_blocks(blocks, torch.randn(2, 3), repeats=0)
    with pytest.raises(ValueError, match=r"at least one nn\.Module, got 0"):
        measure_blocks([], torch.randn(2, 3))
    with pytest.raises(ValueError, match="sample_batch: required with loss_fn"):
        measure_blocks(blocks, torch.randn(2, 3), loss_fn=lambda o, b: o.sum())


class _StalledRound(nn.Module):
    """A linear layer whose forward sleeps ``stall_s`` on calls ``first`` to ``last - 1``."""

    def __init__(self, first: int = 0, last: int = 0, stall_s: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.first, self.last, self.stall_s = first, last, stall_s
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first <= self.calls < self.last:
            time.sleep(self.stall_s)
        self.calls += 1
        return self.linear(x)


def test_rounds_take_every_figure_at_its_median() -> None:
    """A device throttled through one whole round (a low reading of its quota) is outvoted."""
    options: dict[str, Any] = dict(repeats=3, warmup=1, sustain_s=0.0)
    probe = _StalledRound()
    measure_blocks([probe, nn.Linear(8, 8)], torch.randn(16, 8), **options)
    per_round = probe.calls  # forward calls of one round (no sustained window: a fixed count)
    probe.calls = 0
    measure_blocks([probe, nn.Linear(8, 8)], torch.randn(16, 8), rounds=2, **options)
    later = probe.calls - per_round  # a later round reuses the first round's bytes: fewer calls
    assert 0 < later < per_round
    stalled = _StalledRound(first=per_round, last=per_round + later, stall_s=0.05)
    blocks: list[nn.Module] = [stalled, nn.Linear(8, 8)]
    once = measure_blocks(blocks, torch.randn(16, 8), **options)  # round 1: no stall
    assert once.forward_s[0] < 0.01
    alone = measure_blocks(blocks, torch.randn(16, 8), **options)  # round 2: all stalled
    assert alone.forward_s[0] > 0.04
    stalled.calls = 0
    t = measure_blocks(blocks, torch.randn(16, 8), rounds=3, **options)
    assert stalled.calls == per_round + 2 * later  # three whole rounds ran
    assert t.forward_s[0] < 0.01  # the median of three, not their mean (about 17 ms)
    assert t.activation_bytes == once.activation_bytes and len(t.fixed_s) == 2
    with pytest.raises(ValueError, match="rounds: expected a positive integer, got 0"):
        measure_blocks(blocks, torch.randn(16, 8), rounds=0)


def test_median_of_rounds_keeps_each_fixed_part_within_its_block() -> None:
    """F, B and W medians from different rounds can sum under the median fixed part; the fixed
    part is capped at that sum."""

    def timing(f: float, b: float, w: float, fixed: float) -> BlockTimings:
        return BlockTimings(
            forward_s=(f, 1.0),
            backward_input_s=(b, 1.0),
            backward_weight_s=(w, 1.0),
            activation_bytes=(4, 4),
            parameter_bytes=(8, 8),
            microbatch_size=8,
            fixed_s=(fixed, 0.5),
        )

    # Each round keeps fixed <= its own F+B+W (3, 3, 0); the medians are F=1, B=0, W=1, fixed=3.
    rounds = [timing(1.0, 0.0, 2.0, 3.0), timing(2.0, 0.0, 1.0, 3.0), timing(0.0, 0.0, 0.0, 0.0)]
    merged = _median_timings(rounds)
    assert merged.forward_s == (1.0, 1.0) and merged.backward_weight_s == (1.0, 1.0)
    assert merged.fixed_s == (2.0, 0.5)  # capped at 1 + 0 + 1; block 1 keeps its median
    # What failed on CI: the device profile built from those timings must be valid.
    profile = _device_profile(0, "h", {"timings": merged, "kind": "cpu", "memory_bytes": 1 << 30})
    assert profile.fixed_s == merged.fixed_s


@pytest.mark.parametrize("num_ranks", range(1, 10))
def test_round_robin_rounds_cover_every_pair_once(num_ranks: int) -> None:
    rounds = round_robin_rounds(num_ranks)
    expected_rounds = 0 if num_ranks == 1 else num_ranks - 1 + num_ranks % 2  # 1 rank: no pairs
    assert len(rounds) == expected_rounds
    pairs = [pair for r in rounds for pair in r]
    assert sorted(pairs) == list(itertools.combinations(range(num_ranks), 2))
    for r in rounds:
        ranks = [rank for pair in r for rank in pair]
        assert len(ranks) == len(set(ranks))  # disjoint pairs
        assert len(r) == num_ranks // 2


def test_available_memory_and_fingerprint() -> None:
    assert available_memory_bytes("cpu") > 2**20
    assert model_fingerprint(_mlp()) == model_fingerprint(_mlp())
    assert model_fingerprint(_mlp()) != model_fingerprint([nn.Linear(8, 33), *_mlp()[1:]])


class _Traced(nn.Linear):
    """A linear block that logs its forward (F), input gradient (B) and weight gradient (W)."""

    def __init__(self, index: int, log: list[str]) -> None:
        super().__init__(4, 4)
        self.index, self.log = index, log
        self.weight.register_hook(lambda grad: self.log.append(f"W{self.index}") or grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(f"F{self.index}")
        if x.requires_grad:
            x.register_hook(lambda grad: self.log.append(f"B{self.index}") or grad)
        return super().forward(x)


def test_blocks_are_timed_in_a_pipeline_stages_order() -> None:
    # Every F, then every B (last block first), then every W: how a stage runs them, so a
    # block's B and W find their tensors after other work, not still in cache from its F.
    log: list[str] = []
    blocks = [_Traced(i, log) for i in range(3)]
    measure_blocks(blocks, torch.randn(4, 4), repeats=1, warmup=0, sustain_s=0)
    # Every forward in a row starts a pass: the first makes each block's input, the next is the
    # first timed pass (the memory pass between them runs each block's forward and backward).
    starts = [i for i in range(len(log)) if log[i : i + 3] == ["F0", "F1", "F2"]]
    timed = log[starts[1] :]
    first_pass = timed[: timed.index("W0") + 1]
    assert first_pass == ["F0", "F1", "F2", "B2", "B1", "W2", "W1", "W0"], log


def test_a_merged_pass_runs_each_blocks_whole_backward_in_one_call() -> None:
    blocks = _mlp()
    inputs = block_inputs(blocks, torch.randn(6, 8))

    def run(merged: bool) -> tuple[list[tuple[float, float, float]], list[torch.Tensor]]:
        for block in blocks:
            block.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the same dropout masks and output gradients in both passes
        times = time_pass(blocks, inputs, None, None, merged=merged)
        return times, [p.grad.clone() for b in blocks for p in b.parameters() if p.grad is not None]

    split_times, split_grads = run(False)
    merged_times, merged_grads = run(True)
    assert all(b > 0 for _, b, _ in split_times[1:])
    assert all(b == 0 and w > 0 for _, b, w in merged_times)
    assert len(merged_grads) == len(split_grads) == 8
    for merged, split in zip(merged_grads, split_grads, strict=True):
        torch.testing.assert_close(merged, split)


def test_the_merged_ratio_is_the_median_over_blocks_with_an_input_gradient() -> None:
    split = [(1.0, 0.0, 2.0), (1.0, 1.0, 1.0), (1.0, 1.0, 1.0), (1.0, 1.0, 1.0)]
    # Block 0 has no B (its split is one call already); block 3's merged reading was stalled.
    merged = [(1.0, 0.0, 2.0), (1.0, 0.0, 1.7), (1.0, 0.0, 1.6), (1.0, 0.0, 9.0)]
    assert _merged_ratio(merged, split) == pytest.approx(0.85)
    assert _merged_ratio(merged[:1], split[:1]) == 1.0
    assert _merged_ratio([(1.0, 0.0, 3.0)] * 4, split) == 1.0  # never more than B + W


# Blocks passing block values: hidden states with a bool mask and a float gate the next block uses.
_T, _H = 6, 12


def _pack(kind: str, hidden: torch.Tensor, mask: torch.Tensor, gate: torch.Tensor) -> Any:
    if kind == "tuple":
        return (hidden, mask, gate)
    return {"h": hidden, "mask": mask, "gate": gate, "causal": True, "note": None}


def _unpack(kind: str, value: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if kind == "tuple":
        hidden, mask, gate = value
        return hidden, mask, gate
    assert value["causal"] is True and value["note"] is None  # constants come through
    return value["h"], value["mask"], value["gate"]


class _EmbedMasked(nn.Module):
    """Block 0: ``(ids, mask)`` in; hidden states, the mask and a float gate out."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.embedding = nn.Embedding(50, _H)
        self.gate = nn.Linear(_H, 1)

    def forward(self, value: tuple[torch.Tensor, torch.Tensor]) -> Any:
        ids, mask = value
        hidden = self.embedding(ids)
        return _pack(self.kind, hidden, mask, torch.sigmoid(self.gate(hidden)).squeeze(-1))


class _MaskedMix(nn.Module):
    """A middle block: uses hidden states, mask and gate; passes the mask on, makes a new gate.

    Logs the ``requires_grad`` of each input it is timed on, and whether a gradient reached
    the gate (``B`` must differentiate every floating-point input, not only the first)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.linear = nn.Linear(_H, _H)
        self.seen: set[tuple[bool, bool, bool]] = set()
        self.gate_grads = 0

    def forward(self, value: Any) -> Any:
        hidden, mask, gate = _unpack(self.kind, value)
        self.seen.add((hidden.requires_grad, mask.requires_grad, gate.requires_grad))
        if gate.requires_grad:
            gate.register_hook(self._count)
        mixed = torch.tanh(self.linear(hidden)) * gate.unsqueeze(-1) * mask.unsqueeze(-1)
        return _pack(self.kind, mixed, mask, gate * 0.5 + 0.25)

    def _count(self, grad: torch.Tensor) -> None:
        self.gate_grads += 1


class _MaskedHead(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.proj = nn.Linear(_H, 7)

    def forward(self, value: Any) -> torch.Tensor:
        hidden, mask, gate = _unpack(self.kind, value)
        weights = (mask.float() * gate).unsqueeze(-1)
        return self.proj((hidden * weights).sum(1) / weights.sum(1).clamp_min(1e-6))


def _masked_model(kind: str) -> list[nn.Module]:
    torch.manual_seed(0)
    return [_EmbedMasked(kind), _MaskedMix(kind), _MaskedMix(kind), _MaskedHead(kind)]


@pytest.mark.parametrize("kind", ["tuple", "dict"])
@pytest.mark.parametrize("with_loss", [False, True])
def test_blocks_passing_tuples_and_dicts_are_measured(kind: str, with_loss: bool) -> None:
    blocks = _masked_model(kind)
    before = _snapshot(blocks)
    ids = torch.randint(0, 50, (8, _T))
    mask = torch.rand(8, _T) > 0.3
    targets = torch.randint(0, 7, (8,))
    options: dict[str, Any] = dict(repeats=2, warmup=1, sustain_s=0.0)
    if with_loss:
        options.update(
            loss_fn=lambda out, batch: nn.functional.cross_entropy(out, batch[2]),
            sample_batch=(ids, mask, targets),
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the quarter-size slice of every block value works
        t = measure_blocks(blocks, (ids, mask), **options)
    assert t.num_blocks == 4 and t.microbatch_size == 8 and len(t.fixed_s) == 4
    assert all(f > 0 for f in t.forward_s)
    assert t.backward_input_s[0] == 0  # block 0's input is data
    assert all(b > 0 for b in t.backward_input_s[1:])
    assert all(w > 0 for w in t.backward_weight_s)
    # Per sample: float32 hidden states, a bool mask and a float32 gate, constants free.
    value_bytes = _T * _H * 4 + _T * 1 + _T * 4
    assert t.activation_bytes == (value_bytes, value_bytes, value_bytes, 7 * 4)
    for block in blocks[1:3]:
        assert isinstance(block, _MaskedMix)
        # Timed with gradients on the floating-point leaves only, never on the bool mask
        # (the untimed pass that builds the inputs runs without gradients).
        assert block.seen == {(False, False, False), (True, False, True)}
        assert block.gate_grads > 0
    _assert_untouched(blocks, before)


class _ReturnsObject(nn.Module):
    def forward(self, x: torch.Tensor) -> object:
        return type("Opaque", (), {"x": x})()


class _ReturnsTupleWithObject(nn.Module):
    def forward(self, x: torch.Tensor) -> object:
        return (x, {"extra": object()})


class _DropsRows(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x[:1]


def test_a_block_value_that_is_not_tensors_names_the_block() -> None:
    sample = torch.randn(4, 3)
    with pytest.raises(TypeError, match=r"the output of blocks\[1\] \(_ReturnsObject\) holds"):
        measure_blocks([nn.Linear(3, 3), _ReturnsObject(), nn.Linear(3, 3)], sample)
    with pytest.raises(
        TypeError, match=r"blocks\[0\] \(_ReturnsTupleWithObject\) holds a object at \[1\]"
    ):
        measure_blocks([_ReturnsTupleWithObject(), nn.Identity()], sample)
    with pytest.raises(ValueError, match=r"blocks\[0\] \(_DropsRows\) has tensors whose first"):
        measure_blocks([_DropsRows(), nn.Identity()], sample)
    with pytest.raises(TypeError, match="sample_input holds a"):
        measure_blocks([nn.Identity()], (sample, object()))
    with pytest.raises(ValueError, match="sample_input: expected a tensor"):
        measure_blocks([nn.Identity()], {"n": 3})


@pytest.mark.parametrize(
    ("budget_s", "pass_s", "sleep_s", "expected"),
    [
        (100.0, 0.1, 0.0, (3, 5, 2)),  # a round costs 10.5 + 4.5 + 5 sustained passes: 2 s
        (40.0, 1.0, 0.0, (2, 5, 2)),  # a round costs 17 passes: two fit, three do not
        (30.0, 1.0, 0.0, (1, 5, 2)),
        (13.0, 1.0, 0.0, (1, 4, 0)),  # one round: 4 timed passes cost 6 + 3.6 + 2 = 11.6
        (8.4, 1.0, 0.0, (1, 2, 1)),  # two timed passes and one warm-up: 4.5 + 1.8 + 2 = 8.3
        (10.0, 1.0, 0.5, (1, 2, 0)),  # 6.8 passes and 6 sleeps of 0.5 s: 9.8
        (5.0, 1.0, 0.0, (1, 1, 0)),  # one timed pass: 1.5 + 0.9 + 2 = 4.4; two would cost 6.8
        (1.0, 1.0, 0.0, (1, 1, 0)),  # never below one round of one repeat
    ],
)
def test_fit_passes_cuts_rounds_then_repeats(
    budget_s: float, pass_s: float, sleep_s: float, expected: tuple[int, int, int]
) -> None:
    assert fit_passes(budget_s, pass_s, 3, 5, 2, sustain_s=0.5, sleep_s=sleep_s) == expected


def _fit_seconds(fit: tuple[int, int, int], pass_s: float, sleep_s: float) -> float:
    """What :func:`fit_passes` charges ``(rounds, repeats, warmup)`` with ``sustain_s=1``."""
    n, r, w = fit
    passes = (w + r) * 1.5 + 0.9 * r + max(2.0, 1.0 / pass_s)
    return n * (passes * pass_s + ((w + r) * 2 + r) * sleep_s)


def test_fit_passes_fits_the_budget_whenever_one_round_of_one_can() -> None:
    grid = itertools.product((1.0, 5.0, 12.0, 40.0, 200.0), (0.05, 0.5, 2.0), (0.0, 0.05))
    for budget_s, pass_s, sleep_s in grid:
        fit = fit_passes(budget_s, pass_s, 3, 5, 2, sustain_s=1.0, sleep_s=sleep_s)
        if _fit_seconds((1, 1, 0), pass_s, sleep_s) <= budget_s:
            assert _fit_seconds(fit, pass_s, sleep_s) <= budget_s + 1e-9
        rounds, repeats, warmup = fit
        assert 1 <= rounds <= 3 and 1 <= repeats <= 5 and 0 <= warmup <= 2


def test_a_budget_cuts_the_passes_of_a_slow_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_deepcee.runtime.measure.blocks as blocks_module
    import lightning_deepcee.runtime.measure.passes as passes_module

    calls = [0]
    real = passes_module.time_pass

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(blocks_module, "time_pass", counted)
    monkeypatch.setattr(passes_module, "time_pass", counted)
    blocks: list[nn.Module] = [_Sleepy(0.05), _Sleepy(0.05)]  # a pass takes >= 100 ms
    before = _snapshot(blocks)
    full = measure_blocks(blocks, torch.randn(16, 8), rounds=1, sustain_s=0.0)
    unbounded = calls[0]
    calls[0] = 0
    cut = measure_blocks(blocks, torch.randn(16, 8), rounds=3, sustain_s=0.0, budget_s=0.3)
    # The probe, then one round of one repeat (no warmup) at two sizes and one merged pass.
    assert calls[0] == 1 + 1 * 2 + 1 < unbounded
    assert cut.num_blocks == full.num_blocks and len(cut.fixed_s) == 2
    for mine, reference in zip(cut.forward_s, full.forward_s, strict=True):
        assert 0.5 * reference < mine < 2 * reference
    _assert_untouched(blocks, before)
    with pytest.raises(ValueError, match="budget_s"):
        measure_blocks(blocks, torch.randn(16, 8), budget_s=0.0)


def test_a_budget_counts_what_was_spent_before_the_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_deepcee.runtime.measure.blocks as blocks_module

    given: list[float] = []
    real = blocks_module.fit_passes

    def recorded(budget_s: float, *args: Any, **kwargs: Any) -> tuple[int, int, int]:
        given.append(budget_s)
        return real(budget_s, *args, **kwargs)

    monkeypatch.setattr(blocks_module, "fit_passes", recorded)
    blocks: list[nn.Module] = [_Sleepy(0.05), _Sleepy(0.05)]
    measure_blocks(blocks, torch.randn(16, 8), rounds=3, sustain_s=0.0, budget_s=5.0)
    # The forward that makes the inputs, the memory pass and the probe: 3 x 2 forwards of 50 ms.
    assert len(given) == 1 and given[0] <= 5.0 - 0.3


def test_passes_start_at_random_phases_under_a_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_deepcee.runtime.measure.passes as passes_module
    from lightning_deepcee.runtime.measure.passes import block_fastest, block_inputs

    slept: list[float] = []
    monkeypatch.setattr(passes_module.time, "sleep", slept.append)
    blocks = _mlp()
    inputs = block_inputs(blocks, torch.randn(6, 8))
    block_fastest(blocks, inputs, None, None, repeats=3, warmup=1, jitter_s=0.1)
    assert len(slept) == 4 and all(0 <= s <= 0.1 for s in slept) and len(set(slept)) == 4
    slept.clear()
    block_fastest(blocks, inputs, None, None, repeats=3, warmup=1)
    assert slept == []
