"""The demo CNN: its pipeline blocks are the model, and micro-batching leaves gradients exact."""

from __future__ import annotations

import pytest
import torch

from lightning_deepcee.demo import ConvNet, SyntheticImageDataModule, synthetic_images


def _grads(model: ConvNet) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_blocks_chain_to_the_forward_pass() -> None:
    model = ConvNet(width=8, num_blocks=5, downsample_every=2)
    x = synthetic_images(6, image_size=16, seed=3).tensors[0]
    spec = model.configure_pipeline()
    out = x
    for block in spec.blocks:
        out = block(out)
    torch.testing.assert_close(out, model(x))
    assert len(spec.blocks) == 7 and out.shape == (6, 10)
    # stem 8 channels, downsampling at blocks 2 and 4: 8 -> 16 -> 32 channels, 16 -> 4 pixels
    assert spec.blocks[-2](spec.blocks[-3](torch.zeros(1, 16, 8, 8))).shape == (1, 32, 4, 4)


def test_microbatched_gradient_equals_whole_batch() -> None:
    """GroupNorm, not BatchNorm: a split batch gives the whole batch's gradient (the invariant)."""
    x, y = synthetic_images(10, image_size=16, seed=1).tensors
    model = ConvNet(width=8, num_blocks=4, downsample_every=2)
    loss_fn = model.configure_pipeline().loss_fn
    loss_fn(model(x), (x, y)).backward()
    whole = _grads(model)
    model.zero_grad()
    for rows in (slice(0, 4), slice(4, 7), slice(7, 10)):
        n = rows.stop - rows.start
        (loss_fn(model(x[rows]), (x[rows], y[rows])) * n / 10).backward()
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, whole[name], rtol=1e-4, atol=1e-6)


def test_synthetic_images_are_seeded_and_split() -> None:
    a, b = synthetic_images(8, seed=5), synthetic_images(8, seed=5)
    for t, u in zip(a.tensors, b.tensors, strict=True):
        assert torch.equal(t, u)
    data = SyntheticImageDataModule(batch_size=4, num_train=16, num_val=8)
    data.setup("fit")
    assert data.train_set is not None and data.val_set is not None
    assert len(data.train_set) == 16 and len(data.val_set) == 8
    assert not torch.equal(data.val_set.tensors[0][:8], data.train_set.tensors[0][:8])
    with pytest.raises(ValueError, match="num_classes >= 2"):
        synthetic_images(4, num_classes=1)
    with pytest.raises(ValueError, match="must be >= 1"):
        ConvNet(num_blocks=0)
