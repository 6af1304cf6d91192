"""Tests of the documentation: README.md and docs/ against the code and the committed results."""
