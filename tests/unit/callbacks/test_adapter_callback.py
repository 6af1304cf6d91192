"""DynamicEnvironmentAdapter's wiring in one process: its arguments, what one step's all-reduce
carries, and its checkpointed state. (Its decisions on synthetic streams:
``test_adapter_decisions.py``.)"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_deepcee import DeepCEEStrategy, DynamicEnvironmentAdapter
from lightning_deepcee.adapter.exchange import Exchanged, check_agreement
from lightning_deepcee.planner import Plan
from lightning_deepcee.runtime.executor import StepStats
from lightning_deepcee.runtime.transport import TransferRecord
from tests.helpers.plans import hand_plan


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"split_gain": 1.0}, "split_gain must be in"),
        ({"replan_gain": -0.1}, "replan_gain must be in"),
        ({"confirm_gain": 1.0}, "min_gain"),
        ({"confirm_window": 0}, "window"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"calibration_quantile": 1.5}, "calibration_quantile"),
        ({"compute_band_quantile": 0.3}, "compute_band_quantile"),
        ({"fast_threshold": 2.0}, "fast_threshold < slow_threshold"),
    ],
)
def test_arguments_are_checked(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DynamicEnvironmentAdapter(**kwargs)


def _plan(idle: tuple[int, ...] = ()) -> Plan:
    return hand_plan(
        [((0, 1), (0, 1), (0.5, 0.5)), ((1, 2), (2,), (1.0,))],
        idle_ranks=idle,
        global_batch_size=8,
        predicted_step_time_s=0.0,
        model_fingerprint="m",
    )


class _Rank(DeepCEEStrategy):
    """Rank ``rank`` of ``world`` in a run of ``_plan()`` (ranks 0-2 train), with given
    transfers; no processes."""

    def __init__(self, records: list[TransferRecord], rank: int = 2, world: int = 3) -> None:
        super().__init__()
        self.stage_part.plan = _plan(tuple(range(3, world)))
        self.stage_part.num_microbatches = 2
        self._records, self._rank, self._world = records, rank, world

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def global_rank(self) -> int:
        return self._rank

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def transfer_records(self) -> list[TransferRecord]:
        return self._records

    def set_num_microbatches(self, num_microbatches: int) -> None:
        self.stage_part.num_microbatches = num_microbatches


def test_one_all_reduce_carries_the_pairs_wire_time_step_time_and_proposals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    records = [
        TransferRecord(0, 1 << 20, 5.0, "recv", wire_s=0.5),  # 0->2: counted on the wire
        TransferRecord(0, 1 << 20, 5.0, "recv", wire_s=0.25),  # ... twice in the step
        TransferRecord(1, 1000, 0.1, "recv", wire_s=0.01),  # 1->2: under min_bytes
        TransferRecord(1, 1 << 20, 0.1, "recv", wire_s=None),  # no wire time: not counted
        TransferRecord(0, 1 << 20, 0.3, "send"),  # a send: its receiver counts it
    ]
    strategy = _Rank(records)
    adapter = DynamicEnvironmentAdapter(max_split=2)
    trainer: Any = SimpleNamespace(strategy=strategy, loggers=[], global_step=0)
    with pytest.warns(UserWarning, match="no cluster profile"):
        adapter.on_train_start(trainer, None)
    assert adapter._pairs == [(0, 2), (1, 2), (2, 0), (2, 1)]
    sent: list[list[float]] = []
    waited: list[bool] = []

    class Work:
        def wait(self) -> None:  # the other ranks' parts arrive when the work completes
            waited.append(True)
            tensor[12] += 0.7  # rank 0's step time (other ranks fill their own slots)
            tensor[16] += 2.0  # rank 1 has two proposals
            tensor[18] += 0.5  # rank 0's compute seconds
            tensor[21] += 0.25  # rank 0's compute probe seconds
            tensor[24] += 1.0  # rank 0's re-plan search is done

    def all_reduce(t: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False):
        nonlocal tensor
        assert async_op and group == "group (0, 1, 2)"  # posted, on a group of its own
        sent.append(t.tolist())
        tensor = t
        return Work()

    tensor = torch.zeros(0)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    monkeypatch.setattr(torch.distributed, "new_group", lambda ranks: f"group {tuple(ranks)}")
    strategy.last_step_stats = StepStats(seconds_by_kind={"F": 0.125, "B": 0.25})
    land = adapter._exchange(strategy, 7, 0.4, 0, False)
    # 4 pairs x (bytes, seconds, seconds less the stamps' error of 10 ms), the step time,
    # proposal count, compute and probe seconds of each of 3 ranks, and rank 0's search flag.
    pairs = [2 << 20, 0, 0, 0, 0.75, 0, 0, 0, 0.73, 0, 0, 0]
    assert len(sent) == 1
    assert sent[0] == pytest.approx([*pairs, 0, 0, 0.4, 0, 0, 0, 0, 0, 0.375, 0, 0, 0, 0])
    assert waited == []  # posted, not waited for: it lands at the next step
    landed = land()
    assert waited == [True]
    assert landed.step == 7 and landed.rows == [[0, 2, 2 << 20, 0.75, pytest.approx(0.73)]]
    assert landed.slowest_s == 0.7 and landed.anyone and landed.search_done
    assert landed.compute_s == (0.5, 0.0, 0.375) and landed.probe_s == (0.25, 0.0, 0.0)


@pytest.mark.parametrize("rank", [0, 3, 4])
def test_a_rank_that_neither_trains_searches_nor_probes_is_handed_the_sums(
    monkeypatch: pytest.MonkeyPatch, rank: int
) -> None:
    """Five ranks, three training: the idle rank 3 searches (the lowest of equally fast idle
    ranks), so ranks 0-3 sum; rank 4 adds nothing and takes the sums from rank 0, which hands
    them on once they land without waiting for the hand-over."""
    strategy = _Rank([], rank=rank, world=5)
    adapter = DynamicEnvironmentAdapter()
    trainer: Any = SimpleNamespace(strategy=strategy, loggers=[], global_step=0)
    with pytest.warns(UserWarning, match="no cluster profile"):
        adapter.on_train_start(trainer, None)
    calls: list[tuple[str, Any, Any]] = []

    class Work:
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor

        def wait(self) -> None:
            calls.append(("wait", None, None))
            self.tensor[len(self.tensor) - 1] = 1.0  # rank 3's search is done

        def is_completed(self) -> bool:
            return False

    def all_reduce(t: torch.Tensor, group: Any = None, async_op: bool = False) -> Work:
        calls.append(("all_reduce", group, async_op))
        return Work(t)

    def broadcast(t: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
        calls.append(("broadcast", (src, group), async_op))
        if not async_op:  # rank 4: the sums arrive
            t[len(t) - 1] = 1.0
            return None
        return Work(t)

    monkeypatch.setattr(torch.distributed, "new_group", lambda ranks: f"group {tuple(ranks)}")
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    monkeypatch.setattr(torch.distributed, "broadcast", broadcast)
    land = adapter._exchange(strategy, 7, 0.4, 0, False)
    landed = land()
    assert landed.search_done  # every rank reads the same sums
    if rank == 4:
        assert calls == [("broadcast", (0, "group (0, 4)"), False)]
        return
    assert calls[:2] == [("all_reduce", "group (0, 1, 2, 3)", True), ("wait", None, None)]
    handed = [("broadcast", (0, "group (0, 4)"), True)] if rank == 0 else []
    assert calls[2:] == handed
    adapter.on_train_end(trainer, None)  # the hand-over is waited for at the end
    assert calls[2:] == handed + [("wait", None, None)] * len(handed)


@pytest.mark.parametrize(("anyone", "proposed"), [(True, 2), (False, 0)])
def test_ranks_that_proposed_alike_pass_the_check(anyone: bool, proposed: int) -> None:
    check_agreement(Exchanged(7, [], 0.5, anyone, False), proposed)


@pytest.mark.parametrize(("anyone", "proposed", "says"), [(True, 0, "some"), (False, 1, "none")])
def test_ranks_whose_monitors_disagree_stop_with_an_error(
    anyone: bool, proposed: int, says: str
) -> None:
    # Every rank acts on its own proposals at once: a count that disagrees means the ranks did
    # not act alike, and training must not go on as if they had.
    with pytest.raises(RuntimeError, match=f"made {proposed} proposal.*count says {says}"):
        check_agreement(Exchanged(7, [], 0.5, anyone, False), proposed)


def test_the_state_round_trips_and_an_older_one_starts_afresh() -> None:
    strategy = _Rank([])
    adapter = DynamicEnvironmentAdapter()
    trainer: Any = SimpleNamespace(strategy=strategy, loggers=[], global_step=0)
    with pytest.warns(UserWarning):
        adapter.on_train_start(trainer, None)
    adapter.split_state.split = 2
    adapter.guard.record(1, 1.0)
    adapter.guard.begin(1, {"kind": "split", "from": 1, "to": 2}, towards_plan=False)
    adapter.decisions.append({"step": 1, "kind": "split-applied", "reason": "test"})
    state = json.loads(json.dumps(adapter.state_dict()))
    restored = DynamicEnvironmentAdapter()
    restored.load_state_dict(state)
    assert restored.state_dict() == adapter.state_dict()
    assert restored.guard.pending == adapter.guard.pending and restored.split_state.split == 2
    # On resume the split in force is applied again (2 pieces of the plan's 2 micro-batches).
    resumed = _Rank([])
    with pytest.warns(UserWarning):
        restored.on_train_start(SimpleNamespace(strategy=resumed, loggers=[], global_step=1), None)
    assert resumed.num_microbatches == 4 and restored.monitor is not None

    older = {"monitor": None, "decisions": [{"kind": "split"}], "base_microbatches": 2}
    fresh = DynamicEnvironmentAdapter()
    with pytest.warns(UserWarning, match="from another version"):
        fresh.load_state_dict(older)
    assert fresh.decisions == [{"kind": "split"}] and fresh.monitor is None
    assert fresh.split_state.split == 1
