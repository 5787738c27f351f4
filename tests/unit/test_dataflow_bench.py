"""``replicator bench`` says when a script is input-bound and which stage of its
``rp.data.Dataset`` limits it: a training step of a fixed cost fed by a pipeline whose map is
made slow on purpose is input-bound, limited by the stage of that map; the same step fed by the
same pipeline without the delay is not."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import replicator as rp
from replicator.plan.benchmark import bench_function, input_notes, input_share, limiting_stage
from replicator.plan.settings import BenchReport, Setting, SettingResult
from tests.data_helpers import SleepingLinear

DELAY_S = 0.02   # the slow map, per element (8 per batch, 2 workers: ~80 ms per batch)
STEP_S = 0.01    # the training step's fixed cost


def slow_decode(x: torch.Tensor) -> torch.Tensor:
    time.sleep(DELAY_S)
    return x


def decode(x: torch.Tensor) -> torch.Tensor:
    return x


def train(strategy: rp.Strategy, fn: Any) -> None:
    ds = (rp.data.Dataset.from_tensor_slices(torch.randn(64, 4))
          .map(fn, num_parallel_calls=2).batch(8)
          .with_options(rp.data.Options(worker_type="thread", cpu_budget=2)))
    dist = strategy.distribute_dataset(ds)
    with strategy.scope():
        model = SleepingLinear(STEP_S)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(x: torch.Tensor) -> None:
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    while True:  # the bench stops it after its steps
        for batch in dist:
            strategy.run(step, args=(batch,))


def train_slow(strategy: rp.Strategy) -> None:
    train(strategy, slow_decode)


def train_fast(strategy: rp.Strategy) -> None:
    train(strategy, decode)


def bench(fn: Any, out: str) -> list[str]:
    report = bench_function(fn, nproc="1", strategies="one_device", steps=6, warmup=2,
                            rounds=1, out_dir=out, report=False, quiet=True)
    assert all(r.ok for r in report.results), [r.error for r in report.results]
    return input_notes(report)


@pytest.mark.timeout(180)
def test_bench_names_an_input_bound_script_and_its_limiting_stage(tmp_path) -> None:
    slow = bench(train_slow, str(tmp_path / "slow"))
    assert slow and all(" is input-bound: " in n for n in slow), slow
    assert all("the limiting stage is `map(slow_decode)+batch(8)` (waited for " in n
               for n in slow), slow
    assert bench(train_fast, str(tmp_path / "fast")) == []


def stage(wait_share: float, parallelism: int = 2) -> dict[str, Any]:
    return {"tasks": 9, "wait_share": wait_share, "parallelism": parallelism,
            "max_parallelism": 4, "task_ms": 3.0, "autotune": True}


def test_the_stage_waited_for_most_limits_and_a_prefetch_never_does() -> None:
    pipeline = {"pipeline": "from_tensor_slices -> shuffle(64) -> map(f)+batch(8) -> prefetch",
                "cpu_budget": 4, "stages": {"map(f)+batch(8)": stage(0.01),
                                            "prefetch": stage(0.9, 1)}}
    # the prefetch waits for the ordered part, read by the consumer: that part limits
    assert limiting_stage([pipeline]).startswith("the ordered part of `from_tensor_slices")
    pipeline["stages"]["map(f)+batch(8)"] = stage(0.6, 4)
    assert limiting_stage([pipeline]).startswith("`map(f)+batch(8)` (waited for 60% of the "
                                                 "time; 4 workers, 3.0 ms per task, at its CPU")
    pipeline["stages"]["map(f)+batch(8)"] = stage(0.6, 2)
    assert "below its CPU budget of 4" in limiting_stage([pipeline])
    assert limiting_stage([]) is None


def measured(input_s: list[float], step_s: float = 0.015) -> SettingResult:
    records = [{"step": step_s + i, "input": i} for i in input_s]
    return SettingResult(Setting("one_device", 1), True, steps=len(records),
                         step_seconds=sum(r["step"] for r in records) / len(records),
                         breakdown={"input": sum(input_s) / len(input_s)},
                         ranks=[{"rank": 0, "records": records}])


def report(result: SettingResult) -> BenchReport:
    return BenchReport(target="train", results=[result], skipped=[], out_dir="",
                       load_average=(0.0, 0.0))


def test_one_preempted_input_wait_does_not_make_a_script_input_bound() -> None:
    # six steps of a fast pipeline, one whose input thread a busy machine held for 50 ms: the
    # mean waits 38% of a step, the median step 6%
    busy = measured([0.001, 0.001, 0.001, 0.05, 0.001, 0.001])
    assert busy.breakdown["input"] / busy.step_seconds > 1 / 3
    assert input_share(busy) < 0.1
    assert input_notes(report(busy)) == []
    # an input-bound script waits at every step
    bound = measured([0.04, 0.03, 0.05, 0.04, 0.04, 0.03])
    assert input_share(bound) > 0.6
    assert input_notes(report(bound))[0].startswith(
        "one_device x1 is input-bound: ")
