"""DiLoCo's settings, fragments and schedule: bad values are refused with a hint, fragments
cover the model in turns, each fragment is exchanged and applied once per round."""

from __future__ import annotations

import pytest
import torch

import replicator as rp
from replicator.strategies.live.settings import LiveSettings
from replicator.strategies.two_level.diloco import _check_live
from replicator.strategies.two_level.fragments import Schedule, split_fragments


@pytest.mark.parametrize("kwargs,match", [
    ({"inner_steps": 0}, "inner_steps must be a positive integer"),
    ({"inner_steps": 2.5}, "inner_steps must be a positive integer"),
    ({"fragments": 0}, "fragments must be a positive integer"),
    ({"inner_steps": 4, "fragments": 5}, "fragments=5 > inner_steps=4"),
    ({"inner_steps": 10, "fragments": 2, "sync_delay": 5}, r"sync_delay must be .* \[0, 5\)"),
    ({"outer_lr": 0}, "outer_lr must be a positive number"),
    ({"outer_momentum": 1.0}, r"outer_momentum must be in \[0, 1\)"),
    ({"compression": "fp8"}, "compression must be None, 'int8' or 'int4'"),
])
def test_bad_settings_are_refused_with_a_hint(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        rp.DiLoCoStrategy(**kwargs)
    assert "HINT" in str(info.value) or "compression" in kwargs


def test_more_fragments_than_parameter_tensors_is_refused():
    params = [torch.zeros(3), torch.zeros(4)]
    with pytest.raises(ValueError, match="only 2 parameter tensor.*HINT"):
        split_fragments(params, 3)


def test_fragments_are_contiguous_balanced_and_non_empty():
    params = [torch.zeros(n) for n in (100, 1, 100, 1, 1000, 5)]
    assert split_fragments(params, 1) == [[0, 1, 2, 3, 4, 5]]
    assert split_fragments(params, 2) == [[0, 1, 2, 3], [4, 5]]
    for f in range(1, 7):
        groups = split_fragments(params, f)
        assert [i for g in groups for i in g] == list(range(6)) and all(groups)


@pytest.mark.parametrize("h,f,d", [(1, 1, 0), (10, 1, 3), (10, 2, 2), (12, 3, 0), (7, 3, 1)])
def test_each_fragment_is_exchanged_and_applied_once_per_round(h, f, d):
    schedule = Schedule(h, f, d)
    started = {k: [] for k in range(f)}
    applied = {k: [] for k in range(f)}
    for t in range(1, 5 * h + 1):
        for k in schedule.starting(t):
            started[k].append(t)
        for k in schedule.applied(t):
            applied[k].append(t)
    for k in range(f):
        gaps = {b - a for a, b in zip(applied[k], applied[k][1:])}
        assert gaps == {h}
        assert applied[k] == [t + d for t in started[k]][:len(applied[k])]
    last = [applied[k][0] for k in range(f)]
    assert last == sorted(last)  # in turns


@pytest.mark.parametrize("kwargs", [{"hosts": 2},
                                    {"compression": "int8", "fragments": 2, "sync_delay": 1}])
def test_settings_replica_groups_lack_are_refused_before_any_group_starts(monkeypatch, kwargs):
    monkeypatch.setenv("REPLICATOR_REPLICA_GROUPS", "2")
    monkeypatch.setenv("REPLICATOR_REPLICA_GROUP", "1")
    monkeypatch.setenv("REPLICATOR_LIGHTHOUSE", "http://localhost:29510")
    name = next(iter(kwargs))
    with pytest.raises(rp.errors.ClusterConfigError,
                       match=f"{name}=.*not supported in replica groups.*HINT"):
        rp.DiLoCoStrategy(inner_steps=4, **kwargs)


LIVE_ENV = {"REPLICATOR_REPLICA_GROUPS": "2", "REPLICATOR_REPLICA_GROUP": "1",
            "REPLICATOR_LIGHTHOUSE": "http://localhost:29510"}


def test_replica_groups_take_fragments_that_divide_inner_steps_and_refuse_others():
    live = LiveSettings.from_env(LIVE_ENV)
    assert live is not None
    with pytest.raises(rp.errors.ClusterConfigError) as info:
        _check_live(live, inner_steps=6, fragments=4, hosts=None, mesh=None)
    text = str(info.value)
    assert "fragments=4 does not divide inner_steps=6" in text and live.who in text
    assert "HINT: use inner_steps=4 or fragments=3" in text, text
    _check_live(live, inner_steps=6, fragments=3, hosts=None, mesh=None)
    _check_live(live, inner_steps=6, fragments=1, hosts=None, mesh=None)


def test_under_replica_groups_a_sync_delay_keeps_each_exchange_inside_its_round():
    """A round of inner_steps / fragments steps ends with its fragment's update; that
    fragment's exchange starts sync_delay steps before, inside the same round (a round is what
    a group commits or trains again, so nothing may stay in flight past its end)."""
    for h, f in ((4, 1), (4, 2), (6, 3), (12, 4)):
        length = h // f
        for d in range(length):  # every delay _check_settings takes
            schedule = Schedule(h, f, d)
            for t in range(1, 4 * h + 1):
                for fragment in schedule.starting(t):
                    end = next(u for u in range(t, t + h + 1) if fragment in schedule.applied(u))
                    assert end - t == d and (t - 1) // length == (end - 1) // length, (h, f, d, t)
