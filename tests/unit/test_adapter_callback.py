"""DynamicEnvironmentAdapter._decide: which decisions change the micro-batch count."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from lightning_deepcee import DeepCEEStrategy, DynamicEnvironmentAdapter


class _Strategy(DeepCEEStrategy):
    """A DeepCEEStrategy that only records micro-batch changes (no processes)."""

    def set_num_microbatches(self, num_microbatches: int) -> None:
        self.num_microbatches = num_microbatches


def _decision(kind: str, link: tuple[int, int], step_bytes: int, new_bw: float) -> dict[str, Any]:
    return dict(
        step=20, link=list(link), kind=kind, old_bandwidth=2.0 * new_bw, new_bandwidth=new_bw,
        split_factor=2 if kind == "split" else 1, reason="test", step_bytes=step_bytes,
        step_s=1.0,
    )  # fmt: skip


def _two_microbatch_run(**adapter_args: Any) -> tuple[Any, Any, DynamicEnvironmentAdapter]:
    """A 1F1B strategy of 2 micro-batches at step 20 and an adapter that knows that count."""
    strategy = _Strategy(schedule="1f1b", num_microbatches=2)
    trainer: Any = SimpleNamespace(strategy=strategy, loggers=[], global_step=20)
    adapter = DynamicEnvironmentAdapter(**adapter_args)
    adapter._base_microbatches = 2
    return strategy, trainer, adapter


def test_a_split_applies_only_to_a_link_that_matters() -> None:
    strategy, trainer, adapter = _two_microbatch_run(min_link_share=0.1)
    # A LAN link: 1 MB at 50 MB/s is 20 ms of a 1 s step -> ignored, nothing changes.
    adapter._decide(trainer, strategy, [_decision("split", (0, 1), 1_000_000, 50e6)])
    assert strategy.num_microbatches == 2
    assert adapter.decisions[-1]["kind"] == "ignored-split"
    # A WAN link: 1 MB at 1.25 MB/s is 0.8 s of the step -> split x2.
    adapter._decide(trainer, strategy, [_decision("split", (1, 2), 1_000_000, 1.25e6)])
    assert strategy.num_microbatches == 4
    # Recovery: merge returns to the configured count.
    adapter._decide(trainer, strategy, [_decision("merge", (1, 2), 1_000_000, 2.5e6)])
    assert strategy.num_microbatches == 2


def test_min_link_share_is_checked() -> None:
    with pytest.raises(ValueError, match="min_link_share"):
        DynamicEnvironmentAdapter(min_link_share=1.0)


def test_the_tuner_tries_finer_splits_after_a_split_and_stops_on_merge() -> None:
    strategy, trainer, adapter = _two_microbatch_run(window=3)
    adapter._decide(trainer, strategy, [_decision("split", (1, 2), 1_000_000, 1.25e6)])
    assert strategy.num_microbatches == 4 and adapter.tuner is not None and adapter.tuner.active
    # One settling step, then three at x2 (1.0 s): the tuner tries x3 (6 micro-batches).
    for step in range(21, 25):
        adapter._tune(trainer, step, 1.0)
    assert strategy.num_microbatches == 6
    assert adapter.decisions[-1]["kind"] == "tune-probe"
    # x3 is no faster: back to x2, tuning stops.
    for step in range(25, 29):
        adapter._tune(trainer, step, 1.0)
    assert strategy.num_microbatches == 4
    assert adapter.decisions[-1]["kind"] == "tune-revert" and not adapter.tuner.active
    # Tuning state survives a checkpoint.
    restored = DynamicEnvironmentAdapter(window=3)
    restored.load_state_dict(adapter.state_dict())
    assert restored._tuned_split == 2 and restored.tuner is not None
    assert restored.tuner.state_dict() == adapter.tuner.state_dict()
    # Recovery: the merge drops the tuned split too.
    adapter._decide(trainer, strategy, [_decision("merge", (1, 2), 1_000_000, 2.5e6)])
    assert strategy.num_microbatches == 2 and adapter._tuned_split is None


def test_tuning_can_be_turned_off() -> None:
    strategy = _Strategy(schedule="1f1b", num_microbatches=1)
    trainer: Any = SimpleNamespace(strategy=strategy, loggers=[], global_step=20)
    adapter = DynamicEnvironmentAdapter(tune_gain=None)
    adapter._base_microbatches = 1
    adapter._decide(trainer, strategy, [_decision("split", (1, 2), 1_000_000, 1.25e6)])
    for step in range(21, 40):
        adapter._tune(trainer, step, 1.0 if step < 30 else 0.1)
    assert strategy.num_microbatches == 2 and adapter.tuner is None
