"""A plan kept by set-up for its profile (``setup_plan.keep_plan``): reused on the same profile
and settings, searched again on any other, never reused where it no longer fits memory."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
from torch import nn

from lightning_deepcee.profiler.data import ClusterProfile
from lightning_deepcee.runtime.manual_layout import ManualLayout
from lightning_deepcee.strategy.setup_plan import PlanChoice, initial_plan, keep_plan
from tests.helpers.clusters import make_profile

_BLOCKS = [nn.Linear(4, 4) for _ in range(4)]


def _plan(profile: ClusterProfile, cache: Path, **overrides: object) -> PlanChoice:
    arguments: dict[str, object] = dict(
        manual=ManualLayout.from_arguments(None, None, None, None, None),
        blocks=_BLOCKS,
        world_size=profile.num_devices,
        cluster_profile=profile,
        global_batch_size=16,
        device_gain=0.05,
        device_cache=str(cache),
    )
    arguments.update(overrides)
    return initial_plan("auto", **arguments)  # type: ignore[arg-type]


def _with_memory(profile: ClusterProfile, memory_bytes: int) -> ClusterProfile:
    """``profile`` with every device's free memory at ``memory_bytes``."""
    devices = tuple(dataclasses.replace(d, memory_bytes=memory_bytes) for d in profile.devices)
    return dataclasses.replace(profile, devices=devices)


def test_the_plan_set_up_trained_is_kept_for_the_same_profile(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    profile = make_profile(speeds=[1.0, 0.5, 0.25], num_blocks=4, parameter_bytes=1000)
    first = _plan(profile, tmp_path)
    assert not first.kept and first.kept_file is not None and first.alternatives is not None
    assert not first.kept_file.exists()
    # What trains (say the trial picked another layout) is what the next set-up takes.
    trained = dataclasses.replace(first.plan, num_microbatches=2, notes="the trial's pick")
    keep_plan(first, trained, writer=False)
    assert not first.kept_file.exists()  # only rank 0 writes
    keep_plan(first, trained, writer=True)
    assert json.loads(first.kept_file.read_text())["notes"] == "the trial's pick"

    caplog.clear()
    again = _plan(_with_memory(profile, 10**12 - 1), tmp_path)  # free memory moved: same key
    assert again.kept and again.plan == trained and again.alternatives is None
    assert "plan kept from an earlier set-up on this profile" in caplog.text
    keep_plan(again, again.plan, writer=True)  # nothing to write for a kept plan

    # Another profile or other settings search again; so does a plan that no longer fits.
    slower = make_profile(speeds=[1.0, 0.5, 0.2], num_blocks=4, parameter_bytes=1000)
    assert not _plan(slower, tmp_path).kept
    assert not _plan(profile, tmp_path, global_batch_size=32).kept
    assert not _plan(profile, tmp_path, device_gain=0.1).kept
    huge = dataclasses.replace(
        trained, predicted_peak_memory_bytes=dict.fromkeys(range(3), 2 * 10**12)
    )
    keep_plan(first, huge, writer=True)
    assert not _plan(profile, tmp_path).kept  # a plan that no longer fits is searched again
    # Without a device cache nothing is kept; an unreadable file is searched again.
    assert _plan(profile, tmp_path, device_cache=None).kept_file is None
    first.kept_file.write_text("{not json")
    assert not _plan(profile, tmp_path).kept
