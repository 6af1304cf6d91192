"""The demo GPT: both block granularities chain to the forward pass and keep exact gradients."""

from __future__ import annotations

import pytest
import torch

from lightning_deepcee.demo import GPT
from lightning_deepcee.runtime.stage import build_stage, get_pipeline_spec

SIZE = dict(vocab_size=32, block_size=8, n_layer=3, n_head=2, n_embd=16, seed=4)


def _tokens(rows: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    t = torch.randint(0, 32, (rows, 9), generator=g)
    return t[:, :-1], t[:, 1:]


@pytest.mark.parametrize(("granularity", "count"), [("layer", 5), ("sublayer", 8)])
def test_blocks_chain_to_the_forward_pass(granularity: str, count: int) -> None:
    model = GPT(**SIZE, pipeline_blocks=granularity)
    x, _ = _tokens()
    spec = get_pipeline_spec(model)  # checks every parameter belongs to one block
    out = x
    for block in spec.blocks:
        out = block(out)
    assert len(spec.blocks) == count
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)


def test_sublayer_blocks_are_the_same_model() -> None:
    """Same parameters, names and initial weights: only where the pipeline may cut differs."""
    layer, sub = GPT(**SIZE), GPT(**SIZE, pipeline_blocks="sublayer")
    a, b = layer.state_dict(), sub.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    halves = get_pipeline_spec(sub).blocks[1:-1]
    assert [type(h).__name__ for h in halves] == ["_Attention", "_MLP"] * 3


def test_a_stage_cut_after_attention_gives_the_whole_model_gradient() -> None:
    """Stages [embed, attn0] | [mlp0 .. head] run in turn equal one module, gradients included."""
    x, y = _tokens()
    whole = GPT(**SIZE, pipeline_blocks="sublayer")
    whole.configure_pipeline().loss_fn(whole(x), (x, y)).backward()
    ranges = [(0, 2), (2, 8)]
    models = [GPT(**SIZE, pipeline_blocks="sublayer") for _ in ranges]
    stages = [build_stage(m, m.configure_pipeline(), ranges, i) for i, m in enumerate(models)]
    hidden = x
    for block in stages[0].blocks:
        hidden = block(hidden)
    sent = hidden.detach().requires_grad_()
    out = sent
    for block in stages[1].blocks:
        out = block(out)
    models[1].configure_pipeline().loss_fn(out, (x, y)).backward()
    hidden.backward(sent.grad)
    got = {n: p.grad for m in models for n, p in m.named_parameters()}
    want = {n: p.grad for n, p in whole.named_parameters()}
    assert got.keys() == want.keys()
    assert any(n.startswith("blocks.0.attn.") for n, _ in models[0].named_parameters())
    assert not any(n.startswith("blocks.0.mlp.") for n, _ in models[0].named_parameters())
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7)


def test_unknown_granularity_is_refused() -> None:
    with pytest.raises(ValueError, match="pipeline_blocks='heads'"):
        GPT(**SIZE, pipeline_blocks="heads")
