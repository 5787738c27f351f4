"""How replicator meets ``torch.compile``: a compiled model, loss or ``step_fn`` works as usual,
but dynamo would trace the library's frames run from autograd's hooks, so
:func:`keep_library_eager` (called by ``Strategy.run`` once compile is in use) keeps
replicator's communication code eager."""

from __future__ import annotations

import functools
import sys

#: Always eager under ``torch.compile``: collectives, gradient averaging and their counters.
EAGER_PACKAGES = ("replicator.comm",)


@functools.cache
def keep_library_eager() -> bool:
    """Add :data:`EAGER_PACKAGES` to dynamo's skip rules, once; ``False`` if this torch has no
    such rules (compiling still works, frames of the library are then traced)."""
    try:
        from torch._dynamo import trace_rules

        for name in EAGER_PACKAGES:
            trace_rules.add(name)
    except (ImportError, AttributeError):  # pragma: no cover - a torch without these rules
        return False
    return True


def compile_in_use() -> bool:
    """True once ``torch.compile`` has been used in this process (dynamo is imported)."""
    return "torch._dynamo" in sys.modules
