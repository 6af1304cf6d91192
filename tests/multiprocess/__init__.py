"""Several processes over torch.distributed (gloo on CPU); workers/ holds the torchrun scripts."""
