"""Live re-planning: blocks and their optimizer state move between devices at a step boundary.

Each test launches one ``torchrun`` job of 3 processes (gloo on CPU) running
``workers/replan_worker.py``. The layout changes mid-training (blocks change owner, the number of
stages changes, devices share a stage with unequal row shares), directly through
``DeepCEEStrategy.apply_plan`` or through the adapter's ``replan`` decision; the parameters,
Adam moments and learning rates at the end must equal a single-process run of the same steps.
"""

from __future__ import annotations

import json
import math
import socket
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_deepcee.planner import Plan
from lightning_deepcee.profiler import ClusterProfile, DeviceProfile
from lightning_deepcee.profiler.data import fingerprint_cluster
from lightning_deepcee.runtime.measure import model_fingerprint
from tests.helpers.launch import torchrun, write_configs
from tests.helpers.models import TinyNet, make_loader
from tests.helpers.paths import WORKERS
from tests.helpers.plans import Stage, hand_plan

pytestmark = pytest.mark.multiprocess
WORKER = WORKERS / "replan_worker.py"
WORLD = 3
FINGERPRINT = model_fingerprint(TinyNet().configure_pipeline().blocks)


def _launch(configs: list[dict[str, Any]], out: Path, nodes: bool = False) -> None:
    """One torchrun of ``WORLD`` processes, or with ``nodes`` one torchrun per rank (each its
    own node, so each builds its Trainer with its own accelerator, as the lab launches)."""
    cfg_file = write_configs(out, configs)
    torchrun(WORKER, out, cfg_file, world=WORLD, one_node_per_rank=nodes, timeout=600)


def _plan(path: Path, stages: list[Stage], schedule: str, m: int, **kw: Any) -> str:
    plan = hand_plan(
        stages,
        **kw,
        model_fingerprint=FINGERPRINT,
        global_batch_size=10,
        schedule=schedule,
        num_microbatches=m,
    )
    plan.to_json(path)
    return str(path)


def _reference(steps: int, num_samples: int = 30) -> dict[str, Any]:
    """Single-process Lightning run: parameters, Adam state and learning rate by name."""
    warnings.filterwarnings("ignore")
    model = TinyNet()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, make_loader(num_samples=num_samples))
    optimizer = trainer.optimizers[0]
    names = {id(p): n for n, p in model.named_parameters()}
    adam, lr = {}, {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            adam[names[id(p)]] = {k: v.detach().clone() for k, v in optimizer.state[p].items()}
            lr[names[id(p)]] = group["lr"]
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"params": params, "adam": adam, "lr": lr}


def _merged(directory: Path, copies_rtol: float = 0.0) -> dict[str, Any]:
    """Every rank's part, merged by name; devices sharing a stage hold identical copies (up to
    ``copies_rtol`` when a GPU and a CPU share one: their Adam kernels round differently)."""
    merged: dict[str, dict[str, Any]] = {"params": {}, "adam": {}, "lr": {}}
    for rank in range(WORLD):
        part = torch.load(directory / f"rank{rank}.pt", map_location="cpu", weights_only=False)
        for field in merged:
            for name, value in part[field].items():
                if name in merged[field]:
                    torch.testing.assert_close(
                        value, merged[field][name], rtol=copies_rtol, atol=copies_rtol * 1e-2
                    )
                merged[field][name] = value
    return merged


def _assert_matches_reference(got: dict[str, Any], ref: dict[str, Any], loose: float = 1.0) -> None:
    """Float summation order only: ``loose`` widens the tolerances (GPU kernels, TF32 off)."""
    assert got["params"].keys() == ref["params"].keys()
    assert got["adam"].keys() == ref["adam"].keys()
    for name in ref["params"]:
        torch.testing.assert_close(
            got["params"][name].cpu(), ref["params"][name], rtol=1e-5 * loose,
            atol=1e-6 * loose, msg=lambda m, name=name: f"parameter {name}: {m}",
        )  # fmt: skip
        for key, value in ref["adam"][name].items():
            # Moments are ~grad and ~grad^2 (1e-3 and 1e-6 and below): compare each on the scale
            # of its own tensor; an element that cancelled to near zero carries the tensor's
            # rounding noise, not its own. State that did not move would be off by its whole size.
            scale = float(value.abs().max()) if value.numel() else 0.0
            torch.testing.assert_close(
                got["adam"][name][key].cpu(), value, rtol=1e-4 * loose, atol=1e-5 * scale * loose,
                msg=lambda m, name=name, key=key: f"Adam {key} of {name}: {m}",
            )  # fmt: skip
        assert got["lr"][name] == pytest.approx(ref["lr"][name], rel=1e-12)


def _rank(directory: Path, rank: int) -> dict[str, Any]:
    path = directory / f"rank{rank}.pt"
    return torch.load(path, map_location="cpu", weights_only=False)  # type: ignore[no-any-return]


def _plans(tmp_path: Path) -> dict[str, str]:
    """The layouts the direct test moves through, written as plan files."""
    a = _plan(tmp_path / "a.json", [((0, 3), (0,), (1.0,)), ((3, 6), (1, 2), (0.5, 0.5))],
              "1f1b", 2)  # fmt: skip
    # Every block changes owner, 2 -> 3 stages, placement against rank order.
    b = _plan(tmp_path / "b.json", [((0, 2), (2,), (1.0,)), ((2, 5), (0,), (1.0,)),
                                     ((5, 6), (1,), (1.0,))], "zb-h1", 3)  # fmt: skip
    # 3 -> 2 stages, two devices sharing stage 0 with unequal rows.
    c = _plan(tmp_path / "c.json", [((0, 4), (1, 0), (0.7, 0.3)), ((4, 6), (2,), (1.0,))],
              "gpipe", 2)  # fmt: skip
    # Pure (asymmetric) data parallelism: one stage on all three devices.
    d = _plan(tmp_path / "d.json", [((0, 6), (2, 0, 1), (0.2, 0.5, 0.3))], "1f1b", 1)
    bad_blocks = _plan(tmp_path / "bad_blocks.json", [((0, 5), (0, 1, 2), (0.3, 0.3, 0.4))],
                       "1f1b", 1)  # fmt: skip
    bad_ranks = _plan(tmp_path / "bad_ranks.json",
                      [((0, 3), (0,), (1.0,)), ((3, 6), (1,), (1.0,))], "1f1b", 2)  # fmt: skip
    # From a manual layout (3 stages in rank order) to a plan with shares.
    e = _plan(tmp_path / "e.json", [((0, 4), (2,), (1.0,)), ((4, 6), (0, 1), (0.4, 0.6))],
              "zb-h1", 2)  # fmt: skip
    return dict(a=a, b=b, c=c, d=d, e=e, bad_blocks=bad_blocks, bad_ranks=bad_ranks)


def _moves(tmp_path: Path, **extra: Any) -> list[dict[str, Any]]:
    p = _plans(tmp_path)
    return [
        {"name": "moves", "plan": p["a"], "steps": 6, **extra,
         # step 1: two plans that do not fit (every rank raises, nothing moves), then B;
         # step 2: ranks pass different plans (every rank raises after the gather).
         "apply": {"1": [p["bad_blocks"], p["bad_ranks"], p["b"]], "2": [[p["c"], p["d"], p["d"]]],
                   "3": [p["c"]], "4": [p["d"]]}},
        {"name": "manual", "schedule": "1f1b", "num_microbatches": 2, "steps": 4, **extra,
         "apply": {"2": [p["e"]]}},
    ]  # fmt: skip


def _check_moves(tmp_path: Path, loose: float = 1.0) -> None:
    copies_rtol = 0.0 if loose == 1.0 else 1e-4
    _assert_matches_reference(_merged(tmp_path / "moves", copies_rtol), _reference(6), loose)
    _assert_matches_reference(_merged(tmp_path / "manual", copies_rtol), _reference(4), loose)
    for rank in range(WORLD):
        moves = _rank(tmp_path / "moves", rank)
        assert moves["plan"] == Plan.from_json(tmp_path / "d.json").to_dict()
        errors = moves["errors"]
        assert len(errors) == 3, errors
        assert "covers 5 blocks but the model has 6" in errors[0]
        assert "names ranks [0, 1] but the world has 3 ranks" in errors[1]
        assert "ranks [1, 2] passed another plan than rank 0" in errors[2]
        manual = _rank(tmp_path / "manual", rank)["plan"]
        assert manual == Plan.from_json(tmp_path / "e.json").to_dict()


def test_apply_plan_moves_blocks_and_optimizer_state(tmp_path: Path) -> None:
    _launch(_moves(tmp_path), tmp_path)
    _check_moves(tmp_path)


@pytest.mark.gpu
def test_apply_plan_on_a_mixed_gpu_cpu_cluster(tmp_path: Path) -> None:
    """GPU, CPU, GPU over gloo (the cloud-GPU / end-device-CPU case): shards are staged through
    the host, blocks leaving a GPU rank go back to host memory, optimizer state follows."""
    assert torch.cuda.is_available(), "the gpu marker needs a CUDA device"
    _launch(_moves(tmp_path, accelerators=["gpu", "cpu", "gpu"], backend="gloo"), tmp_path, True)
    _check_moves(tmp_path, loose=10.0)


def _synthetic_profile(path: Path) -> None:
    """Three equal devices on fast links, fingerprinted for this model and machine, so the
    strategy's profile cache takes it instead of measuring: planning is deterministic."""
    blocks = 6
    seconds = (1e-2,) * blocks
    devices = tuple(
        DeviceProfile(
            rank=r, host=socket.gethostname(), kind="cpu", memory_bytes=2**34, forward_s=seconds,
            backward_input_s=seconds, backward_weight_s=tuple(2 * t for t in seconds),
            activation_bytes=(64,) * blocks, parameter_bytes=(1088,) * blocks,
            reference_microbatch_size=5, capability=1.0,
        )
        for r in range(WORLD)
    )  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    ClusterProfile(
        devices=devices,
        latency_s=[[0.0 if i == j else 1e-4 for j in range(WORLD)] for i in range(WORLD)],
        bandwidth_bytes_per_s=[
            [math.inf if i == j else 1e8 for j in range(WORLD)] for i in range(WORLD)
        ],
        num_blocks=blocks,
        model_fingerprint=FINGERPRINT,
        cluster_fingerprint=fingerprint_cluster([socket.gethostname()] * WORLD),
    ).to_yaml(path)


def test_adapter_replan_moves_blocks_and_survives_resume(tmp_path: Path) -> None:
    for name in ("adapter", "resume", "idle"):
        _synthetic_profile(tmp_path / name / "profile.yaml")
    # Rank 0 alone, 1 and 2 idle: 1 searches, 2 is out of the exchange and is handed its sums.
    # Made by hand, so setup's plan is no floor for the search.
    cluster = fingerprint_cluster([socket.gethostname()] * WORLD)
    alone = _plan(tmp_path / "alone.json", [((0, 6), (0,), (1.0,))], "1f1b", 2, idle_ranks=(1, 2),
                  cluster_fingerprint=cluster, notes="manual layout")  # fmt: skip
    # The link 0->1 drops to 1/10000 of the profile at step 2: data parallelism over all three
    # devices (what the search picks on the fast profile) all-reduces over it, so the adapter
    # re-plans around it.
    forced = [2, [0, 1], 1e-4]
    configs: list[dict[str, Any]] = [
        {"name": "adapter", "profile": True, "steps": 7, "forced_replan": forced},
        # Re-plan inside epoch 1 (7 steps), save, resume from setup's layout: the re-planned
        # one returns.
        {"name": "resume", "profile": True, "resume": True, "forced_replan": forced,
         "num_samples": 70},
        # A manual layout without a profile cannot re-plan: logged and skipped.
        {"name": "noprofile", "schedule": "1f1b", "num_microbatches": 2, "steps": 4,
         "forced_replan": forced},
        # A change of a link the plan does not use starts a search, which finds the three
        # devices far faster than one.
        {"name": "idle", "profile": True, "plan": alone, "steps": 7,
         "forced_replan": [2, [0, 1], 0.5]},
    ]  # fmt: skip
    _launch(configs, tmp_path)
    _assert_matches_reference(_merged(tmp_path / "adapter"), _reference(7))
    _assert_matches_reference(_merged(tmp_path / "resume"), _reference(14, num_samples=70))
    _assert_matches_reference(_merged(tmp_path / "noprofile"), _reference(4))

    adapter = _rank(tmp_path / "adapter", 0)
    start = adapter["plans"][0]["start"]
    assert len(start["stages"]) == 1  # data parallelism on the fast profile
    applied = [d for d in adapter["decisions"] if d["kind"] == "replan-applied"]
    # Forced at step 2 and searched then, rank 0's flag lands at 4, moved at the end of step 4.
    assert len(applied) == 1 and applied[0]["step"] == 4, adapter["decisions"]
    assert applied[0]["new_step_time_s"] < 0.9 * applied[0]["current_step_time_s"]
    final = adapter["plan"]
    assert final == applied[0]["plan"] and final["stages"] != start["stages"]
    for rank in range(1, WORLD):
        assert _rank(tmp_path / "adapter", rank)["plan"] == final

    resume = _rank(tmp_path / "resume", 0)
    replanned = json.loads((tmp_path / "resume" / "first_plan.json").read_text())
    assert replanned["stages"] != start["stages"]
    assert resume["plans"][0]["setup"]["stages"] == start["stages"]  # setup searched A again
    assert resume["plans"][0]["start"] == replanned  # ... and the adapter restored B
    assert resume["plan"] == replanned

    # The rank out of the exchange took every decision the others took, and moved with them.
    idle = [_rank(tmp_path / "idle", rank) for rank in range(WORLD)]
    assert idle[0]["plans"][0]["start"]["stages"] == [
        {"block_range": [0, 6], "ranks": [0], "batch_shares": [1.0]}
    ], idle[0]["plans"][0]["start"]
    moved = [d for d in idle[0]["decisions"] if d["kind"] == "replan-applied"]
    assert len(moved) == 1 and moved[0]["step"] == 4, idle[0]["decisions"]
    assert 2 in [r for stage in idle[0]["plan"]["stages"] for r in stage["ranks"]]
    for rank in (1, 2):
        assert idle[rank]["decisions"] == idle[0]["decisions"]
        assert idle[rank]["plan"] == idle[0]["plan"]
    _assert_matches_reference(_merged(tmp_path / "idle"), _reference(7))

    noprofile = _rank(tmp_path / "noprofile", 0)
    assert [d["kind"] for d in noprofile["decisions"] if d["kind"].startswith("replan-")] == [
        "replan-skipped"
    ]
    # Every layout is a Plan: the manual one, unchanged, with no predictions.
    assert noprofile["plan"]["notes"] == "manual layout"
    assert noprofile["plan"]["predicted_step_time_s"] == 0.0
    assert noprofile["plans"][0]["start"] == noprofile["plan"]
