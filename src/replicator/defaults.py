"""Defaults every room shares, in the bottom layer so that any room may import them."""

#: How long anything waits when neither the caller nor the launcher (``--timeout``) said.
DEFAULT_TIMEOUT_SECONDS = 300.0
