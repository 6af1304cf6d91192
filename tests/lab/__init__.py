"""The lab tests: root and Mininet required (run with -m lab)."""
