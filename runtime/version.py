"""Orbit's release version: one place, read by the CLI, the HTTP API and the packages
Orbit writes (the lowest layer, so that prepare/ and ranks/ need not import orbit/)."""

__version__ = "0.1.0"
