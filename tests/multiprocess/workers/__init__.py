"""Scripts that tests.helpers.launch.torchrun starts, one process a rank (not test modules)."""
