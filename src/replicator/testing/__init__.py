"""Helpers for testing distributed code with real processes (used by replicator's own tests)."""

from replicator.testing.equivalence import assert_equivalent, assert_params_close, run_distributed
from replicator.testing.fault_injection import (
    Fault,
    corrupt_latest_checkpoint,
    delay_rank,
    fail_rank,
    kill_during_save,
    kill_rank,
    latest_checkpoint,
    terminate_rank,
)

__all__ = ["run_distributed", "assert_equivalent", "assert_params_close", "Fault", "kill_rank",
           "terminate_rank", "fail_rank", "delay_rank", "kill_during_save",
           "corrupt_latest_checkpoint", "latest_checkpoint"]
