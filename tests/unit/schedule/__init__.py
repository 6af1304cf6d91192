"""Unit tests of lightning_deepcee's schedule."""
