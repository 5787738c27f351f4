"""Mesh axis names: any name is an axis; a likely typo of a known one is refused with a hint."""

from __future__ import annotations

import pytest

from replicator.cluster.topology import KNOWN_AXES, likely_typo, resolve_axes
from replicator.errors import ClusterConfigError


@pytest.mark.parametrize("axes", [
    {"model": 2, "data": 2}, {"expert": 4}, {"dp": 2, "tp": 2}, {"sp": 4},
    {"hsdp": 2, "pipe": 2}, {"data": 2, "context": -1}, {"dp_shard": 2, "dp_replicate": 2},
])
def test_any_axis_name_is_accepted(axes):
    resolved = resolve_axes(axes, 4)
    assert list(resolved) == list(axes) and all(v > 0 for v in resolved.values())


def test_known_axes_keep_their_names():
    assert resolve_axes({name: 1 for name in KNOWN_AXES}, 1) == dict.fromkeys(KNOWN_AXES, 1)
    assert resolve_axes(None, 3) == {"data": 3}


@pytest.mark.parametrize(("name", "meant"), [
    ("tensr", "tensor"), ("tesnor", "tensor"), ("tensors", "tensor"), ("Tensor", "tensor"),
    ("pipelin", "pipeline"), ("piepline", "pipeline"), ("dta", "data"), ("Data", "data"),
    ("dat", "data"), ("fdsp", "fsdp"), ("fsd", "fsdp"), ("FSDP", "fsdp"),
])
def test_a_likely_typo_is_refused_with_the_known_name(name, meant):
    assert likely_typo(name) == meant
    with pytest.raises(ClusterConfigError, match=rf"unknown mesh axis '{name}'\. Did you mean "
                                                 rf"'{meant}'\?.*HINT"):
        resolve_axes({name: 2, "other": 2}, 4)


@pytest.mark.parametrize("name", ["model", "expert", "dp", "tp", "pp", "sp", "cp", "ep",
                                  "hsdp", "ddp", "pipe", "seq", "replicate", "shard"])
def test_names_of_other_axes_are_not_typos(name):
    assert likely_typo(name) is None


@pytest.mark.parametrize("name", ["", 3, None])
def test_an_axis_name_must_be_a_non_empty_string(name):
    with pytest.raises(ClusterConfigError, match="non-empty strings"):
        resolve_axes([(name, 2)], 2)


def test_sizes_are_still_checked_for_new_names():
    with pytest.raises(ClusterConfigError, match="make 6 processes, but the job has 4"):
        resolve_axes({"model": 3, "data": 2}, 4)
    assert resolve_axes({"model": -1, "data": 2}, 8) == {"model": 4, "data": 2}
    with pytest.raises(ClusterConfigError, match="name an axis twice"):
        resolve_axes([("model", 2), ("model", 2)], 4)
