"""The test suite: unit/ (one process), multiprocess/ (torch.distributed on CPU), lab/ (Mininet)."""
