"""Helpers for testing distributed code with real processes (used by replicator's own tests)."""

from replicator.testing.distributed import run_distributed
from replicator.testing.equivalence import assert_equivalent, assert_params_close

__all__ = ["run_distributed", "assert_equivalent", "assert_params_close"]
