"""Device table and link parsing: what is accepted, and clear errors for the rest."""

import pytest

from replicator.plan.devices import DEVICES, get_device, parse_duration, parse_link


@pytest.mark.parametrize("text, bytes_per_s", [
    ("25gbit", 3.125e9), ("100gbit", 12.5e9), ("200mbit", 25e6), ("400gbps", 50e9),
    ("10GB/s", 1e10), ("500MB/s", 5e8), ("100Gb/s", 12.5e9), (" 1.5 gbit ", 1.875e8),
])
def test_links(text, bytes_per_s):
    assert parse_link(text).bandwidth == pytest.approx(bytes_per_s)


@pytest.mark.parametrize("text, match", [
    ("-5gbit", "negative"), ("0gbit", "positive"), ("fast", "cannot read"),
    ("10gb", "ambiguous"), ("10 furlongs", "unknown unit"),
])
def test_bad_links_say_what_is_accepted(text, match):
    with pytest.raises(ValueError, match=match) as info:
        parse_link(text)
    assert "25gbit" in str(info.value)


def test_unknown_device_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown device 'tpu9'") as info:
        get_device("tpu9")
    for name in DEVICES:
        assert name in str(info.value)
    assert get_device(" H100 ").name == "h100"


def test_durations():
    assert parse_duration("25us") == pytest.approx(25e-6)
    assert parse_duration("0.1ms") == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="duration"):
        parse_duration("-1us")
