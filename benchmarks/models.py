"""Model presets and block splits shared by every system of ``benchmarks/lab_bench.py``.

Every system trains the *same* model, with identical initial weights from ``seed``, on the same
data; only the way the work is spread over the devices differs. Two families:

- ``gpt``: ``lightning_deepcee.demo.GPT`` (embedding, ``n_layer`` transformer blocks, head) on
  Shakespeare windows;
- ``cnn``: ``lightning_deepcee.demo.ConvNet`` (stem, residual blocks, pooling head) on the seeded
  synthetic image set (32x32 RGB, 10 classes).
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = [
    "CNN_PRESETS",
    "GPT_PRESETS",
    "MODELS",
    "build_model",
    "count_parameters",
    "gpt_kwargs",
    "model_blocks",
    "model_loss",
    "uniform_split",
]

# Sizes (parameters of lightning_deepcee.demo.GPT with vocab 96). ``n_layer`` is 10 so that the
# 12 blocks (embed + 10 layers + head) split evenly into 6 ranks x 2 virtual stages for
# ScheduleInterleavedZeroBubble on cee6.
GPT_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(n_layer=10, n_embd=64, n_head=4, block_size=64),  # ~0.5M parameters
    "small": dict(n_layer=10, n_embd=128, n_head=4, block_size=64),  # ~2.0M
    "medium": dict(n_layer=10, n_embd=256, n_head=8, block_size=64),  # ~7.9M
    # ~5.2M parameters over 32-token windows: the 5-20M model with a step that the
    # lab's slowest devices (6% of two cores) finish in seconds.
    "gpt5m": dict(n_layer=10, n_embd=208, n_head=8, block_size=32),
    # The same model and weights, listed to the pipeline as 22 blocks (each layer's attention
    # and MLP apart), so stages can end mid-layer: devices of very different speeds balance.
    "gpt5m-sublayer": dict(
        n_layer=10, n_embd=208, n_head=8, block_size=32, pipeline_blocks="sublayer"
    ),
}

# ConvNet sizes: 12 blocks (stem + 10 residual blocks + head), like the GPT presets.
CNN_PRESETS: dict[str, dict[str, Any]] = {
    "small": dict(width=32, num_blocks=10, downsample_every=4),  # ~0.88M parameters
    "medium": dict(width=64, num_blocks=10, downsample_every=4),  # ~3.5M
}
MODELS = {"gpt": GPT_PRESETS, "cnn": CNN_PRESETS}


def build_model(model: str, size: str) -> Any:
    """The benchmark's LightningModule (same seed, so identical weights on every process)."""
    if model == "gpt":
        from lightning_deepcee.demo import GPT

        return GPT(**gpt_kwargs(size))
    if model == "cnn":
        from lightning_deepcee.demo import ConvNet

        if size not in CNN_PRESETS:
            raise ValueError(f"unknown CNN size {size!r}; choose one of {sorted(CNN_PRESETS)}")
        return ConvNet(num_classes=10, learning_rate=3e-3, seed=0, **CNN_PRESETS[size])
    raise ValueError(f"unknown model {model!r}; choose one of {sorted(MODELS)}")


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The ordered blocks the pipelining baselines split (what ``configure_pipeline`` lists)."""
    return list(model.configure_pipeline().blocks)  # type: ignore[operator]


def model_loss(model: str) -> Any:
    """``loss(output, target)`` for torch.distributed.pipelining's schedules."""
    from torch.nn import functional as F

    if model == "gpt":
        return lambda logits, target: F.cross_entropy(logits.flatten(0, 1), target.flatten())
    return lambda logits, target: F.cross_entropy(logits, target)


def gpt_kwargs(size: str) -> dict[str, Any]:
    if size not in GPT_PRESETS:
        raise ValueError(f"unknown GPT size {size!r}; choose one of {sorted(GPT_PRESETS)}")
    return dict(vocab_size=96, dropout=0.0, learning_rate=3e-3, seed=0, **GPT_PRESETS[size])


def uniform_split(num_blocks: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous block ranges, as even as possible by block count (earlier stages get extra)."""
    if num_stages > num_blocks:
        raise ValueError(f"cannot split {num_blocks} blocks into {num_stages} stages")
    base, extra = divmod(num_blocks, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        end = start + base + (1 if s < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    for family, presets in MODELS.items():
        for name in presets:
            m = build_model(family, name)
            blocks = [count_parameters(b) for b in model_blocks(m)]
            print(family, name, f"{count_parameters(m):,}", len(blocks), blocks[:3])
            del m
