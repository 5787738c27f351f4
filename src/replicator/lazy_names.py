"""Names of a package imported on first use: ``import replicator`` (and ``replicator.cluster``)
stays free of torch until a name that needs it is touched, so the command line and the launcher
start in a fraction of a second."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``homes[name]`` on first use and
    keeps the module (``package.name``) or its attribute ``name`` on the package."""

    def __getattr__(name: str) -> Any:
        if (home := homes.get(name)) is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}", name=name,
                                 obj=sys.modules[package])
        module = importlib.import_module(home)
        value = module if home == f"{package}.{name}" else getattr(module, name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
