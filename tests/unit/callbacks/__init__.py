"""Unit tests of lightning_deepcee's callbacks."""
