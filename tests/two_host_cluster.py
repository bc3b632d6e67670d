"""Fixtures of the tests that bring a two-host cluster of CPU ranks up over real OpenSSH hosts
(tests/test_cluster_up.py, tests/test_doctor.py): import them with `ssh_hosts` beside them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sshd import TestHost


@pytest.fixture(scope="module")
def hosts(ssh_hosts) -> list[TestHost]:
    return ssh_hosts


@pytest.fixture(scope="module")
def package(tiny_checkpoints, package_cache) -> Path:
    """A tiny TP=2 llama package, small enough capacities that CPU ranks start fast."""
    return package_cache(
        tiny_checkpoints["llama"], 2, max_batch=8, kv_page_size=4, max_step_tokens=32
    )
