"""Activation memory, measured: saved and transient bytes per block, the saved-tensor meter, and
the cost model's held-activation figure checked against what a running stage holds."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_deepcee.demo.gpt import GPT
from lightning_deepcee.planner.cost_model import in_flight_microbatches, stage_costs
from lightning_deepcee.planner.plan import StagePlan
from lightning_deepcee.profiler.data import ClusterProfile
from lightning_deepcee.runtime import (
    P2PTransport,
    PipelineExecutor,
    Router,
    StageLayout,
    build_stage,
    split_batch,
)
from lightning_deepcee.runtime.measure import SavedTensorsMeter, measure_blocks
from lightning_deepcee.runtime.measure import blocks as blocks_module
from lightning_deepcee.runtime.measure.cluster import _device_profile
from lightning_deepcee.schedule import ActionKind, generate, lower

D, H, ROWS = 16, 64, 8
"""Width and hidden width of the MLP block, rows of the measured micro-batch."""

TOLERANCE = 0.05
"""Measured peak of saved bytes vs the cost model's figure. Not exact: a stage's micro-batches
are row slices of one batch, so a saved input (token ids, targets) holds the whole batch's
storage, and a tensor two blocks both save counts once at run time, twice in the profile."""


def _mlp_blocks() -> list[nn.Module]:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D))
    return [nn.Linear(D, D), mlp, nn.Linear(D, 3)]


def test_mlp_block_saves_more_than_its_output() -> None:
    t = measure_blocks(_mlp_blocks(), torch.randn(ROWS, D), repeats=1, warmup=0, sustain_s=0)
    # Hand count, fp32 per sample: Linear(D, H) saves its input (D), GELU its input (H), the
    # second Linear the GELU's output (H); the weights (views of them) are parameters.
    assert t.saved_bytes[1] == 4 * (D + 2 * H) == 576
    assert t.activation_bytes[1] == 4 * D == 64
    assert t.saved_bytes[1] > t.activation_bytes[1]
    # Block 0 saves only its input (the data; its weight is a parameter); the last its input.
    assert t.saved_bytes[0] == t.saved_bytes[2] == 4 * D
    # Transient: at least the output and its gradient; here (eager CPU) the output, its gradient
    # and the GELU output's gradient live beside the saved tensors at the peak. Weight
    # gradients (4 * D * H bytes in all, 512 per sample) are not counted.
    assert 4 * 2 * D <= t.transient_bytes[1] <= 4 * (2 * D + 2 * H)
    assert t.transient_bytes[1] == 4 * (2 * D + H)
    assert t.transient_bytes[0] == 4 * 2 * D


def test_figures_reach_the_device_profile_and_a_failure_falls_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    t = measure_blocks(_mlp_blocks(), torch.randn(ROWS, D), repeats=1, warmup=0, sustain_s=0)
    record = {"kind": "cpu", "memory_bytes": 1 << 30, "timings": t}
    device = _device_profile(0, "h", record)
    assert device.saved_bytes == t.saved_bytes and device.transient_bytes == t.transient_bytes
    assert type(device).from_dict(device.to_dict()) == device

    def fail(*args: object) -> None:
        raise RuntimeError("cannot follow this block")

    monkeypatch.setattr(blocks_module, "block_memory_bytes", fail)
    with pytest.warns(UserWarning, match="saved and transient bytes could not be measured"):
        failed = measure_blocks(
            _mlp_blocks(), torch.randn(ROWS, D), repeats=1, warmup=0, sustain_s=0
        )
    assert failed.saved_bytes == failed.transient_bytes == ()
    fallback = _device_profile(0, "h", {**record, "timings": failed})
    assert fallback.held_bytes == failed.activation_bytes


def test_parameters_are_not_counted() -> None:
    """Saved bytes follow the activations, not the weights (which a ``Linear`` saves too)."""
    small = nn.Sequential(nn.Linear(D, D), nn.Tanh())
    wide = nn.Sequential(nn.Linear(D, H), nn.Linear(H, D), nn.Tanh())
    x = torch.randn(ROWS, D)
    blocks: list[nn.Module] = [nn.Identity(), small]
    measured_small = measure_blocks(blocks, x, repeats=1, warmup=0, sustain_s=0)
    # Input (D) and Tanh's output (D): no weight bytes (D * D * 4 = 1024 would be 128/sample).
    assert measured_small.saved_bytes[1] == 4 * 2 * D
    measured_wide = measure_blocks([nn.Identity(), wide], x, repeats=1, warmup=0, sustain_s=0)
    assert measured_wide.saved_bytes[1] == 4 * (D + H + D)  # input, hidden, Tanh output
    assert measured_wide.parameter_bytes[1] == 4 * (2 * D * H + H + D)


def test_meter_counts_each_storage_once_and_releases() -> None:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D))
    x = torch.randn(ROWS, D, requires_grad=True)
    per_graph = 4 * ROWS * 2 * H  # GELU's input and output; x is shared by every graph
    with SavedTensorsMeter(exclude=block.parameters()) as meter:
        outputs = [block(x) for _ in range(3)]
        assert meter.current_bytes == 4 * ROWS * D + 3 * per_graph
        outputs[0].sum().backward()  # its graph is freed
        assert meter.current_bytes == 4 * ROWS * D + 2 * per_graph
        del outputs[1]  # a dropped graph releases its tensors too
        assert meter.current_bytes == 4 * ROWS * D + per_graph
    del outputs
    assert meter.current_bytes == 0
    assert meter.peak_bytes == 4 * ROWS * D + 3 * per_graph


# --------------------------------------------------------------------------------------------
# The cost model's held activations vs what a running stage holds
# --------------------------------------------------------------------------------------------

VOCAB, BLOCK, LAYERS = 32, 16, 4
MICROBATCHES, MICROBATCH_ROWS = 4, 4


def _gpt() -> tuple[GPT, list[nn.Module]]:
    model = GPT(vocab_size=VOCAB, block_size=BLOCK, n_layer=LAYERS, n_head=2, n_embd=32)
    return model, list(model.configure_pipeline().blocks)


def _batch(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (rows, BLOCK + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _profile(model: GPT, blocks: list[nn.Module]) -> ClusterProfile:
    """One device, measured at the micro-batch size the test then runs."""
    batch = _batch(MICROBATCH_ROWS)
    loss_fn = model.configure_pipeline().loss_fn
    timings = measure_blocks(
        blocks, batch[0], loss_fn=loss_fn, sample_batch=batch, repeats=1, warmup=0, sustain_s=0
    )
    device = _device_profile(0, "h", {"kind": "cpu", "memory_bytes": 1 << 40, "timings": timings})
    return ClusterProfile(
        devices=(device,),
        latency_s=((0.0,),),
        bandwidth_bytes_per_s=((float("inf"),),),
        num_blocks=len(blocks),
        model_fingerprint="gpt",
        cluster_fingerprint="one",
    )


def _predicted_held(
    profile: ClusterProfile, ranges: list[tuple[int, int]], schedule: str, stage: int
) -> float:
    """The cost model's bytes held by ``stage`` at its peak: in-flight x saved per micro-batch."""
    stages = [StagePlan(block_range=r, ranks=(0,), batch_shares=(1.0,)) for r in ranges]
    costs = stage_costs(profile, stages, microbatch_size=MICROBATCH_ROWS)
    in_flight = in_flight_microbatches(schedule, len(ranges), MICROBATCHES)[stage]
    return in_flight * costs.activation_bytes[stage]


@pytest.mark.parametrize(
    ("schedule", "ranges", "stage"),
    [
        ("1f1b", [(0, 3), (3, 6)], 0),  # the first of two stages holds two micro-batches
        ("zb-h1", [(0, 2), (2, 4), (4, 6)], 0),
        ("gpipe", [(0, 3), (3, 6)], 1),  # every micro-batch, last stage (with the loss)
    ],
)
def test_stage_holds_what_the_cost_model_predicts(
    schedule: str, ranges: list[tuple[int, int]], stage: int
) -> None:
    """Drive one stage's compute actions of ``schedule`` (F keeps its graph in flight until the
    stage's W or BW, as the executor does) and meter what autograd holds."""
    model, blocks = _gpt()
    profile = _profile(model, blocks)
    predicted = _predicted_held(profile, ranges, schedule, stage)
    start, end = ranges[stage]
    mine = blocks[start:end]
    loss_fn = model.configure_pipeline().loss_fn
    microbatches = [_batch(MICROBATCH_ROWS) for _ in range(MICROBATCHES)]
    with torch.no_grad():  # what the earlier stages would send
        inputs = [_run(blocks[:start], mb[0]) if start else mb[0] for mb in microbatches]
    held: dict[int, tuple[list[torch.Tensor], list[torch.Tensor] | None]] = {}
    static = [t for b in mine for t in (*b.parameters(), *b.buffers())]
    with SavedTensorsMeter(exclude=static) as meter:
        for action in generate(schedule, len(ranges), MICROBATCHES)[stage]:
            k = action.microbatch
            if action.kind == ActionKind.F:
                x = inputs[k].detach().requires_grad_(inputs[k].is_floating_point())
                out = _run(mine, x)
                if end == len(blocks):
                    held[k] = ([loss_fn(out, microbatches[k])], None)
                else:
                    held[k] = ([out], [torch.randn_like(out)])
            elif action.kind in (ActionKind.W, ActionKind.BW):
                roots, grads = held.pop(k)
                torch.autograd.backward(roots, grads)
    measured = meter.peak_bytes
    assert measured > 0
    message = (
        f"{schedule}, stage {stage} of {len(ranges)}: measured peak {measured} B of saved "
        f"tensors, cost model {predicted:.0f} B (tolerance {TOLERANCE:.0%})"
    )
    assert abs(measured - predicted) <= TOLERANCE * predicted, message


def _run(blocks: list[nn.Module], x: Any) -> Any:
    for block in blocks:
        x = block(x)
    return x


def test_executor_reports_peak_saved_bytes() -> None:
    """A single-stage executor with every micro-batch in flight (GPipe): its step stats report
    the peak, which matches the cost model's held bytes."""
    model, blocks = _gpt()
    profile = _profile(model, blocks)
    n = len(blocks)
    predicted = _predicted_held(profile, [(0, n)], "gpipe", 0)
    spec = model.configure_pipeline()
    stage = build_stage(model, spec, [(0, n)], 0)
    placement = {0: 0}
    layouts = [StageLayout(ranks=(0,), shares=(1.0,))]

    def executor(measure_saved: bool) -> PipelineExecutor:
        return PipelineExecutor(
            stage=stage,
            actions=lower(generate("gpipe", 1, MICROBATCHES), placement)[0],
            transport=P2PTransport(torch.device("cpu")),
            router=Router(layouts, 0, 0),
            loss_fn=spec.loss_fn,
            input_fn=spec.input_fn,
            rank=0,
            measure_saved=measure_saved,
        )

    total = MICROBATCHES * MICROBATCH_ROWS
    microbatches = split_batch(_batch(total), [MICROBATCH_ROWS] * MICROBATCHES)
    plain = executor(measure_saved=False)
    plain.run(microbatches, total)
    assert plain.last_stats.peak_saved_bytes is None
    metered = executor(measure_saved=True)
    metered.run(microbatches, total)
    measured = metered.last_stats.peak_saved_bytes
    assert measured is not None
    message = f"executor peak {measured} B of saved tensors, cost model {predicted:.0f} B"
    assert abs(measured - predicted) <= TOLERANCE * predicted, message
