"""Orbit: serve large language models with tensor parallelism across GPUs and hosts."""

from runtime.version import __version__

__all__ = ["__version__"]
