"""The doorway of a running job and the knock at it, over a real TCP store in one process.

The job's rank 0 publishes a note beside the checkpoints and answers knocks from the store; a
device finds the note and knocks. Refusals, the missing note and a knock that waits for a
device already at the door are covered; the admission itself (a new process group, the plan
and the checkpoint) is tested with processes in tests/multiprocess/test_recover_in_process.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from lightning_deepcee.runtime.admission import (
    JOIN_FILE,
    Answer,
    Doorway,
    JoinError,
    base_store,
    knock,
    wants_to_join,
)
from lightning_deepcee.strategy.admission import Admission, end_of_last_step
from tests.helpers.ports import free_port


@pytest.fixture
def store() -> Iterator[Any]:
    server = dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(5))
    yield dist.PrefixStore("default_pg", server)  # as a process group's store is wrapped


def _answer_when_knocked(door: Doorway, reply: dict[str, Any]) -> threading.Thread:
    def answer() -> None:
        deadline = time.monotonic() + 10
        while (found := door.knocked()) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert found is not None
        door.answer(found, {**reply, "host": found["host"]} if "refused" in reply else reply)

    thread = threading.Thread(target=answer)
    thread.start()
    return thread


def test_a_device_finds_the_note_knocks_and_gets_its_answer(tmp_path: Path, store: Any) -> None:
    door = Doorway()
    door.publish(tmp_path, store, ["dev0", "dev1"])
    note = json.loads((tmp_path / JOIN_FILE).read_text())
    assert note["hosts"] == ["dev0", "dev1"] and note["token"] == door.token
    assert note["store"] == [base_store(store).host, base_store(store).port]
    reply = Answer("/ckpt/join-step=9", door.group_prefix(), 2, 3, 9)
    thread = _answer_when_knocked(door, vars(reply))
    client, answer = knock(tmp_path, "dev2", wait_s=10)
    thread.join()
    assert answer == reply
    assert client.port == base_store(store).port
    assert door.knocked() is None  # answered: the doorway is free again


def test_a_refused_device_is_told_why(tmp_path: Path, store: Any) -> None:
    door = Doorway()
    door.publish(tmp_path, store, ["dev0"])
    thread = _answer_when_knocked(door, {"refused": "it was not profiled"})
    with pytest.raises(JoinError, match="refused dev9: it was not profiled"):
        knock(tmp_path, "dev9", wait_s=10)
    thread.join()


def test_without_a_note_there_is_no_job_to_join(tmp_path: Path) -> None:
    with pytest.raises(JoinError, match="no running job to join"):
        knock(tmp_path, "dev2", wait_s=1)


def test_a_second_device_waits_for_the_first_and_then_gives_up(tmp_path: Path, store: Any) -> None:
    door = Doorway()
    door.publish(tmp_path, store, ["dev0"])
    errors: list[Exception] = []

    def first_device() -> None:
        try:
            knock(tmp_path, "a", wait_s=2)
        except JoinError as exc:
            errors.append(exc)

    first = threading.Thread(target=first_device)
    first.start()
    time.sleep(0.5)  # "a" is at the door, unanswered
    with pytest.raises(JoinError, match=r"another device .* is joining"):
        knock(tmp_path, "b", wait_s=1)
    first.join()
    assert [str(e) for e in errors] == ["the job did not answer within 2 s"]
    assert door.knocked() is not None and door.knocked()["host"] == "a"  # type: ignore[index]


def test_an_unanswered_knock_times_out(tmp_path: Path, store: Any) -> None:
    Doorway().publish(tmp_path, store, ["dev0"])
    with pytest.raises(JoinError, match="did not answer within"):
        knock(tmp_path, "dev2", wait_s=0.5)


def test_join_is_asked_for_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEEPCEE_JOIN", raising=False)
    assert not wants_to_join()
    monkeypatch.setenv("DEEPCEE_JOIN", "0")
    assert not wants_to_join()
    monkeypatch.setenv("DEEPCEE_JOIN", "1")
    assert wants_to_join() and Admission().joining


def test_an_admission_checkpoint_resumes_at_the_end_of_the_last_step() -> None:
    """Saved when the next step is ready but not started: ``ready`` goes back to ``started``
    (Lightning then resumes at that step, as after a save at the end of the last one)."""

    def checkpoint() -> dict[str, Any]:
        counters = {"ready": 10, "started": 9, "processed": 9, "completed": 9}
        progress = {"total": dict(counters), "current": dict(counters)}
        return {"loops": {"fit_loop": {"epoch_loop.batch_progress": progress}}}

    saved, other = checkpoint(), checkpoint()
    end_of_last_step(saved)
    progress = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    assert progress["total"]["ready"] == progress["current"]["ready"] == 9
    assert progress["total"]["started"] == 9
    Admission().at_save(other)  # a save that is not an admission's is left as it is
    assert other == checkpoint()


def test_a_note_left_by_a_job_that_ended_says_so(tmp_path: Path) -> None:
    note = {"store": ["127.0.0.1", free_port()], "token": "gone", "hosts": ["dev0"]}
    (tmp_path / JOIN_FILE).write_text(json.dumps(note))
    with pytest.raises(JoinError, match=r"does not answer at 127\.0\.0\.1"):
        knock(tmp_path, "dev2", wait_s=1)
