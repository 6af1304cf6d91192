"""The part of a checkpoint shard a re-plan sends to one receiver: its blocks' entries only,
rebuilt by ``repartition`` exactly as from the whole shard."""

from __future__ import annotations

import torch

from lightning_deepcee.runtime.checkpoint import repartition, shard_part


def _shard() -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    blocks = torch.nn.ModuleDict({"b0": torch.nn.Linear(3, 3), "b1": torch.nn.Linear(3, 2)})
    blocks.register_buffer("outside", torch.ones(1))  # belongs to no block
    params = list(blocks.named_parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for _, p in params[:2]]}, {"params": [p for _, p in params[2:]], "lr": 0.5}]
    )
    blocks["b1"](blocks["b0"](torch.randn(4, 3))).sum().backward()
    optimizer.step()
    shard = {
        "state_dict": blocks.state_dict(),
        "optimizer_states": [optimizer.state_dict()],
        "optimizer_param_names": [[name for name, _ in params]],
        "lr_schedulers": [{"last_epoch": 1}],
    }
    return blocks, shard


def test_a_receivers_part_rebuilds_as_the_whole_shard_does() -> None:
    blocks, shard = _shard()
    names = ["b1.weight", "b1.bias"]
    part = shard_part(shard, lambda name: name.startswith("b1.") or name == "outside")
    assert sorted(part["state_dict"]) == ["b1.bias", "b1.weight", "outside"]
    assert part["optimizer_param_names"] == [names]
    assert sorted(part["optimizer_states"][0]["state"]) == [2, 3]
    assert [g["params"] for g in part["optimizer_states"][0]["param_groups"]] == [[], [2, 3]]
    assert part["lr_schedulers"] == shard["lr_schedulers"]
    # The receiver's fresh optimizer over its own parameters, rebuilt from the part and from
    # the whole shard: the same weights, moments and group settings.
    fresh = torch.optim.AdamW([blocks["b1"].weight, blocks["b1"].bias], lr=0.1).state_dict()
    keys = ["b1.weight", "b1.bias", "outside"]
    got = repartition([part], keys, [(fresh, names)])
    want = repartition([shard], keys, [(fresh, names)])
    assert got["state_dict"].keys() == want["state_dict"].keys()
    for key in keys:
        assert torch.equal(got["state_dict"][key], want["state_dict"][key])
    got_state, want_state = got["optimizer_states"][0], want["optimizer_states"][0]
    assert got_state["param_groups"] == want_state["param_groups"]
    assert got_state["param_groups"][0]["lr"] == 0.5
    for index in (0, 1):
        for field in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got_state["state"][index][field], want_state["state"][index][field])
