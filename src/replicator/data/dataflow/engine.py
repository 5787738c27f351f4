"""Parallel stages: a pool of workers applying one function to a stream of tasks, results in
order (``deterministic=True``) or as they finish, parallelism set by a :class:`Tuner`.

Process workers take tasks from one queue and put results on another: both are
``torch.multiprocessing`` queues, whose pickler moves every tensor's storage to shared memory
and sends its file descriptor, so a batch of tensors crosses as a handle, never as a pickle of
its bytes (as DataLoader's workers hand batches back). A batch task (load, map, collate) is one
task, so one batch is one hand-over. Workers start lazily, up to the tuner's parallelism; a
worker beyond the current parallelism parks (no task), so the tuner can lower and raise it
without starting processes again. Thread workers follow the same protocol in-process.

Why our own engine and not ``torchdata.nodes`` (0.11): its ``ParallelMapper`` takes a fixed
``num_workers`` (nothing tunes it while running), maps one element per task and collates in the
consumer, and it would be a new dependency. In ``benchmarks/ingestion.py`` (ImageNet-style
decode, batches of 64, the same 2 workers) ours gave 2.38x its images/s (2.33-2.39, three runs
on a quiet 2-core machine); docs/dataflow.md has the table.
Threads against processes, measured on the same machine (JPEG decode + crop + resize with PIL,
which releases the GIL in decode and resize): 291 images/s on one thread, 313 on two (1.08x);
processes are the default, threads (``Options(worker_type="thread")``) suit functions that are
mostly torch ops or I/O, and need no pickling.
"""

from __future__ import annotations

import multiprocessing.queues
import queue
import random
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from replicator.data.batching import derived_seed
from replicator.data.dataflow.autotune import Tuner
from replicator.data.dataflow.buffers import Leases
from replicator.data.dataflow.work import handed_over, mark_process_worker, take_back_buffers
from replicator.data.errors import InputPipelineError, InputTimeoutError

POLL_S = 0.5


def result_bytes(obj: Any) -> int:
    """Bytes of the tensors (and bytes objects) in a result, for the RAM budget."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (bytes, bytearray)):
        return len(obj)
    if isinstance(obj, dict):
        return sum(result_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(result_bytes(v) for v in obj[:256])
    return 0


class _Failure:
    """A worker's exception, carried back with its traceback text."""

    def __init__(self, exc: BaseException) -> None:
        self.text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.summary = f"{type(exc).__name__}: {exc}"
        try:
            import pickle

            pickle.dumps(exc)
            self.exc: BaseException | None = exc
        except Exception:  # noqa: BLE001 - an exception that cannot travel is described
            self.exc = None


class _ResultQueue(multiprocessing.queues.Queue):
    """The workers' results. A result this queue cannot pickle (a tensor that requires grad and
    has a graph, a lambda) comes back as its task's failure, instead of never arriving."""

    def _on_queue_feeder_error(self, e: BaseException, obj: Any) -> None:
        if isinstance(obj, tuple) and len(obj) == 9:  # as _process_worker puts them
            pass_id, seq, _ok, _out, task_s, _nbytes, cpu_s, index, _lent = obj
            self.put((pass_id, seq, False, _Failure(e), task_s, 0, cpu_s, index, []))
        else:  # pragma: no cover - nothing else is put on it; as multiprocessing does
            traceback.print_exception(type(e), e, e.__traceback__)


def _run(fn: Callable[[Any], Any], payload: Any,
         in_process: bool = False) -> tuple[bool, Any, float, int, float]:
    """``(ok, result, seconds, result bytes, CPU seconds of this process if a thread)``."""
    start, cpu = time.perf_counter(), time.thread_time() if in_process else 0.0
    try:
        out = fn(payload)
        ok, nbytes = True, result_bytes(out)
    except Exception as exc:  # noqa: BLE001 - reported in the consumer
        out, ok, nbytes = _Failure(exc), False, 0
    used = time.thread_time() - cpu if in_process else 0.0
    return ok, out, time.perf_counter() - start, nbytes, used


def seed_task(base_seed: int, pass_id: int, seq: int) -> None:
    """Seed this worker process's random generators (torch, ``random``, NumPy's global) for one
    task: forked workers would otherwise share their parent's state and draw the same random
    augmentations; a seed per task, not per worker, keeps the draws independent of how many
    workers run and which one takes the task."""
    seed = derived_seed(base_seed, pass_id, seq)
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is optional
        return
    np.random.seed(seed & 0xFFFF_FFFF)


def _process_worker(fn: Callable[[Any], Any], tasks: Any, results: Any, index: int,
                    active: Any, current: Any, base_seed: int, releases: Any) -> None:
    import multiprocessing as mp

    torch.set_num_threads(1)
    mark_process_worker(releases)
    parent = mp.parent_process()  # the process that started this one, whatever the method
    while True:
        if index >= active.value:
            time.sleep(0.02)
            take_back_buffers()
            if parent is not None and not parent.is_alive():
                return
            continue
        try:
            task = tasks.get(timeout=POLL_S)
        except queue.Empty:
            take_back_buffers()
            if parent is not None and not parent.is_alive():
                return
            continue
        if task is None:
            return
        pass_id, seq, payload = task
        if pass_id != current.value:
            continue  # a task of a pass the consumer left
        seed_task(base_seed, pass_id, seq)
        outcome = _run(fn, payload)
        results.put((pass_id, seq, *outcome, index, handed_over(outcome[0])))


def _thread_worker(fn: Callable[[Any], Any], tasks: Any, results: Any, index: int,
                   active: Any, current: Any) -> None:
    while True:
        if index >= active.value:
            time.sleep(0.02)
            continue
        try:
            task = tasks.get(timeout=POLL_S)
        except queue.Empty:
            continue
        if task is None:
            return
        pass_id, seq, payload = task
        if pass_id == current.value:
            results.put((pass_id, seq, *_run(fn, payload, in_process=True), index, []))


class Pool:
    """Workers for one stage; persistent across passes (epochs) until :meth:`close`."""

    def __init__(self, fn: Callable[[Any], Any], tuner: Tuner, *, mode: str,
                 start_method: str | None, name: str, timeout_s: float) -> None:
        self.fn, self.tuner, self.mode, self.name = fn, tuner, mode, name
        self.timeout_s = timeout_s
        self._pass = 0
        self._workers: list[Any] = []
        self._leases = Leases()  # process workers' shared-memory buffers held here
        self._closed = False
        if mode == "process":
            import torch.multiprocessing as tmp

            # fork where the platform has it: workers inherit the functions (lambdas too) and
            # start in milliseconds; a process started by spawn/forkserver still forks its own
            method = start_method or ("fork" if "fork" in tmp.get_all_start_methods() else None)
            self._ctx: Any = tmp.get_context(method)
            self._tasks: Any = self._ctx.Queue()
            self._results: Any = _ResultQueue(ctx=self._ctx)
            self._active: Any = self._ctx.Value("i", 0)
            self._current: Any = self._ctx.Value("i", 0)
            # drawn from the consumer's torch generator, as DataLoader's base seed is: a
            # torch.manual_seed before the pipeline makes the workers' draws reproducible
            self._base_seed = int(torch.empty((), dtype=torch.int64).random_().item())
        else:
            self._tasks = queue.Queue()
            self._results = queue.Queue()
            self._active = _Box(0)
            self._current = _Box(0)
        weakref.finalize(self, _shutdown, self._workers, self._tasks, self._active, mode)

    # -- workers -----------------------------------------------------------------------------
    def _ensure_workers(self) -> None:
        want = self.tuner.parallelism
        self._active.value = want
        while len(self._workers) < want:
            i = len(self._workers)
            releases = None
            if self.mode == "process":
                releases, own_end = self._ctx.Pipe(duplex=False)
                self._leases.releases.append(own_end)
                worker = self._ctx.Process(
                    target=_process_worker, name=f"{self.name}-{i}", daemon=True,
                    args=(self.fn, self._tasks, self._results, i, self._active, self._current,
                          self._base_seed, releases))
            else:
                worker = threading.Thread(
                    target=_thread_worker, daemon=True, name=f"{self.name}-{i}",
                    args=(self.fn, self._tasks, self._results, i, self._active,
                          self._current))
            worker.start()
            if releases is not None:
                releases.close()  # the worker's end
            self._workers.append(worker)

    def _check_alive(self) -> None:
        for i, w in enumerate(self._workers):
            if self.mode == "process" and not w.is_alive():
                code = w.exitcode
                why = f"killed by signal {-code}" if code is not None and code < 0 else \
                    f"exit code {code}"
                raise InputPipelineError(
                    f"worker {i} of {self.name} (pid {w.pid}) stopped ({why}). HINT: a "
                    "signal 9 is often the out-of-memory killer: lower Options(ram_budget=) "
                    "or the batch size; or use Options(worker_type='thread').")

    # -- a pass --------------------------------------------------------------------------------
    def imap(self, tasks: Iterator[Any], deterministic: bool = True,
             describe: Callable[[Any], str] = lambda t: "") -> Iterator[Any]:
        """Results of ``fn`` over ``tasks``; a new pass discards the results of a left one.
        When the pass ends or is left, the workers forget the buffers of the batches still held
        here, so idle workers keep no more than a few buffers of shared memory."""
        try:
            yield from self._pass_results(tasks, deterministic, describe)
        finally:
            self._leases.forget()

    def _pass_results(self, tasks: Iterator[Any], deterministic: bool,
                      describe: Callable[[Any], str]) -> Iterator[Any]:
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        self._pass += 1
        pass_id = self._pass
        self._current.value = pass_id
        sent: dict[int, Any] = {}
        done: dict[int, tuple[bool, Any]] = {}
        submitted = handed = 0
        exhausted = False
        tuner = self.tuner
        while True:
            self._ensure_workers()
            self._leases.release()
            while not exhausted and submitted - handed < tuner.in_flight_limit():
                try:
                    task = next(tasks)
                except StopIteration:
                    exhausted = True
                    break
                sent[submitted] = task
                self._tasks.put((pass_id, submitted, task))
                submitted += 1
            if exhausted and handed == submitted:
                return
            key = handed if deterministic else None
            if (key is None and not done) or (key is not None and key not in done):
                waited = time.perf_counter()
                self._receive(pass_id, done, key)
                tuner.waited(time.perf_counter() - waited)
            seq = handed if deterministic else next(iter(done))
            ok, out = done.pop(seq)
            task = sent.pop(seq)
            handed += 1
            if not ok:
                raise _as_error(out, self.name, describe(task))
            tuner.tick()
            yield out

    def _receive(self, pass_id: int, done: dict[int, tuple[bool, Any]], key: int | None) -> None:
        deadline = time.monotonic() + self.timeout_s
        while (key is None and not done) or (key is not None and key not in done):
            try:
                got_pass, seq, ok, out, task_s, nbytes, cpu_s, worker, lent = \
                    self._results.get(timeout=POLL_S)
            except queue.Empty:
                self._check_alive()
                if time.monotonic() > deadline:
                    raise InputTimeoutError(
                        f"{self.name} gave no result in {self.timeout_s:.0f} s. HINT: a "
                        "function that blocks (a store that stopped answering?); raise "
                        "Options(timeout_seconds=) if a task is this slow.") from None
                continue
            if lent:
                self._leases.track(worker, lent, out)
            if got_pass != pass_id:
                continue
            self.tuner.record(task_s, nbytes, cpu_s)
            done[seq] = (ok, out)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _shutdown(self._workers, self._tasks, self._active, self.mode)
            self._leases.close()


class _Box:
    """An int cell with ``.value``, as ``multiprocessing.Value`` has, for thread workers."""

    def __init__(self, value: int) -> None:
        self.value = value


def _as_error(failure: _Failure, stage: str, what: str) -> Exception:
    where = f" on {what}" if what else ""
    err = InputPipelineError(f"{stage} failed{where}: {failure.summary}\n"
                             f"--- worker traceback ---\n{failure.text.rstrip()}")
    if failure.exc is not None:
        err.__cause__ = failure.exc
    return err


def _shutdown(workers: list[Any], tasks: Any, active: Any, mode: str) -> None:
    active.value = 1 << 30  # parked workers wake to read their stop signal
    for _ in workers:
        try:
            tasks.put(None)
        except Exception:  # noqa: BLE001 - a queue closed at interpreter exit
            pass
    deadline = time.monotonic() + 5.0
    for w in workers:
        w.join(max(0.0, deadline - time.monotonic()))
        if mode == "process" and w.is_alive():
            w.terminate()
            w.join(1.0)
    workers.clear()
