"""KV page-pool sizing (runtime/kv_sizing.py): the arithmetic the CUDA runner applies to the
free memory it measures."""

from __future__ import annotations

import pytest

from runtime.kv_sizing import KVPoolError, plan_kv_pool

MIB = 1 << 20


def test_pages_are_the_fraction_of_what_is_left_minus_the_padding_page():
    plan = plan_kv_pool(
        page_bytes=2 * MIB,
        free_bytes=1000 * MIB,
        reserve_bytes=200 * MIB,
        fraction=0.5,
        min_pages=10,
    )
    assert plan.num_pages == (800 * MIB // 2) // (2 * MIB) - 1  # 199
    assert plan.pool_bytes == 400 * MIB  # the padding page included
    assert (plan.free_bytes, plan.reserve_bytes, plan.fraction) == (1000 * MIB, 200 * MIB, 0.5)


def test_a_cap_limits_the_pool():
    plan = plan_kv_pool(2 * MIB, 1000 * MIB, 0, 1.0, min_pages=1, max_pages=64)
    assert plan.num_pages == 64


def test_too_little_memory_for_one_sequence_is_refused_with_the_numbers():
    with pytest.raises(KVPoolError, match="only 3 KV pages .* needs 256"):
        plan_kv_pool(2 * MIB, 108 * MIB, 100 * MIB, 1.0, min_pages=256)


def test_reserve_larger_than_free_memory_is_refused():
    with pytest.raises(KVPoolError, match="only 0 KV pages"):
        plan_kv_pool(2 * MIB, 100 * MIB, 200 * MIB, 0.9, min_pages=1)


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_fraction_must_be_a_share(fraction):
    with pytest.raises(KVPoolError, match="fraction"):
        plan_kv_pool(2 * MIB, 1000 * MIB, 0, fraction, min_pages=1)


def test_a_cap_below_one_sequence_is_refused_as_the_cap():
    with pytest.raises(KVPoolError, match="--kv-pages 104 is below the 256 pages"):
        plan_kv_pool(2 * MIB, 100_000 * MIB, 0, 0.9, min_pages=256, max_pages=104)
