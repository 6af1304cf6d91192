"""The package version, in a module of its own so that any module may read it without
importing the package root (which names every public class)."""

__all__ = ["VERSION"]

VERSION = "0.1.0"
