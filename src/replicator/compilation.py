"""How replicator meets ``torch.compile``: what is compiled and what stays eager.

A model (``torch.compile(model)``) or a loss function is compiled as usual: its forward and,
through AOTAutograd, its backward become graphs, and the strategy's gradient hooks run
between them, when autograd hands each gradient over (they are not part of any graph, so they
cannot cause a recompile). A whole ``step_fn`` may be compiled too; dynamo then breaks the
graph at ``loss.backward()`` and at the strategy's collectives, and every frame the library
runs from autograd's hooks would be traced as well. :func:`keep_library_eager` tells dynamo to
leave replicator's communication code alone, so those frames run eagerly and are never
compiled or recompiled; ``Strategy.run`` calls it once ``torch.compile`` is in use.
"""

from __future__ import annotations

import sys

#: The packages whose code always runs eagerly under ``torch.compile``: collectives, gradient
#: averaging and their progress tracking (they talk to other processes and keep counters).
EAGER_PACKAGES = ("replicator.comm",)

_done = False


def keep_library_eager() -> bool:
    """Add :data:`EAGER_PACKAGES` to dynamo's skip rules, once; ``False`` if this torch has no
    such rules (compiling still works, frames of the library are then traced)."""
    global _done
    if _done:
        return True
    try:
        from torch._dynamo import trace_rules

        for name in EAGER_PACKAGES:
            trace_rules.add(name)
    except (ImportError, AttributeError):  # pragma: no cover - a torch without these rules
        return False
    _done = True
    return True


def compile_in_use() -> bool:
    """True once ``torch.compile`` has been used in this process (dynamo is imported)."""
    return "torch._dynamo" in sys.modules
