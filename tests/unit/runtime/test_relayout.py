"""The routes of a live re-plan's state move: who sends which old shard to whom.

The move itself (bit-exact parameters and Adam moments after a re-plan) is tested end to end in
``tests/multiprocess/test_replan.py``.
"""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_deepcee.runtime.relayout import Route, routes


def test_an_unchanged_layout_moves_nothing_over_the_network() -> None:
    moves = routes([(0, 2), (2, 4)], [[0], [1]], [(0, 2), (2, 4)], [[0], [1]])
    assert moves == [Route(0, 0, 0, (0, 2)), Route(1, 1, 1, (2, 4))]


def test_each_new_rank_gets_the_old_stages_that_held_its_blocks() -> None:
    # Old: rank 0 holds blocks 0-2, rank 1 blocks 2-4. New: rank 1 holds 0-1, ranks 0 and 2
    # share 1-4 (so they need both old stages), rank 3 stays idle.
    moves = routes([(0, 2), (2, 4)], [[0], [1]], [(0, 1), (1, 4)], [[1], [0, 2]])
    assert moves == [
        Route(0, 0, 0, (1, 4)), Route(0, 1, 0, (0, 1)), Route(0, 2, 0, (1, 4)),
        Route(1, 0, 1, (1, 4)), Route(1, 2, 1, (1, 4)),
    ]  # fmt: skip
    assert all(m.dst != 3 for m in moves)


def test_a_stage_shared_by_devices_sends_from_its_first_device_to_the_others() -> None:
    # Ranks 2 and 0 held equal copies of the old stage: rank 0 keeps its own, rank 1 receives
    # from the first device, rank 2.
    moves = routes([(0, 4)], [[2, 0]], [(0, 2), (2, 4)], [[0], [1]])
    assert moves == [Route(0, 0, 0, (0, 2)), Route(2, 1, 0, (2, 4))]


def test_a_tied_parameter_comes_from_the_stage_that_saved_it() -> None:
    # Blocks 0 and 3 share a parameter, which old stage 0 saved and old stage 1 left out. The
    # new rank 1 holds blocks 1-4, none of old stage 0's, but block 3 uses the tied parameter.
    moves = routes([(0, 1), (1, 4)], [[0], [1]], [(0, 1), (1, 4)], [[0], [1]], [[0, 3]])
    assert Route(0, 1, 0, (1, 4)) in moves
    untied = routes([(0, 1), (1, 4)], [[0], [1]], [(0, 1), (1, 4)], [[0], [1]])
    assert Route(0, 1, 0, (1, 4)) not in untied


def _random_layout(rng: random.Random, blocks: int, world: int) -> tuple[list, list]:
    num_stages = rng.randint(1, min(blocks, world))
    cuts = sorted(rng.sample(range(1, blocks), num_stages - 1))
    bounds = [0, *cuts, blocks]
    ranges = list(itertools.pairwise(bounds))
    ranks = rng.sample(range(world), rng.randint(num_stages, world))
    placement: list[list[int]] = [[] for _ in ranges]
    for i, r in enumerate(ranks):
        placement[i if i < num_stages else rng.randrange(num_stages)].append(r)
    return ranges, placement


@pytest.mark.parametrize("seed", range(20))
def test_every_block_arrives_and_blocking_sends_never_deadlock(seed: int) -> None:
    rng = random.Random(seed)
    blocks, world = rng.randint(2, 8), rng.randint(2, 6)
    old_ranges, old_placement = _random_layout(rng, blocks, world)
    new_ranges, new_placement = _random_layout(rng, blocks, world)
    moves = routes(old_ranges, old_placement, new_ranges, new_placement)
    # Every rank of the new layout receives every block of its range.
    for (start, end), ranks in zip(new_ranges, new_placement, strict=True):
        for dst in ranks:
            held = {i for m in moves if m.dst == dst for i in range(*old_ranges[m.stage])}
            assert set(range(start, end)) <= held
            assert all(m.blocks == (start, end) for m in moves if m.dst == dst)
    # A route's source held the old stage: its first device, or the receiver itself.
    for m in moves:
        assert m.src == m.dst or m.src == old_placement[m.stage][0]
        assert m.src in old_placement[m.stage]
    # Each rank runs its own routes in the list's order, each a blocking rendezvous of its two
    # ends: every route completes.
    queues = {r: [m for m in moves if r in (m.src, m.dst)] for r in range(world)}
    done = 0
    while done < len(moves):
        ready = [
            m
            for m in moves
            if queues[m.src] and queues[m.dst] and queues[m.src][0] == queues[m.dst][0] == m
        ]
        assert ready, f"deadlock with {sum(len(q) for q in queues.values())} route ends left"
        for m in ready:
            queues[m.src].pop(0)
            if m.dst != m.src:
                queues[m.dst].pop(0)
            done += 1
