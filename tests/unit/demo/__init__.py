"""Unit tests of the demo models, lightning_deepcee.demo."""
