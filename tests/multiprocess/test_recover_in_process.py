"""A device lost mid-training: the survivors recover in their processes, and stay exact.

Four torchrun nodes (one process each, ``workers/recover_worker.py``) train ``TinyNet`` (AdamW,
a StepLR stepped every step) on blocks [0, 2) | [2, 4) | [4, 6) with rank 3 idle, checkpointing
every 3 steps; rank 2 dies when step 9 begins. The three survivors re-form the group, plan
[0, 1) | [1, 4) | [4, 6) on all three (the idle rank becomes active, so it reads the real
batches of the steps it stood in for), load step 6's checkpoint (step 3's if step 6's had not
committed), redo the steps since and train on to step 12, without a restart. Their parameters
must equal one process that never failed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.equivalence import assert_same_params, fit_reference, merged_ranks
from tests.helpers.launch import torchrun_until, worker_env, write_configs
from tests.helpers.paths import WORKERS

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("clip", [None, 0.05])
def test_survivors_recover_in_process_and_equal_one_process(
    tmp_path: Path, clip: float | None
) -> None:
    config = {"name": "recover", "steps": 12, "kill": 2, "kill_after": 8, "clip": clip}
    target = tmp_path / "recover"
    outputs = torchrun_until(
        WORKERS / "recover_worker.py",
        tmp_path,
        write_configs(tmp_path, [config]),
        world=4,
        out=tmp_path,
        done=lambda: all((target / f"world{r}.txt").exists() for r in range(3)),
    )
    log = outputs[0]
    assert "training again on 3 devices in this process" in log, log[-6000:]
    # Step 6's checkpoint, or step 3's while step 6's is still being written: the steps since
    # it, up to the failed step 9, are redone.
    found = re.search(r"step=(\d+)\.ckpt loaded [\d.]+ s, (\d+) step\(s\) redone", log)
    assert found is not None, log[-6000:]
    saved, redone = int(found[1]), int(found[2])
    assert saved in (3, 6) and redone == 8 - saved, found[0]
    for rank in range(3):  # the survivors' ranks now; one start each, one recovery
        assert (target / f"world{rank}.txt").read_text() == "3 1 0"
    assert not (target / "rank3.pt").exists()
    assert_same_params(merged_ranks(target, 3), fit_reference(12, clip=clip))


def test_the_lost_device_returns_at_a_step_boundary_and_stays_exact(tmp_path: Path) -> None:
    """Rank 2 (``dev2``) dies when step 9 begins; once the three survivors train again in their
    processes, ``dev2`` starts again alone with ``DEEPCEE_JOIN=1``. The survivors admit it at a
    step boundary without a restart (its layout makes it a stage of its own), and the four
    train on to step 60 (until it joins, the survivors take a second per step: a loaded
    machine starts the device slowly): their parameters must equal one process that never
    failed."""
    config = {"name": "join", "steps": 60, "kill": 2, "kill_after": 8, "join": True}
    target = tmp_path / "join"
    configs = write_configs(tmp_path, [config])
    joiner: list[subprocess.Popen[bytes]] = []

    def done() -> bool:
        log = tmp_path / "node0.log"
        recovered = log.exists() and "training again on 3 devices" in log.read_text("utf-8")
        if recovered and not joiner:  # the device comes back: the same script, alone
            joiner.append(
                subprocess.Popen(
                    [sys.executable, str(WORKERS / "recover_worker.py"), tmp_path, configs],
                    stdout=(tmp_path / "joiner.log").open("w"),
                    stderr=subprocess.STDOUT,
                    env=worker_env(DEEPCEE_JOIN="1", DEEPCEE_DEVICE="dev2"),
                )
            )
        if joiner and joiner[0].poll() not in (None, 0):
            return True  # the returning device failed: its log says why (below)
        return all((target / f"world{r}.txt").exists() for r in range(4))

    try:
        outputs = torchrun_until(
            WORKERS / "recover_worker.py",
            tmp_path,
            configs,
            world=4,
            out=tmp_path,
            done=done,
            timeout=300,
        )
    finally:
        for process in joiner:
            if process.poll() is None:
                process.kill()
            process.wait()
    joined = (tmp_path / "joiner.log").read_text("utf-8")
    assert "dev2 asks to join the job" in joined, joined[-6000:]
    log = outputs[0]
    assert "4 devices (dev0, dev1, dev3, dev2) from step" in log, log[-6000:]
    for rank in range(3):  # the survivors: one recovery, one device admitted
        assert (target / f"world{rank}.txt").read_text() == "4 1 1"
    assert (target / "world3.txt").read_text() == "4 0 1"  # the returning device, now rank 3
    assert_same_params(merged_ranks(target, 4), fit_reference(60))
