"""P2PTransport receives ahead on gloo: sends of an unchanged size complete before the receiver
asks, sizes may change between steps, and the tensors are exactly those sent.

Gloo moves a message only once its receive is posted; ``begin_step`` posts the step's receives
at its start, with payload slots sized by the last step. A payload received ahead still has its
time on the wire (header to payload arrival, stamped by the step's timer threads), not the time
since its receive was posted.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_deepcee._compat import default_store
from lightning_deepcee.planner.compression import METHODS
from lightning_deepcee.runtime import P2PTransport
from lightning_deepcee.runtime.compression import decode, encode, encodes

pytestmark = pytest.mark.multiprocess

# Per step, the tensors rank 0 sends to rank 1: the same sizes twice (the second step is
# received ahead), then one larger, one smaller, one empty and a new dtype (slots overflow,
# pad, and restart).
STEPS = [
    [(3, 4), (5,), (2, 2, 2)],
    [(3, 4), (5,), (2, 2, 2)],
    [(6, 4), (2,), (0, 3), ()],
]


SEND_DELAY_S = 0.5
"""In step 1 the sender starts this late: a wire time measured from the receive's posting
would include it."""


def _tensor(step: int, index: int, shape: tuple[int, ...]) -> torch.Tensor:
    if index == 3:
        return torch.tensor(True)
    return torch.full(shape, float(10 * step + index))


def _worker(rank: int, init: str, out: str, prefetch: bool) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    store = default_store()
    transport = P2PTransport(torch.device("cpu"), prefetch=prefetch)
    ahead, exact = [], True
    wire: list[list[float | None]] = []
    for step, shapes in enumerate(STEPS):
        if rank == 0:
            transport.begin_step("train", [])
            if step == 1:
                time.sleep(SEND_DELAY_S)  # the receives wait this long for their payloads
            for index, shape in enumerate(shapes):
                transport.send(_tensor(step, index, shape), 1)
            transport.wait_sends()  # done only once rank 1 has posted every receive
            store.set(f"sent{step}", "1")
        else:
            transport.begin_step("train", [0] * len(shapes))
            try:  # do the sends finish while this rank has not called recv() yet?
                store.wait([f"sent{step}"], timedelta(seconds=10 if prefetch else 2))
                ahead.append(True)
            except Exception:  # the store's timeout error type varies between torch versions
                ahead.append(False)
            for index, shape in enumerate(shapes):
                got, want = transport.recv(0), _tensor(step, index, shape)
                exact &= got.dtype == want.dtype and torch.equal(got, want)
            wire.append([r.wire_s for r in transport.records[-len(shapes) :]])
        transport.end_step()
        dist.barrier()
    if rank == 1:
        result = dict(ahead=ahead, exact=exact, wire=wire)
        Path(out, "result.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.parametrize("prefetch", [True, False])
def test_receives_run_ahead_of_the_schedule(tmp_path: Path, prefetch: bool) -> None:
    init = f"file://{tmp_path / 'store'}"
    mp.spawn(_worker, args=(init, str(tmp_path), prefetch), nprocs=2, join=True)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["exact"]
    # Step 1 has no slot sizes yet; step 2 repeats them (received ahead); step 3 grows the
    # first tensor beyond its slot, so that send waits for the receiver again.
    assert result["ahead"] == ([False, True, False] if prefetch else [False, False, False])
    # Every payload has a wire time, received ahead or not, and it is the time on the link:
    # loopback moves these few bytes in well under the sender's delay.
    for step_wire in result["wire"]:
        assert all(w is not None and 0 <= w < SEND_DELAY_S / 2 for w in step_wire), result


def _unannounced_worker(rank: int, init: str, out: str) -> None:
    """Step 2 repeats step 1's sizes but the receiver announces nothing (it could not count its
    messages): the sender still fills its slots, and the receiver must take them as they come;
    step 3, announced again, is received ahead with the sizes step 2 recorded."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    store = default_store()
    transport = P2PTransport(torch.device("cpu"), prefetch=True)
    changed = [(6, 4), (2,), (2, 2, 2)]  # one payload outgrows its slot, one pads it
    steps = [STEPS[0], STEPS[1], changed, changed]
    ahead, exact = [], True
    for step, shapes in enumerate(steps):
        if rank == 0:
            transport.begin_step("train", [])
            for index, shape in enumerate(shapes):
                transport.send(_tensor(step, index, shape), 1)
            transport.wait_sends()
            store.set(f"sent{step}", "1")
        else:
            announced = [] if step == 2 else [0] * len(shapes)
            transport.begin_step("train", announced)
            if announced:
                try:
                    store.wait([f"sent{step}"], timedelta(seconds=3))
                    ahead.append(True)
                except Exception:
                    ahead.append(False)
            for index, shape in enumerate(shapes):
                got, want = transport.recv(0), _tensor(step, index, shape)
                exact &= got.dtype == want.dtype and torch.equal(got, want)
        transport.end_step()
        dist.barrier()
    if rank == 1:
        Path(out, "result.json").write_text(json.dumps(dict(ahead=ahead, exact=exact)))
    dist.destroy_process_group()


def test_a_source_the_step_did_not_announce_is_received_as_it_comes(tmp_path: Path) -> None:
    init = f"file://{tmp_path / 'store'}"
    mp.spawn(_unannounced_worker, args=(init, str(tmp_path)), nprocs=2, join=True)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["exact"]
    # Steps 0, 1, 3 were announced: no slots yet, then ahead, then ahead with step 2's sizes.
    assert result["ahead"] == [False, True, True]


COMPRESSED_STEPS = 3


def _compressed_tensors(step: int) -> list[torch.Tensor]:
    """Floats to compress (one not a whole number of tiles), and tensors sent as they are."""
    gen = torch.Generator().manual_seed(step)
    return [
        torch.randn(4, 3, 37, generator=gen),
        torch.arange(5, dtype=torch.int64),
        torch.randn(8, 64, generator=gen).to(torch.float64),
        torch.randn(0, 7, generator=gen),
    ]


def _compressed_worker(rank: int, init: str, out: str, prefetch: bool, method: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    codec = METHODS[method]
    transport = P2PTransport(
        torch.device("cpu"), prefetch=prefetch, compression={1: method} if rank == 0 else {}
    )
    exact, sizes = True, []
    for step in range(COMPRESSED_STEPS):
        tensors = _compressed_tensors(step)
        transport.begin_step("train", [] if rank == 0 else [0] * len(tensors))
        for tensor in tensors:
            if rank == 0:
                transport.send(tensor, 1)
                continue
            got = transport.recv(0)
            want = (
                decode(codec, encode(codec, tensor), tensor.shape)
                if encodes(codec, tensor)
                else tensor
            )
            exact &= got.dtype == tensor.dtype and torch.equal(got, want)
            sizes.append(transport.records[-1].num_bytes)
        transport.wait_sends()
        transport.end_step()
        dist.barrier()
    if rank == 1:
        Path(out, "result.json").write_text(json.dumps(dict(exact=exact, sizes=sizes)))
    dist.destroy_process_group()


@pytest.mark.parametrize(("prefetch", "method"), [(True, "tah4"), (False, "tah8"), (True, "bf16")])
def test_compressed_sends_arrive_decoded(tmp_path: Path, prefetch: bool, method: str) -> None:
    """A float32 tensor to a peer with a method arrives as the codec's round trip, in the
    method's wire bytes; other dtypes arrive exactly. The receiver is told nothing: the header
    names the method."""
    init = f"file://{tmp_path / 'store'}"
    args = (init, str(tmp_path), prefetch, method)
    mp.spawn(_compressed_worker, args=args, nprocs=2, join=True)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["exact"]
    codec = METHODS[method]
    want = [codec.wire_bytes(4 * 3 * 37), 5 * 8, 8 * 64 * 8, 0] * COMPRESSED_STEPS
    assert result["sizes"] == want
