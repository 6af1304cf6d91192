"""benchmarks/report.py: every committed results table matches the JSON it is made from; the
benchmarks' own tables (lab_bench's set-up parts, tta_bench's target and invocation)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.benchmarks import load_benchmark
from tests.helpers.paths import ROOT


def _copy_tree(tmp_path: Path) -> Path:
    """The files report.py reads and writes, copied to ``tmp_path``."""
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    for path in (ROOT / "benchmarks" / "results").iterdir():
        if path.suffix in (".json", ".md"):
            shutil.copy(path, results / path.name)
    (tmp_path / "docs").mkdir()
    for path in (ROOT / "docs").glob("*.md"):
        shutil.copy(path, tmp_path / "docs" / path.name)
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    return tmp_path


def test_committed_tables_match_their_json(capsys: pytest.CaptureFixture[str]) -> None:
    report = load_benchmark("report")
    code = report.main(["--check"])
    assert code == 0, capsys.readouterr().err + "\nrun: python benchmarks/report.py"


def test_a_stale_table_fails_the_check_and_is_rewritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = load_benchmark("report")
    root = _copy_tree(tmp_path)
    assert report.main(["--check", "--root", str(root)]) == 0
    capsys.readouterr()

    table = root / "benchmarks" / "results" / "cee6_gpt5m.md"
    committed = table.read_text()
    table.write_text(committed + "| a row typed by hand |\n")
    readme = root / "README.md"
    committed_readme = readme.read_text()
    start = committed_readme.index("<!-- report:throughput -->")
    end = committed_readme.index("<!-- /report:throughput -->")
    readme.write_text(
        committed_readme[:start]
        + "<!-- report:throughput -->\n\n| a table typed by hand |\n\n"
        + committed_readme[end:]
    )

    assert report.main(["--check", "--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert "stale: benchmarks/results/cee6_gpt5m.md" in err
    assert "stale: README.md" in err
    assert "docs/" not in err  # only what was corrupted
    assert table.read_text() != committed  # --check writes nothing

    assert report.main(["--root", str(root)]) == 0
    assert table.read_text() == committed
    assert readme.read_text() == committed_readme
    assert report.main(["--check", "--root", str(root)]) == 0


def test_a_changed_json_makes_its_table_stale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = load_benchmark("report")
    root = _copy_tree(tmp_path)
    path = root / "benchmarks" / "results" / "tta_cee6_gpt5m.json"
    data = json.loads(path.read_text())
    data["config"]["target"] = 2.5
    path.write_text(json.dumps(data))
    assert report.main(["--check", "--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert "stale: benchmarks/results/tta_cee6_gpt5m.md" in err
    assert "stale: docs/benchmarks.md" in err  # it embeds that table


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ("<!-- report:no_such_table -->\n<!-- /report:no_such_table -->\n", "unknown report block"),
        ("<!-- report:throughput -->\n", "has no closing marker"),
    ],
)
def test_a_bad_block_is_an_error_naming_the_document(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], block: str, message: str
) -> None:
    report = load_benchmark("report")
    root = _copy_tree(tmp_path)
    doc = root / "docs" / "security.md"
    doc.write_text(doc.read_text() + "\n" + block)
    assert report.main(["--check", "--root", str(root)]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "security.md" in err


def test_the_cpu_floor_fit_recovers_a_known_line() -> None:
    fit_cpu_floor = load_benchmark("fit_cpu_floor")
    rows = [
        fit_cpu_floor.RankRow(
            benchmark="b",
            system="deepcee",
            run=rank % 2,
            rank=rank,
            cpu_share=0.5,
            cpu_s=0.3 + 0.02 + 3e-9 * moved,  # compute 0.25, optimizer 0.05, host 20 ms + 3 ns/B
            compute_cpu_s=0.25,
            optimizer_cpu_s=0.05,
            received_bytes=moved / 2,
            sent_bytes=moved / 4,
            allreduce_bytes=moved / 4,
        )
        for rank, moved in enumerate([1e6, 4e6, 9e6, 2e7])
    ]
    unlimited = [
        fit_cpu_floor.RankRow(**{**fit_cpu_floor.asdict(rows[0]), "cpu_share": 1.0, "cpu_s": 9.0})
    ]
    fit = fit_cpu_floor.fit(rows + unlimited)  # a rank without a quota is not fitted
    assert fit.per_step_s == pytest.approx(0.02)
    assert fit.per_byte_s == pytest.approx(3e-9)
    assert fit.residual_s == pytest.approx(0.0, abs=1e-12)
    assert (fit.num_ranks, fit.num_runs) == (4, 2)
    with pytest.raises(ValueError, match="at least 2 ranks under a CPU quota"):
        fit_cpu_floor.fit(unlimited)


def test_the_cpu_floor_rows_count_every_byte_a_rank_moves(tmp_path: Path) -> None:
    """Received bytes from its own statistics, sent bytes from its peers', and the ring
    all-reduce of a shared stage (``4 (n-1)/n`` of the stage's parameter bytes)."""
    fit_cpu_floor = load_benchmark("fit_cpu_floor")
    device = {"parameter_bytes": [100, 50], "cpu_share": 0.5}
    stats = [
        {"cpu_s": 0.3, "cpu_F": 0.1, "cpu_B": 0.05, "cpu_W": 0.05, "optimizer_cpu": 0.01,
         "recv_bytes_from2": 7},
        {"cpu_s": 0.3, "cpu_F": 0.1, "optimizer_cpu": 0.01, "recv_bytes_from2": 5},
        {"cpu_s": 0.2, "cpu_F": 0.1, "recv_bytes_from0": 11, "recv_bytes_from1": 13},
    ]  # fmt: skip
    run = {
        "run": 0,
        "profile": {"devices": [device, device, {**device, "cpu_share": 1.0}]},
        "plan": {
            "stages": [
                {"block_range": [0, 1], "ranks": [0, 1]},
                {"block_range": [1, 2], "ranks": [2]},
            ]
        },
        "rank_stats": stats,
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"systems": {"deepcee": {"runs": [run]}, "ddp": {"runs": [{}]}}}))
    rows = fit_cpu_floor.load_rows([path])
    assert [(r.rank, r.received_bytes, r.sent_bytes, r.allreduce_bytes) for r in rows] == [
        (0, 7, 11, 200.0),
        (1, 5, 13, 200.0),
        (2, 24, 12, 0.0),
    ]
    assert rows[0].host_cpu_s == pytest.approx(0.3 - 0.2 - 0.01)
    assert rows[1].host_cpu_s == pytest.approx(0.3 - 0.1 - 0.01)
    assert rows[2].cpu_share == 1.0
    saved = tmp_path / "rows.json"
    assert fit_cpu_floor.main([str(path), "--save-rows", str(saved)]) == 0
    assert fit_cpu_floor.load_rows([saved]) == rows


def _result(setup: dict[str, float] | None, trial_cost: float | None = None) -> dict[str, Any]:
    run: dict[str, Any] = dict(
        run=0, samples_per_s=50.0, global_batch=48, world_size=2, num_stages=2,
        schedule="zb-h1", num_microbatches=4, ranges=[[0, 6], [6, 12]], placement=[[0], [1]],
        predicted_step_s=1.0, step_times_s=[1.0, 0.96, 0.96], window_steps=2,
    )  # fmt: skip
    if setup is not None:
        run["setup_s"] = setup
    if trial_cost is not None:
        run["trial_cost_s"] = trial_cost
    config = dict(
        topology="configs/lab/cee8.yaml", model="gpt", size="gpt5m", gpt=dict(block_size=32),
        global_batch=48, steps=3, warmup=1, microbatches=8, systems=["deepcee"], parameters=10,
    )  # fmt: skip
    return dict(config=config, systems=dict(deepcee=dict(runs=[run])))


def test_the_table_gives_each_planned_runs_set_up_parts() -> None:
    parts = dict(profile=28.5, profile_blocks=17.9, profile_network=10.2, plan=4.4, build=0.1)
    table = load_benchmark("lab_bench").render(_result(parts))
    assert "| deepcee | 0 | 33.0 | 28.5 | 17.9 | 10.2 | 4.4 | 0.1 |  |" in table
    # The plan trial's cost in training comes beside set-up, and summed with it.
    parts["trial"] = 0.2
    table = load_benchmark("lab_bench").render(_result(parts, trial_cost=3.5))
    assert "| deepcee | 0 | 33.2 | 28.5 | 17.9 | 10.2 | 4.4 | 0.1 | 0.2 | 3.5 | 36.7 |" in table
    assert "| trial cost | set-up + trial cost |" in table
    # Runs recorded before set-up was kept get no set-up table.
    assert "Set-up on rank 0" not in load_benchmark("lab_bench").render(_result(None))


def test_the_time_to_accuracy_table_names_its_target_and_invocation() -> None:
    def run(step: int, train_s: float) -> dict[str, Any]:
        return dict(run=0, reached=dict(step=step, train_s=train_s, val_loss=2.29))

    config = dict(
        topology="configs/lab/cee6.yaml", size="gpt5m", global_batch=48, target=2.297,
        target_from="ddp@cloud at step 100", eval_batches=4, eval_every=10, date="2026-12-03",
        commit="abc1234",
    )  # fmt: skip
    result = dict(
        config=config,
        systems={"ddp@cloud": dict(runs=[run(90, 80.0)]), "deepcee": dict(runs=[run(90, 64.0)])},
    )
    table = load_benchmark("tta_bench").render(result)
    assert "target validation loss 2.297 (reached by ddp@cloud at step 100; on the first" in table
    assert "One invocation on 2026-12-03 at commit `abc1234`" in table
    assert "| ddp@cloud | 1/1 | 80.0 | 80.0 | 80.0 | 90 | 1.25x |" in table


def test_planned_deepcee_systems_warm_up_past_the_plan_trial() -> None:
    from lightning_deepcee.planner.rivals import TRIAL_STEPS

    bench = load_benchmark("lab_bench")
    assert bench.TRIAL_STEPS == TRIAL_STEPS
    # The window stays; the warm-up covers the trial, and the fit is long enough for it to run.
    assert bench.system_steps("deepcee", 10, 3, planned=True) == (24, 17)
    assert bench.system_steps("deepcee-kept", 30, 16, planned=True) == (30, 16)
    assert bench.system_steps("deepcee-adapter", 40, 3, planned=True) == (51, 14)
    assert bench.system_steps("deepcee", 10, 3, planned=False) == (10, 3)  # --plan: no trial
    for system in ("ddp", "ddp@cloud", "pipe-zb", "deepcee-manual", "deepcee-dp"):
        assert bench.system_steps(system, 10, 3, planned=True) == (10, 3)
    result = _result(None)
    result["systems"]["deepcee"]["runs"][0].update(steps=24, warmup=17)
    table = bench.render(result)
    assert "`deepcee` runs 24 steps and warms up 17 (its plan trial trains the first" in table
