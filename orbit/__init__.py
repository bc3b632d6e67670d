"""Orbit: serve large language models with tensor parallelism across GPUs and hosts."""

__version__ = "0.1.0"
