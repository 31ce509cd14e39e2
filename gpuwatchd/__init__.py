"""gpuwatchd: a node-level GPU health daemon."""

__version__ = "0.1.0"
__all__ = ["__version__"]
