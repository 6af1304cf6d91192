"""Unit tests of the scripts under benchmarks/ (loaded with tests.helpers.benchmarks)."""
