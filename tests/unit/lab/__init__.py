"""Unit tests of the emulated lab (lightning_deepcee.lab) that need no root and no Mininet."""
