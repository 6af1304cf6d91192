"""README's "Run across sites" commands on a 3-region lab, and measuring without training (root).

The per-site command is read from README.md between its ``multi-site-command`` markers, as CI
reads its test command, and each emulated site runs it in its own network namespace with the
README's variables set from the lab: ``SITE`` (its node rank), ``SITES``, ``MASTER`` (site 0's
address), ``IFACE`` (its interface towards the others) and ``PROCS=1``. Set-up must profile,
plan and save the plan, profile, timeline and why beside the logs, and training must finish.
Then ``deepcee profile`` under torchrun on the same sites measures without training, and
``deepcee plan`` plans on the profile it saved.

python -m pytest tests/lab/test_lab_sites.py -m lab -q
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_deepcee.cli import main as deepcee_main
from lightning_deepcee.lab.network import LabNetwork
from lightning_deepcee.lab.runner import RunConfig, run_command
from lightning_deepcee.lab.state import StateStore
from lightning_deepcee.lab.topology import Topology, load_topology
from lightning_deepcee.planner import Plan
from lightning_deepcee.profiler import ClusterProfile
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.lab

SITES = ROOT / "configs" / "lab" / "sites3.yaml"


def readme_site_command() -> str:
    """The shell command between README.md's multi-site-command markers."""
    text = (ROOT / "README.md").read_text()
    found = re.search(
        r"<!-- multi-site-command -->\s*```bash\n(.*?)```\s*<!-- /multi-site-command -->",
        text,
        re.S,
    )
    assert found, "README.md has no command between the multi-site-command markers"
    return found.group(1).strip()


def test_readme_names_every_variable_it_uses() -> None:
    command = readme_site_command()
    assert sorted(set(re.findall(r"\$(\w+)", command))) == [
        "IFACE",
        "MASTER",
        "PROCS",
        "SITE",
        "SITES",
    ]


def _workdir(tmp_path: Path) -> Path:
    """A folder where the commands' relative paths (examples/, configs/, runs/) resolve."""
    for name in ("examples", "configs"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def _run_on_sites(topology: Topology, config: RunConfig, store: StateStore) -> tuple[str, str]:
    """Run ``config`` on the lab; every device must exit 0. Returns the first site's log and
    every device's log tail (for assertion messages)."""
    with LabNetwork(topology, store=store) as net:
        result = run_command(net, config)
    logs = {d.name: Path(d.log_path).read_text() for d in result.devices}
    dump = "\n".join(f"== {k}\n{v[-3000:]}" for k, v in logs.items())
    assert result.returncode == 0, dump
    return logs[topology.devices[0].name], dump


def test_the_readme_commands_train_across_three_regions(
    lab_store: StateStore, tmp_path: Path
) -> None:
    topology = load_topology(SITES)
    _workdir(tmp_path)
    script = (
        f"SITES={len(topology.devices)} SITE=$NODE_RANK MASTER=$MASTER_ADDR "
        "IFACE=$GLOO_SOCKET_IFNAME PROCS=1\n" + readme_site_command()
    )
    config = RunConfig(
        command=("bash", "-c", script),
        launcher="env",
        out_dir=tmp_path / "logs",
        cwd=str(tmp_path),
        timeout_s=400,
        echo=False,
    )
    site0, dump = _run_on_sites(topology, config, lab_store)
    for line in ("DeepCEE cluster profile:", "DeepCEE plan:", "device sets scored"):
        assert line in site0, dump
    assert "`Trainer.fit` stopped: `max_steps=12` reached" in site0, dump
    record = tmp_path / "runs" / "sites" / "deepcee"
    plan = Plan.from_json(record / "plan.json")
    profile = ClusterProfile.from_json(record / "profile.json")
    assert profile.num_devices == 3 and list(plan.world_ranks) == [0, 1, 2]
    assert (record / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert "<- chosen" in (record / "why.txt").read_text()


def test_deepcee_profile_measures_without_training_then_deepcee_plan_plans(
    lab_store: StateStore, tmp_path: Path
) -> None:
    topology = load_topology(SITES)
    _workdir(tmp_path)
    command = (
        "python", "-m", "lightning_deepcee.cli", "profile", "examples/train_gpt.py",
        "--config", "configs/sites.yaml", "--trainer.num_nodes=3", "--trainer.devices=1",
    )  # fmt: skip
    config = RunConfig(
        command=command, out_dir=tmp_path / "logs", cwd=str(tmp_path), timeout_s=400, echo=False
    )
    site0, dump = _run_on_sites(topology, config, lab_store)
    assert "`Trainer.fit` stopped: `max_steps=0` reached" in site0, dump
    profile_path = tmp_path / "runs" / "sites" / "deepcee" / "profile.json"
    profile = ClusterProfile.from_json(profile_path)
    assert profile.num_devices == 3
    out = tmp_path / "plan.json"
    argv = ["plan", "--profile", str(profile_path), "--global-batch-size", "24", "--out", str(out)]
    assert deepcee_main(argv) == 0
    plan = Plan.from_json(out)
    assert plan.global_batch_size == 24 and list(plan.world_ranks) == [0, 1, 2]
