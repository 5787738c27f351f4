"""Reverb's ``SampleToInsertRatio``: keep the items sampled per item inserted near a target.

An off-policy learner that samples faster than actors insert overfits to old experience; one
that samples slower wastes experience. The limiter keeps ``diff = inserted * samples_per_insert
- sampled`` inside ``[min_diff, max_diff]`` (Reverb's definition): a sample waits while it would
take ``diff`` below ``min_diff``, an insert waits while ``diff`` is above ``max_diff``. Both
wait at most ``timeout_seconds`` and then raise :class:`RateLimiterTimeoutError`, never longer.
A sample of ``n`` items is refused outright when ``n`` is wider than the window
``max_diff - min_diff`` (it could then wait for an insert that waits for it).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from replicator.errors import ReplicatorError

__all__ = ["SampleToInsertRatio", "RateLimiterTimeoutError"]

#: Seconds a waiting sample or insert sleeps between looks at a closed limiter.
_POLL_SECONDS = 0.5


class RateLimiterTimeoutError(ReplicatorError, TimeoutError):
    """A sample or an insert waited longer than the limiter's timeout."""


class SampleToInsertRatio:
    """Samples per insert held at ``samples_per_insert`` within ``error_buffer`` items.

    ``min_size_to_sample``: no sample before that many inserts. ``error_buffer`` (default:
    ``max(1, 0.1 * samples_per_insert * min_size_to_sample)``) is how far ``diff`` may drift
    either way. ``samples_per_insert=None`` limits nothing but the minimum size.
    """

    def __init__(self, samples_per_insert: float | None, min_size_to_sample: int = 1,
                 error_buffer: float | None = None, timeout_seconds: float = 60.0) -> None:
        if samples_per_insert is not None and (isinstance(samples_per_insert, bool)
                                               or not samples_per_insert > 0):
            raise ValueError(f"samples_per_insert must be a positive number or None, got "
                             f"{samples_per_insert!r}")
        if isinstance(min_size_to_sample, bool) or not isinstance(min_size_to_sample, int) \
                or min_size_to_sample < 1:
            raise ValueError(f"min_size_to_sample must be an integer >= 1, got "
                             f"{min_size_to_sample!r}")
        if not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be positive, got {timeout_seconds!r}")
        self.samples_per_insert = samples_per_insert
        self.min_size_to_sample = min_size_to_sample
        spi = samples_per_insert or 0.0
        if error_buffer is None:
            error_buffer = max(1.0, 0.1 * spi * min_size_to_sample)
        if not error_buffer > 0:
            raise ValueError(f"error_buffer must be positive, got {error_buffer!r}")
        self.error_buffer = float(error_buffer)
        self.min_diff = spi * min_size_to_sample - self.error_buffer
        self.max_diff = spi * min_size_to_sample + self.error_buffer
        self.timeout_seconds = float(timeout_seconds)
        self.inserted = 0
        self.sampled = 0
        self.closed = False
        self._cond = threading.Condition()

    @property
    def lock(self) -> threading.Condition:
        """The condition that guards the counters (the buffer's storage shares it)."""
        return self._cond

    def diff(self) -> float:
        """``inserted * samples_per_insert - sampled``."""
        return self.inserted * (self.samples_per_insert or 0.0) - self.sampled

    def can_sample(self, n: int) -> bool:
        if self.inserted < self.min_size_to_sample:
            return False
        return self.samples_per_insert is None or self.diff() - n >= self.min_diff

    def can_insert(self) -> bool:
        return self.samples_per_insert is None or self.diff() <= self.max_diff

    def check_sample_size(self, n: int) -> None:
        """Refuse a sample of ``n`` items that no insert could ever let through."""
        if self.samples_per_insert is not None and n > self.max_diff - self.min_diff:
            raise ValueError(
                f"a sample of {n} items is wider than the rate limiter's window of "
                f"{self.max_diff - self.min_diff:g} items (2 * error_buffer): it could wait for "
                f"inserts that wait for it. HINT: pass error_buffer >= {n / 2:g}, or sample "
                "smaller batches.")

    def wait(self, ready: Any, what: str, timeout_seconds: float | None = None,
             ignore: bool = False) -> None:
        """Wait (holding the lock on return) until ``ready()``; ``ignore``: do not wait."""
        if ignore or ready():
            return
        timeout = self.timeout_seconds if timeout_seconds is None else timeout_seconds
        deadline = time.monotonic() + timeout
        while not ready():
            if self.closed:
                raise RateLimiterTimeoutError(f"the replay was closed while {what} waited")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RateLimiterTimeoutError(
                    f"{what} waited {timeout:.0f} s for the rate limiter (inserted "
                    f"{self.inserted}, sampled {self.sampled}, samples_per_insert "
                    f"{self.samples_per_insert}, min_size_to_sample {self.min_size_to_sample})."
                    " HINT: the actors may be too few, too slow or gone; lower "
                    "samples_per_insert or min_size_to_sample, or raise timeout_seconds.")
            self._cond.wait(min(left, _POLL_SECONDS))

    def close(self) -> None:
        """Wake every waiter; they raise instead of waiting on."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def state_dict(self) -> dict[str, Any]:
        return {"inserted": self.inserted, "sampled": self.sampled}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._cond:
            self.inserted = int(state["inserted"])
            self.sampled = int(state["sampled"])
            self._cond.notify_all()
