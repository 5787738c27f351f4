"""AUTOTUNE: each parallel stage chooses its parallelism and its depth (results kept in flight
beyond the running ones) while it runs, within the CPU and RAM budgets.

The signal is the stage's consumer: the share of the wall time it spent blocked waiting for a
worker's result. Downstream buffers are bounded, so a consumer asks only while the training
step is waiting for input (directly or through a prefetch queue that is not full): a stage that
makes its consumer wait and whose workers are busy gets one more worker (a probe); the probe is
kept when the stage's output rate rose by 5 % or more, else undone and that level is not tried
again for a while. A stage whose consumer never waits and whose workers are mostly idle (the
step got slower, or the data cheaper) gives a worker back to training. The depth grows when the
consumer waits with every allowed worker busy (bursty work), up to the RAM budget
(``ram_budget / average result size``).

The CPU budget, when not given, follows training (:class:`TrainingMeter`): a step that computes
on the host's cores leaves fewer to the input, a step that waits for an accelerator (or a
cheap one) leaves nearly all of them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

WINDOW_S = 0.25          # shortest window between two decisions
WAIT_GROW = 0.05         # consumer blocked more than this share: input-bound
WAIT_IDLE = 0.01         # consumer blocked less than this share: step-bound
GAIN = 1.05              # a probe must raise the output rate by this factor
COOLDOWN = 8             # windows before a failed level is probed again


class TrainingMeter:
    """How many cores training takes, measured: this process's CPU time less what the
    pipeline's own in-process workers spent, per second of wall time (the training step's
    threads, torch's intra-op threads included). The CPU budget left to the input is the
    host's cores less that, for each training process of the host; before a measurement it is
    the conservative ``cores - torch threads``."""

    def __init__(self, cores: int, local_processes: int, start_budget: int) -> None:
        self.cores, self.local = cores, local_processes
        self.budget = start_budget
        self.training: float | None = None
        self._own = 0.0
        self._last = (time.perf_counter(), time.process_time(), 0.0)

    def own(self, cpu_s: float) -> None:
        """CPU seconds a worker thread of the pipeline spent (not training's)."""
        self._own += cpu_s

    def sample(self) -> int:
        wall, cpu, own = time.perf_counter(), time.process_time(), self._own
        w0, c0, o0 = self._last
        if wall - w0 >= 2 * WINDOW_S:
            used = max(0.0, (cpu - c0) - (own - o0)) / (wall - w0)
            self.training = used if self.training is None else 0.7 * self.training + 0.3 * used
            self._last = (wall, cpu, own)
            left = (self.cores - self.local * self.training) / self.local
            self.budget = max(1, min(self.cores, math.floor(left + 0.25)))
        return self.budget


@dataclass
class Tuner:
    """Parallelism and depth of one stage; fixed when the user gave a number."""

    name: str
    max_parallelism: int
    ram_bytes: int
    fixed: int | None = None
    meter: TrainingMeter | None = None   # None: the budget was given
    parallelism: int = 1
    depth: int = 2
    # running totals (stats)
    tasks: int = 0
    busy_s: float = 0.0
    wait_s: float = 0.0
    wall_s: float = 0.0
    bytes_total: int = 0
    decisions: list[str] = field(default_factory=list)
    # the current window
    _start: float = field(default_factory=time.perf_counter)
    _w_tasks: int = 0
    _w_busy: float = 0.0
    _w_wait: float = 0.0
    _probe_from: tuple[int, float] | None = None
    _ceiling: int | None = None
    _cooldown: int = 0

    def __post_init__(self) -> None:
        if self.fixed is not None:
            self.parallelism = self.fixed
            self.max_parallelism = max(self.max_parallelism, self.fixed)
        elif self.meter is not None:  # the budget follows training: start at 2 if there are
            self.max_parallelism = max(self.max_parallelism, min(2, self.meter.cores))
            self.parallelism = min(2, self.max_parallelism)
        else:
            self.parallelism = min(2, self.max_parallelism)
        self.depth = max(2, self.parallelism)

    @property
    def autotune(self) -> bool:
        return self.fixed is None

    def in_flight_limit(self) -> int:
        """Tasks submitted and not yet handed on: running ones plus the depth, within RAM."""
        limit = self.parallelism + self.depth
        if self.tasks and self.bytes_total:
            per = max(1, self.bytes_total // self.tasks)
            limit = min(limit, max(1, self.ram_bytes // per))
        return max(1, limit)

    def record(self, task_s: float, nbytes: int, cpu_s: float = 0.0) -> None:
        """A worker finished a task in ``task_s`` seconds (``cpu_s`` of this process's CPU
        time, for thread workers); its result holds ``nbytes``."""
        if self.meter is not None and cpu_s:
            self.meter.own(cpu_s)
        self.tasks += 1
        self.busy_s += task_s
        self.bytes_total += nbytes
        self._w_tasks += 1
        self._w_busy += task_s

    def waited(self, seconds: float) -> None:
        """The consumer was blocked ``seconds`` waiting for a worker's result."""
        self.wait_s += seconds
        self._w_wait += seconds

    def tick(self) -> None:
        """Close the window when it is long enough, and decide."""
        now = time.perf_counter()
        elapsed = now - self._start
        if elapsed < WINDOW_S or self._w_tasks < 2 * self.parallelism:
            return
        self.wall_s += elapsed
        rate = self._w_tasks / elapsed
        wait_share = self._w_wait / elapsed
        utilisation = self._w_busy / (elapsed * self.parallelism)
        if self.autotune and self.meter is not None:
            self.max_parallelism = self.meter.sample()
            if self.parallelism > self.max_parallelism:
                self._set(self.max_parallelism, "training takes more cores now")
        if self.autotune:
            self._decide(rate, wait_share, utilisation)
        self._start, self._w_tasks, self._w_busy, self._w_wait = now, 0, 0.0, 0.0

    def _decide(self, rate: float, wait_share: float, utilisation: float) -> None:
        if self._cooldown:
            self._cooldown -= 1
            if not self._cooldown:
                self._ceiling = None
        if self._probe_from is not None:
            level, before = self._probe_from
            self._probe_from = None
            if rate < before * GAIN:
                self._set(level, f"probe of {self.parallelism} gave {rate:.1f}/s "
                                 f"(had {before:.1f}/s): back to {level}")
                self._ceiling, self._cooldown = level, COOLDOWN
            return
        room = self._ceiling if self._ceiling is not None else self.max_parallelism
        if wait_share > WAIT_GROW and utilisation > 0.6:
            if self.parallelism < min(room, self.max_parallelism):
                self._probe_from = (self.parallelism, rate)
                self._set(self.parallelism + 1, f"consumer waited {wait_share:.0%}: probe")
            elif self.depth < 4 * self.max_parallelism:
                self.depth += 1
                self.decisions.append(f"depth {self.depth}")
        elif wait_share < WAIT_IDLE and utilisation < 0.4 and self.parallelism > 1:
            self._set(self.parallelism - 1, f"workers {utilisation:.0%} busy: give one back")

    def _set(self, level: int, why: str) -> None:
        self.parallelism = level
        self.depth = max(self.depth, level)
        self.decisions.append(f"parallelism {level}: {why}")
        del self.decisions[:-20]

    def stats(self) -> dict[str, Any]:
        wall = self.wall_s + (time.perf_counter() - self._start)
        return {
            "autotune": self.autotune, "parallelism": self.parallelism,
            "max_parallelism": self.max_parallelism, "depth": self.depth,
            "in_flight_limit": self.in_flight_limit(), "tasks": self.tasks,
            "task_ms": 1000 * self.busy_s / self.tasks if self.tasks else None,
            "result_bytes": self.bytes_total // self.tasks if self.tasks else None,
            "wait_share": self.wait_s / wall if wall > 0 else 0.0,
            "training_cores": None if self.meter is None or self.meter.training is None
            else round(self.meter.training, 2),
            "decisions": list(self.decisions[-5:]),
        }
