"""Errors of the input pipeline; each says what went wrong, on which rank, and how to fix it."""

from __future__ import annotations

from replicator.errors import ReplicatorError


class EmptyShardError(ReplicatorError, ValueError):
    """A replica's share of the input is empty, so it would have nothing to compute on."""


class InputTimeoutError(ReplicatorError, TimeoutError):
    """The input pipeline did not deliver a batch within ``InputOptions.timeout_seconds``."""


class InputPipelineError(ReplicatorError):
    """Reading, transforming or collating the input failed; the cause is chained."""
