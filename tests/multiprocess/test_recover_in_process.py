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
from pathlib import Path

import pytest

from tests.helpers.equivalence import assert_same_params, fit_reference, merged_ranks
from tests.helpers.launch import torchrun_until, write_configs
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
        assert (target / f"world{rank}.txt").read_text() == "3 1"
    assert not (target / "rank3.pt").exists()
    assert_same_params(merged_ranks(target, 3), fit_reference(12, clip=clip))
