"""The accelerator table: complete, consistent, and strict about names."""

import pytest

from hfjax.parallel.targets import TARGETS, get_target


def test_every_target_is_complete_and_plausible():
    assert set(TARGETS) == {"h100", "h200", "a100-40gb", "a100-80gb", "v5e", "v5p", "v6e"}
    for name, t in TARGETS.items():
        assert t.name == name and t.source and t.interconnect
        assert 8e9 <= t.memory_bytes <= 200e9
        assert 100e12 <= t.bf16_flops <= 2000e12
        assert 500e9 <= t.memory_bandwidth <= 10e12
        assert 100e9 <= t.interconnect_bandwidth <= t.memory_bandwidth
        # Peak FLOPs per byte of HBM traffic: what makes decoding memory-bound everywhere.
        assert 100 <= t.bf16_flops / t.memory_bandwidth <= 700


def test_published_figures():
    h100, h200 = get_target("h100"), get_target("h200")
    assert h200.memory_bytes == 141 * 10**9 and h100.memory_bytes == 80 * 10**9
    assert h200.bf16_flops == h100.bf16_flops  # the same Hopper die, more and faster memory
    assert h200.memory_bandwidth > h100.memory_bandwidth
    assert get_target("a100-40gb").memory_bandwidth < get_target("a100-80gb").memory_bandwidth
    assert get_target("v6e").bf16_flops > get_target("v5p").bf16_flops > get_target(
        "v5e").bf16_flops


def test_names_and_aliases():
    assert get_target(" H200 ") is TARGETS["h200"]
    assert get_target("trillium") is TARGETS["v6e"]
    with pytest.raises(ValueError, match=r"unknown target 'a100'; known targets: h100, h200, "
                       r"a100-40gb, a100-80gb, v5e, v5p, v6e"):
        get_target("a100")
