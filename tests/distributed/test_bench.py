"""``replicator bench`` end to end on a tiny model: report, plots, and a breakdown that adds up."""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from replicator.cli import main
from replicator.plan.benchmark import bench_function, bench_script

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _png_size(path):
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


@pytest.mark.timeout(360)  # three settings: three launches
def test_bench_writes_the_report_and_both_plots(tmp_path):
    # one round: the rounds' interleaving and combination are tested without processes in
    # tests/unit/test_plan_bench_rounds.py, and end to end with real runs by
    # test_plan_validate_interleaves_repeated_passes below (two passes, their median)
    report = bench_script(str(SCRIPTS / "bench_tiny.py"), nproc="1,2",
                          strategies="one_device,mirrored", steps=10, warmup=2,
                          out_dir=str(tmp_path), quiet=True, rounds=1)
    labels = ["one_device x1", "mirrored x2"]
    if (os.cpu_count() or 1) > 1:  # one process also on one thread: the faster is the baseline
        labels.insert(1, "one_device x1 (1 thread)")
    assert [r.setting.label for r in report.results] == labels
    for r in report.results:
        assert r.ok, r.error
        assert len(r.rounds) == 1
        assert r.steps >= 9 and r.samples_per_second > 0
        # the parts (compute, communication, input, optimizer, checkpoint) sum to the step
        assert sum(r.breakdown.values()) == pytest.approx(r.step_seconds, rel=0.10)
        assert r.breakdown["compute"] > 0 and r.breakdown["optimizer"] > 0
        assert len(r.peak_rss) == r.setting.processes and min(r.peak_rss) > 50e6
        assert r.batch == 64 / r.setting.workers
    text = (tmp_path / "report.md").read_text()
    assert "| one_device x1 |" in text and "| mirrored x2 |" in text and "load average" in text
    for name in ("throughput.png", "breakdown.png"):
        width, height = _png_size(tmp_path / name)
        assert width >= 500 and height >= 400 and (tmp_path / name).stat().st_size > 10_000
    data = json.loads((tmp_path / "results.json").read_text())
    assert [r["setting"] for r in data["results"]] == labels
    assert set(data["ceiling"]) == {"1", "2"}  # the no-communication ceiling line


def test_a_script_that_ends_before_the_steps_asked_for_is_said_so(tmp_path):
    # one epoch of 1024 samples at batch 64: 16 steps, fewer than warmup + 30
    report = bench_script(str(SCRIPTS / "bench_tiny.py"), ["--epochs", "1"], nproc="1",
                          strategies="one_device", steps=30, warmup=2,
                          out_dir=str(tmp_path), quiet=True, rounds=1)
    result = report.results[0]
    assert result.ok, result.error
    assert 0 < result.steps < 30 and result.steps_asked == 30
    text = (tmp_path / "report.md").read_text()
    assert f"ended before the steps asked for (one_device x1 {result.steps} of 30" in text


def test_a_script_that_ignores_the_strategy_is_named(tmp_path):
    # train_mirrored.py builds the strategy from --strategy, not from REPLICATOR_STRATEGY
    args = [str(tmp_path / "out.safetensors"), "--strategy", "mirrored", "--steps", "40"]
    report = bench_script(str(SCRIPTS / "train_mirrored.py"), args, nproc="1",
                          strategies="one_device", steps=4, warmup=1,
                          out_dir=str(tmp_path), quiet=True, report=False, rounds=1)
    result = report.results[0]
    assert not result.ok
    assert "ran mirrored instead of one_device" in result.error
    assert "REPLICATOR_STRATEGY" in result.error


def _train(strategy):
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    with strategy.scope():
        model = torch.nn.Linear(8, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch):
        xb, yb = batch
        F.cross_entropy(model(xb), yb).backward()
        optimizer.step()
        optimizer.zero_grad()

    data = strategy.distribute_dataset(torch.utils.data.TensorDataset(x, y), batch_size=8)
    while True:  # the bench stops it
        for batch in data:
            strategy.run(step, args=(batch,))


def test_bench_of_a_function(tmp_path):
    report = bench_function(_train, nproc=[2], strategies=["mirrored"], steps=5, warmup=1,
                            out_dir=str(tmp_path), quiet=True, report=False, rounds=1)
    (result,) = report.results
    assert result.ok, result.error
    assert result.steps >= 4 and result.batch == 4


def test_bench_command_line_errors(capsys, tmp_path):
    script = str(SCRIPTS / "bench_tiny.py")
    assert main(["bench", script, "--nproc", "0", "--out", str(tmp_path)]) == 2
    assert "positive" in capsys.readouterr().err
    assert main(["bench", script, "--strategies", "mirroed", "--out", str(tmp_path)]) == 2
    assert "unknown strategy 'mirroed'" in capsys.readouterr().err


def test_plan_validate_interleaves_repeated_passes(capsys, tmp_path):
    """``plan --validate --repeat 2``: the script is profiled and every setting run twice in
    turn; each setting's figure is the median of its passes, and a short step is measured for
    at least a second (more steps than --steps asks)."""
    from replicator.plan.profiles import MACHINE_VERSION, MachineProfile, save_json

    # figures of the current calibration, so that plan takes them instead of measuring
    # this machine (an older version is measured again: a minute of this test's time)
    machine = MachineProfile.nominal()
    machine.version = MACHINE_VERSION
    save_json(tmp_path / "machine.json", machine.to_json())
    script = str(SCRIPTS / "bench_tiny.py")
    code = main(["plan", script, "--workers", "1", "--per-host", "2", "--strategies",
                 "one_device", "--validate", "--repeat", "2", "--steps", "4",
                 "--json", "--out", str(tmp_path), "--", "--batch", "32"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    lines = [json.loads(line) for line in captured.out.splitlines()]  # only the plan's lines
    measured = {line["setting"]: line["measured_step_s"] for line in lines}
    assert set(measured) == {"one_device x1"}
    assert "profiling again" in captured.err and "pass 2 of 2" in captured.err
    passes = []
    for k in (1, 2):
        data = json.loads((tmp_path / "validate" / f"pass{k}" / "results.json").read_text())
        passes.append({r["key"]: r for r in data["results"]})
    for label in ("one_device x1",):
        runs = [p[label]["step_seconds"] for p in passes]
        assert measured[label] == pytest.approx(sum(runs) / 2, rel=1e-3)  # median of two
        # a step of a few milliseconds: a second's worth of steps, not the 4 asked for
        assert all(p[label]["steps"] > 20 for p in passes), [p[label]["steps"] for p in passes]
    combined = json.loads((tmp_path / "validate" / "results.json").read_text())
    assert [r["key"] for r in combined["results"]] == ["one_device x1"]


def test_plan_repeat_needs_validate(capsys, tmp_path):
    script = str(SCRIPTS / "bench_tiny.py")
    assert main(["plan", script, "--repeat", "3", "--out", str(tmp_path)]) == 2
    assert "add --validate" in capsys.readouterr().err
    assert main(["plan", script, "--validate", "--repeat", "0", "--out", str(tmp_path)]) == 2
    assert "1 or more" in capsys.readouterr().err
