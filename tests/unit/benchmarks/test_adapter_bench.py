"""benchmarks/adapter_bench.py without the lab: the links a plan uses and the trace made for it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from lightning_deepcee.lab.topology import load_topology
from lightning_deepcee.lab.trace import load_trace
from tests.helpers.benchmarks import load_benchmark
from tests.helpers.paths import ROOT


def _bench() -> ModuleType:
    return load_benchmark("adapter_bench")


def _plan(*stages: tuple[int, ...]) -> dict[str, Any]:
    return {"stages": [{"ranks": list(ranks)} for ranks in stages]}


CEE6 = load_topology(ROOT / "configs" / "lab" / "cee6.yaml")  # cloud0,1 | edge0,1 | end0,1


def test_the_links_a_plan_uses() -> None:
    links = _bench().plan_wan_links
    # Two devices per stage, cloud -> edge -> end: both WAN links, in pipeline order.
    assert links(_plan((0, 1), (2, 3), (4, 5)), CEE6) == [("cloud", "edge"), ("edge", "end")]
    # Cloud -> end crosses both; a stage spanning regions all-reduces over its WAN link.
    assert links(_plan((0,), (4,)), CEE6) == [("cloud", "edge"), ("edge", "end")]
    assert links(_plan((0, 2)), CEE6) == [("cloud", "edge")]
    # Data parallelism in the cloud: no WAN link at all.
    assert links(_plan((0, 1)), CEE6) == []


def _args(tmp_path: Path, **kwargs: Any) -> argparse.Namespace:
    defaults = dict(
        trace=None, link=None, drop_at_s=10.0, restore_at_s=20.0, drop_factor=0.25, jitter=None,
        jitter_period_s=10.0, slow_device=None, slow_factor=3.0,
    )  # fmt: skip
    return argparse.Namespace(**{**defaults, **kwargs})


def test_the_trace_hits_the_slowest_link_the_plan_uses(tmp_path: Path) -> None:
    bench = _bench()
    plan = _plan((0, 1), (2, 3), (4, 5))
    path, trace = bench._trace_for_plan(_args(tmp_path), CEE6, plan, tmp_path)
    assert trace == [
        {"at_s": 10.0, "link": ["edge", "end"], "bandwidth_mbit": 5.0},  # 20 Mbit/s, a quarter
        {"at_s": 20.0, "link": ["edge", "end"], "bandwidth_mbit": 20.0},
    ]
    assert load_trace(path, CEE6).to_list() == trace  # a valid trace file for the lab
    _, named = bench._trace_for_plan(_args(tmp_path, link="edge,cloud"), CEE6, plan, tmp_path)
    assert named[0]["link"] == ["cloud", "edge"] and named[0]["bandwidth_mbit"] == 25.0
    with pytest.raises(SystemExit, match="crosses no WAN link"):
        bench._trace_for_plan(_args(tmp_path), CEE6, _plan((0, 1)), tmp_path)
    with pytest.raises(ValueError, match="drop-factor"):
        bench.make_trace(CEE6, ("cloud", "edge"), 1.0, 2.0, 1.5)


def test_a_jitter_trace_alternates_around_the_links_figure(tmp_path: Path) -> None:
    bench = _bench()
    plan = _plan((0, 1), (2, 3))
    args = _args(tmp_path, drop_at_s=100.0, restore_at_s=135.0, jitter=0.3, jitter_period_s=10.0)
    path, trace = bench._trace_for_plan(args, CEE6, plan, tmp_path)
    assert [(e["at_s"], e["bandwidth_mbit"]) for e in trace] == [
        (100.0, 130.0), (110.0, 70.0), (120.0, 130.0), (130.0, 70.0), (135.0, 100.0),
    ]  # fmt: skip
    assert {tuple(e["link"]) for e in trace} == {("cloud", "edge")}
    assert load_trace(path, CEE6).to_list() == trace
    assert bench._phases(trace, 200.0, "jitter") == [
        ("normal", 0.0, 100.0), ("jitter", 100.0, 135.0), ("recovered", 135.0, 200.0),
    ]  # fmt: skip
    with pytest.raises(SystemExit, match="two events"):
        bench._phases(trace, 200.0)  # a drop trace has two events
    cfg = {"trace": trace, "end_s": 200.0, "jitter": 0.3}
    assert bench.config_phases(cfg)[1][0] == "jitter"
    assert bench.describe_trace(cfg) == (
        "trace: link cloud-edge alternating between 1.3x and 0.7x its 100 Mbit/s every 10 s "
        "from 100 to 135 s"
    )
    with pytest.raises(ValueError, match="--jitter"):
        bench.jitter_trace(CEE6, ("cloud", "edge"), 0.0, 10.0, 1.2, 1.0)


def test_a_given_trace_is_checked_against_the_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    given = ROOT / "configs" / "lab" / "trace_wan_dip.yaml"  # cloud-edge and edge-end
    bench = _bench()
    path, _ = bench._trace_for_plan(
        _args(tmp_path, trace=given), CEE6, _plan((2, 3), (4, 5)), tmp_path
    )
    assert path == given and "warning" not in capsys.readouterr().out
    bench._trace_for_plan(_args(tmp_path, trace=given), CEE6, _plan((0, 1)), tmp_path)
    assert "nothing to react to" in capsys.readouterr().out


def test_help_and_a_manual_layout_without_a_trace(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    with pytest.raises(SystemExit) as exit_info:
        bench.harness_main(["--help"])
    assert exit_info.value.code == 0 and "--layout" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.harness_main(["--topology", "t.yaml", "--layout", "manual"])
    assert "--layout manual needs --trace" in capsys.readouterr().err


def test_both_arms_run_the_plan_made_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness with the lab replaced: one planning run, then both arms on its files."""
    bench = _bench()
    plan = {
        "stages": [{"ranks": [0, 1]}, {"ranks": [2, 3]}, {"ranks": [4, 5]}],
        "schedule": "compact",
        "num_microbatches": 4,
    }
    calls: list[list[str]] = []

    def lab(topology: Path, trace: Path | None, out: Path, timeout_s: float, worker: list[str]):
        calls.append([str(trace), *worker])
        option = dict(zip(worker[::2], worker[1::2], strict=False))
        if "--plan-out" in option:
            Path(option["--plan-out"]).write_text(json.dumps(plan))
            Path(option["--profile-cache"]).write_text("{}")
        else:
            steps = [
                {"step": i, "end_s": 5.0 * i, "wall_s": 1.0, "microbatches": 4} for i in range(60)
            ]
            Path(option["--steps-log"]).write_text("".join(json.dumps(s) + "\n" for s in steps))
        return 0

    monkeypatch.setattr(bench, "_lab", lab)
    argv = ["--topology", str(ROOT / "configs/lab/cee6.yaml"), "--results", str(tmp_path / "r"),
            "--logs", str(tmp_path / "logs"), "--drop-at-s", "100", "--restore-at-s", "200",
            "--end-s", "300"]  # fmt: skip
    assert bench.harness_main(argv) == 0
    planning, off, on = calls
    assert "--plan-out" in planning and planning[0] == "None"  # no trace while planning
    for arm in (off, on):
        option = dict(zip(arm[1::2], arm[2::2], strict=False))
        assert option["--plan"].endswith("plan.json") and option["--profile-cache"].endswith(
            "profile.json"
        )
        assert arm[0].endswith("trace.yaml")
    assert (off[2], on[2]) == ("off", "on")  # the arms differ only by the adapter
    result = json.loads((tmp_path / "r" / "adapter_cee6_planned.json").read_text())
    assert result["config"]["layout"] == "plan" and result["config"]["plan"] == plan
    assert {e["link"][1] for e in result["config"]["trace"]} == {"end"}  # the slowest link
    table = (tmp_path / "r" / "adapter_cee6_planned.md").read_text()
    assert "the planner's plan (ranks 0,1 | 2,3 | 4,5, compact with 4 micro-batches)" in table
    # A second invocation reuses the plan: no planning run.
    calls.clear()
    assert bench.harness_main(argv) == 0
    assert len(calls) == 2 and all("--plan-out" not in c for c in calls)


def test_samples_per_s_count_the_time_between_steps() -> None:
    """A stall after a step's end (a callback's work) counts against the step after it."""
    bench = _bench()
    records = [
        {"step": 1, "end_s": 10.0, "wall_s": 1.0, "microbatches": 4},
        {"step": 2, "end_s": 11.0, "wall_s": 1.0, "microbatches": 4},
        {"step": 3, "end_s": 22.0, "wall_s": 1.0, "microbatches": 4},  # 10 s outside the step
    ]
    spans = [r["span_s"] for r in bench.with_spans(list(reversed(records)))]
    assert spans == [1.0, 1.0, 11.0]
    phases = bench.summarise(records, [("normal", 0.0, 100.0)], 12, settle=0, skip_s=0.0)
    assert phases["normal"]["samples_per_s"] == pytest.approx(36 / 13)


def test_a_stall_across_the_end_of_a_phase_counts_for_its_part() -> None:
    """A step that ends after the phase (a 180 s move of blocks) still cost the phase its time."""
    bench = _bench()
    records = [
        {"step": 1, "end_s": 10.0, "wall_s": 1.0, "microbatches": 4},
        {"step": 2, "end_s": 11.0, "wall_s": 1.0, "microbatches": 4},
        {"step": 3, "end_s": 191.0, "wall_s": 5.0, "microbatches": 2},  # runs past 20 s
    ]
    phases = [("normal", 0.0, 20.0), ("degraded", 20.0, 30.0)]
    out = bench.summarise(records, phases, 12, settle=0, skip_s=0.0)
    assert out["normal"]["samples_per_s"] == pytest.approx(24 / 11)  # 9-11 s, then 11-20 s
    assert out["degraded"]["samples_per_s"] == 0.0  # spent stalled: no step ended in it


def _arm(rate: float, mbs: int = 4) -> dict[str, Any]:
    phase = {"samples_per_s": rate, "settled_samples_per_s": rate, "microbatches": [mbs],
             "last_microbatches": mbs}  # fmt: skip
    return {"phases": {"normal": phase, "degraded": phase, "recovered": phase}, "records": []}


def test_the_table_gives_medians_over_interleaved_runs() -> None:
    trace = [{"at_s": 100.0, "link": ["cloud", "edge"], "bandwidth_mbit": 25.0},
             {"at_s": 220.0, "link": ["cloud", "edge"], "bandwidth_mbit": 100.0}]  # fmt: skip
    result = {
        "config": {"topology": "configs/lab/cee6.yaml", "trace": trace, "size": "gpt5m",
                   "global_batch": 48, "microbatches": 2, "schedule": "1f1b", "end_s": 320,
                   "skip_s": 60, "settle": 8},
        "date": "2026-12-03", "commit": "abc1234",
        "modes": {"off": {"runs": [_arm(50.0), _arm(60.0), _arm(40.0)]},
                  "on": {"runs": [_arm(55.0), _arm(54.0), _arm(44.0, 8)]}},
    }  # fmt: skip
    table = _bench().render(result)
    assert "3 run(s) per arm" in table and "2026-12-03 at commit abc1234" in table
    # Medians 50 and 54; per-run ratios in run order.
    assert "| normal | 0-100 | 50.00 | 54.00 | 1.08x | 1.10x, 0.90x, 1.10x |" in table
    assert "[4, 8] (4, 4, 8)" in table
    # A file from before --runs (one run per arm, no date) still renders.
    old = {"config": result["config"], "modes": {"off": _arm(50.0), "on": _arm(55.0)}}
    assert "| normal | 0-100 | 50.00 | 55.00 | 1.10x | 1.10x |" in _bench().render(old)


def _cee6_profile() -> Any:
    from tests.helpers.clusters import make_profile

    zone = np.array([0, 0, 1, 1, 2, 2])
    mbit = {(0, 1): 100.0, (1, 2): 20.0, (0, 2): 20.0}  # end reaches the cloud through the edge
    rate = np.array(
        [[1000.0 if a == b else mbit[min(a, b), max(a, b)] for b in zone] for a in zone]
    )
    return make_profile(
        speeds=[4.0, 4.0, 2.5, 2.5, 1.0, 1.0],
        num_blocks=8,
        bandwidth=rate * 1e6 / 8 * 0.9,  # each path measured at 90% of its bottleneck
        block_s=0.01,
        activation_bytes=200_000,
        parameter_bytes=1_000_000,
    )


def test_the_degraded_profile_scales_the_pairs_whose_path_bottleneck_moves() -> None:
    bench = _bench()
    profile = _cee6_profile()
    before = profile.bandwidth_matrix()
    quarter = bench.degraded_profile(profile, CEE6, {("edge", "end"): 5.0}).bandwidth_matrix()
    crossing = {(a, b) for a in range(6) for b in range(6) if (a >= 4) != (b >= 4)}
    for a in range(6):
        for b in range(6):
            factor = 0.25 if (a, b) in crossing else 1.0  # 20 -> 5 Mbit/s on every such path
            assert quarter[a, b] == pytest.approx(before[a, b] * factor), (a, b)
    # The cloud-edge link at 10 Mbit/s: cloud-edge pairs at a tenth, cloud-end pairs at half
    # (their bottleneck moves from 20 to 10), the rest as measured.
    tenth = bench.degraded_profile(profile, CEE6, {("cloud", "edge"): 10.0}).bandwidth_matrix()
    assert tenth[0, 2] == pytest.approx(before[0, 2] / 10)
    assert tenth[4, 1] == pytest.approx(before[4, 1] / 2)
    assert tenth[2, 4] == pytest.approx(before[2, 4]) and tenth[0, 1] == before[0, 1]
    with pytest.raises(ValueError, match="6 devices"):
        bench.degraded_profile(profile, load_topology(ROOT / "configs/lab/lan4.yaml"), {})


def test_the_oracle_plans_for_the_first_event_of_the_trace(tmp_path: Path) -> None:
    from lightning_deepcee.planner import Plan, plan_search, predict_plan

    bench = _bench()
    profile = _cee6_profile()
    path = tmp_path / "profile.json"
    profile.to_json(path)
    static = plan_search(profile, num_blocks=8, global_batch_size=32)
    assert static.ranks != (0, 1), "the static plan crosses the cloud-edge link"
    trace = bench.make_trace(CEE6, ("cloud", "edge"), 10.0, 20.0, 0.02)  # 2 Mbit/s
    assert bench.degraded_links(trace, CEE6) == {("cloud", "edge"): 2.0}
    found = bench.oracle_plan(path, static.to_dict(), CEE6, trace, tmp_path / "oracle.json")
    oracle = Plan.from_json(tmp_path / "oracle.json")
    assert oracle.to_dict() == found and oracle.global_batch_size == 32
    oracle.check_matches(8, 6, profile.model_fingerprint, profile.cluster_fingerprint)
    degraded = bench.degraded_profile(profile, CEE6, {("cloud", "edge"): 2.0})
    # The oracle's plan is the search's best on the degraded network: the static one is slower.
    assert oracle.predicted_step_time_s == pytest.approx(
        predict_plan(degraded, oracle).step_time_s, rel=1e-9
    )
    assert predict_plan(degraded, static).step_time_s > oracle.predicted_step_time_s
    lan = [{"at_s": 1.0, "link": ["end0", "end"], "bandwidth_mbit": 1.0}]
    with pytest.raises(SystemExit, match="WAN bandwidth"):
        bench.degraded_links(lan, CEE6)


def test_the_table_gives_the_adapters_share_of_the_oracles_gain() -> None:
    bench = _bench()
    assert bench.oracle_share(40.0, 49.0, 50.0) == "90%"
    assert bench.oracle_share(40.0, 38.0, 50.0) == "-20%"
    assert bench.oracle_share(40.0, 45.0, 40.0) == "-"  # no gain to share
    assert bench.oracle_share(None, 45.0, 50.0) == "-"
    trace = [{"at_s": 100.0, "link": ["cloud", "edge"], "bandwidth_mbit": 10.0},
             {"at_s": 220.0, "link": ["cloud", "edge"], "bandwidth_mbit": 100.0}]  # fmt: skip
    plan = {"stages": [{"ranks": [0, 1]}, {"ranks": [2, 3]}], "schedule": "1f1b",
            "num_microbatches": 4}  # fmt: skip
    result = {
        "config": {"topology": "configs/lab/cee6.yaml", "trace": trace, "size": "gpt5m",
                   "global_batch": 48, "microbatches": 2, "schedule": "1f1b", "end_s": 320,
                   "skip_s": 60, "settle": 8, "layout": "plan", "plan": plan,
                   "oracle_plan": {**plan, "stages": [{"ranks": [0, 1]}]}},
        "modes": {"off": {"runs": [_arm(40.0)]}, "on": {"runs": [_arm(46.0)]},
                  "oracle": {"runs": [_arm(50.0)]}},
    }  # fmt: skip
    table = bench.render(result)
    assert "plan searched for the degraded network (ranks 0,1, 1f1b with 4" in table
    assert "| settled oracle | share |" in table
    assert "| 40.00 | 46.00 | 1.15x | 50.00 | 60% |" in table
    del result["modes"]["oracle"]  # no oracle arm: no oracle columns
    assert "share" not in bench.render(result)


def test_the_oracle_arm_runs_its_own_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _bench()
    calls: list[list[str]] = []
    oracle_dict = {"stages": [{"ranks": [0, 1]}], "schedule": "1f1b", "num_microbatches": 2}

    def lab(topology: Path, trace: Path | None, out: Path, timeout_s: float, worker: list[str]):
        calls.append(worker)
        option = dict(zip(worker[::2], worker[1::2], strict=False))
        if "--plan-out" in option:
            static = {**_plan((0, 1), (2, 3), (4, 5)), "schedule": "1f1b", "num_microbatches": 4}
            Path(option["--plan-out"]).write_text(json.dumps(static))
            Path(option["--profile-cache"]).write_text("{}")
        else:
            Path(option["--steps-log"]).write_text("")
        return 0

    def oracle(profile: Path, plan: dict[str, Any], topo: Any, trace: Any, path: Path) -> Any:
        path.write_text(json.dumps(oracle_dict))
        return oracle_dict

    monkeypatch.setattr(bench, "_lab", lab)
    monkeypatch.setattr(bench, "oracle_plan", oracle)
    argv = ["--topology", str(ROOT / "configs/lab/cee6.yaml"), "--results", str(tmp_path / "r"),
            "--logs", str(tmp_path / "logs"), "--modes", "off,on,oracle"]  # fmt: skip
    assert bench.harness_main(argv) == 0
    arms = [dict(zip(c[::2], c[1::2], strict=False)) for c in calls[1:]]
    assert [a["--adapter"] for a in arms] == ["off", "on", "off"]
    assert arms[0]["--plan"].endswith("/plan.json") and arms[2]["--plan"].endswith(
        "oracle_plan.json"
    )
    result = json.loads((tmp_path / "r" / "adapter_cee6_planned.json").read_text())
    assert result["config"]["oracle_plan"] == oracle_dict and set(result["modes"]) == {
        "off",
        "on",
        "oracle",
    }
    with pytest.raises(SystemExit):
        bench.harness_main([*argv[:-1], "off,maybe"])


def test_the_oracle_needs_the_planned_layout(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _bench().harness_main(["--topology", "t.yaml", "--layout", "manual", "--trace", "x.yaml",
                               "--modes", "off,oracle"])  # fmt: skip
    assert "--modes oracle needs --layout plan" in capsys.readouterr().err


def test_reactions_run_from_the_drop_to_the_first_step_after_each_applied_move() -> None:
    bench = _bench()
    records = [{"step": s, "end_s": 100.0 + 2 * s, "wall_s": 2.0, "microbatches": 4}
               for s in range(1, 40)]  # fmt: skip
    run = {
        "records": records,
        "decisions": [
            "DeepCEE adapter: step 2 split-applied: x2 predicted 12% faster",  # before the drop
            "DeepCEE adapter: step 12 split-applied: x4 predicted 21% faster than x1",
            "DeepCEE adapter: step 14 keep split of step 12: 2010 -> 1495 ms/step",
            "DeepCEE adapter: step 20 re-plan for link(s) net1->net0: kept (no plan can gain)",
            "DeepCEE adapter: step 30 re-plan for link(s) net0->net1, net1->net0: applied (32%)",
            "DeepCEE adapter: step 34 return-applied: the link(s) left are back",
            "DeepCEE adapter: step 39 re-plan for link(s) net0->net1: applied (the last step)",
        ],
    }
    # The drop at 120 s; the steps after 12 and 30 end at 126 and 162 s; none after 39. The
    # return counts from the restore at 150 s: the step after 34 ends at 170 s.
    assert bench.reactions_s(run, 120.0, 150.0) == [6.0, 42.0, 20.0]
    assert bench.reactions_s({"records": records}, 120.0) == []


def _steady(step_s: list[tuple[float, float]], end_s: float) -> dict[str, Any]:
    """A run whose steps take ``s`` seconds from each ``(from_s, s)`` on, until ``end_s``."""
    records, t, step = [], 0.0, 0
    while t < end_s:
        span = [s for start, s in step_s if start <= t][-1]
        t, step = t + span, step + 1
        records.append({"step": step, "end_s": t, "wall_s": span, "microbatches": 2})
    return {"records": records}


def test_after_the_reaction_each_arm_is_measured_over_the_adapters_settled_window() -> None:
    bench = _bench()
    trace = [{"at_s": 100.0, "link": ["cloud", "edge"], "bandwidth_mbit": 10.0},
             {"at_s": 200.0, "link": ["cloud", "edge"], "bandwidth_mbit": 100.0}]  # fmt: skip
    plan = {"stages": [{"ranks": [0]}, {"ranks": [1]}], "schedule": "1f1b", "num_microbatches": 2}
    # Static: 1 s steps, 4 s in the cut. Oracle: 2 s steps throughout. Adapter: 4 s steps in the
    # cut until its move (applied at the step ending at 120 s; the next ends at 124 s), 2 s after.
    on = _steady([(0.0, 1.0), (100.0, 4.0), (124.0, 2.0), (200.0, 1.0)], 300.0)
    moved = next(r["step"] for r in on["records"] if r["end_s"] >= 120.0)
    on["decisions"] = [f"DeepCEE adapter: step {moved} re-plan for link(s) net0->net1: applied"]
    result = {
        "config": {"topology": "configs/lab/cee6.yaml", "trace": trace, "size": "gpt5m",
                   "global_batch": 48, "microbatches": 2, "schedule": "1f1b", "end_s": 300,
                   "skip_s": 0, "settle": 0, "layout": "plan", "plan": plan,
                   "oracle_plan": {**plan, "stages": [{"ranks": [0, 1]}]}},
        "modes": {"off": {"runs": [_steady([(0.0, 1.0), (100.0, 4.0), (200.0, 1.0)], 300.0)]},
                  "on": {"runs": [on]},
                  "oracle": {"runs": [_steady([(0.0, 2.0)], 300.0)]}},
    }  # fmt: skip
    for run in (*result["modes"]["off"]["runs"], on, *result["modes"]["oracle"]["runs"]):
        run["phases"] = bench.summarise(run["records"], bench._phases(trace, 300.0), 48, 0, 0.0)
    lines = bench.after_reaction(result, bench._phases(trace, 300.0))
    # The degraded window starts at 124 s: 76 s left; 48 samples per 2 s against 48 per 4 s.
    assert "| degraded | last 76 of 100 s | 12.00 | 24.00 | 2.00x | 24.00 | 1.00x |" in lines
    # No move after the restore: the whole phase, and no oracle figure outside its network.
    assert "| recovered | last 100 of 100 s | 48.00 | 48.00 | 1.00x | - | - |" in lines
    assert "After the reaction" in bench.render(result)
    on["decisions"] = []
    assert "After the reaction" not in bench.render(result)


def test_a_device_trace_slows_a_device_the_plan_trains_on(tmp_path: Path) -> None:
    bench = _bench()
    plan = _plan((0, 1), (2, 3))
    args = _args(tmp_path, drop_at_s=100.0, restore_at_s=200.0, slow_device="edge0")
    path, trace = bench._trace_for_plan(args, CEE6, plan, tmp_path)
    assert trace == [
        {"at_s": 100.0, "device": "edge0", "cpu": 0.05},  # a third of its 0.15
        {"at_s": 200.0, "device": "edge0", "cpu": 0.15},
    ]
    assert load_trace(path, CEE6).to_list() == trace
    assert bench._phases(trace, 300.0)[1] == ("degraded", 100.0, 200.0)
    assert bench.degraded_devices(trace, CEE6) == {2: pytest.approx(3.0)}
    assert bench.degraded_links(trace, CEE6) == {}
    assert bench.describe_trace({"trace": trace}) == (
        "trace: edge0 keeps 0.33 of its CPU quota (0.05 of 0.15 of the machine) from 100 to 200 s"
    )
    with pytest.raises(SystemExit, match="the plan trains on"):
        bench._trace_for_plan(_args(tmp_path, slow_device="end0"), CEE6, plan, tmp_path)
    with pytest.raises(ValueError, match="--slow-factor"):
        bench.slow_trace(CEE6, "edge0", 1.0, 2.0, 0.5)
