"""The top level holds what a training script writes; moved names still resolve, with a warning."""

from __future__ import annotations

import importlib
import types
import warnings

import pytest

import replicator as rp


def test_all_is_short_and_every_name_resolves():
    assert len(rp.__all__) <= 40
    assert len(set(rp.__all__)) == len(rp.__all__), "a name is listed twice"
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for name in rp.__all__:
            assert getattr(rp, name) is not None, name


def test_star_import_gives_exactly_all():
    namespace: dict[str, object] = {}
    exec("from replicator import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(rp.__all__)


@pytest.mark.parametrize("name", sorted(rp._MOVED))
def test_a_moved_name_still_resolves_with_a_warning_naming_its_place(name):
    where = rp._MOVED[name]
    new = getattr(importlib.import_module(where), name)
    short = where.removeprefix("replicator.")
    with pytest.warns(DeprecationWarning, match=rf"rp\.{name} moved to rp\.{short}\.{name}"):
        old = getattr(rp, name)
    assert old is new
    assert name not in rp.__all__


def test_from_import_of_a_moved_name_warns():
    with pytest.warns(DeprecationWarning, match=r"rp\.RingAllReduce moved to rp\.comm\."):
        from replicator import RingAllReduce
    assert RingAllReduce is rp.comm.RingAllReduce


def test_every_error_class_is_in_errors():
    errors = [getattr(rp.errors, n) for n in rp.errors.__all__]
    assert all(isinstance(e, type) and issubclass(e, rp.ReplicatorError) for e in errors)
    for name, where in rp._MOVED.items():
        if name.endswith("Error"):
            assert where == "replicator.errors" and name in rp.errors.__all__, name


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'MirroredStrategi'") as info:
        rp.MirroredStrategi  # noqa: B018
    assert info.value.name == "MirroredStrategi" and info.value.obj is rp  # for "Did you mean"
    assert not hasattr(rp, "RingAllReduc")


def test_dir_lists_the_public_names_and_the_rooms_only():
    listed = dir(rp)
    assert listed == sorted(listed)
    assert set(rp.__all__) <= set(listed)
    assert "__version__" in listed
    assert not set(rp._MOVED) & set(listed), "a moved name is listed by dir()"
    extra = set(listed) - set(rp.__all__) - {"__version__"}
    assert extra <= set(rp._ROOMS)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for name in listed:
            value = getattr(rp, name)
            if name in extra:
                assert isinstance(value, types.ModuleType), name
    # the rooms named by a deprecation message are reachable from the top level
    for where in set(rp._MOVED.values()):
        assert getattr(rp, where.removeprefix("replicator.")) is importlib.import_module(where)
