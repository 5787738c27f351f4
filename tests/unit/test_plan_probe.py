"""The probe in one process: bounded steps, a breakdown that adds up, checkpoints timed."""

import pytest
import torch
import torch.nn.functional as F

from replicator.checkpoint import CheckpointManager
from replicator.comm import timing
from replicator.plan.probe import BenchComplete, Probe, slice_batch
from replicator.strategies import OneDeviceStrategy, observers


def _linear_step(strategy):
    """A linear model made in ``strategy``'s scope, its SGD step and one fixed batch."""
    with strategy.scope():
        model = torch.nn.Linear(16, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))

    def step(batch):
        xb, yb = batch
        F.cross_entropy(model(xb), yb).backward()
        optimizer.step()
        optimizer.zero_grad()

    return model, step, (x, y)


def _loop(strategy, directory, every):
    model, step, batch = _linear_step(strategy)
    manager = CheckpointManager(directory)
    n = 0
    while True:
        strategy.run(step, args=(batch,))
        strategy.reduce("sum", torch.tensor(1.0))
        n += 1
        if n % every == 0:
            with timing.region("checkpoint"):  # what the probe shows as checkpoint time
                manager.save(n, replicated={"model": model.state_dict()})


def _run_until_complete(probe, strategy, directory, **install):
    """``_loop`` under ``probe`` until the probe has its steps (then uninstalled)."""
    probe.install(**install)
    try:
        with pytest.raises(BenchComplete):
            _loop(strategy, directory, every=10**9)
    finally:
        probe.uninstall()


def test_probe_stops_the_loop_and_its_parts_add_up(tmp_path):
    probe = Probe(steps=6, warmup=2)
    strategy = OneDeviceStrategy("cpu")
    probe.install()
    try:
        with pytest.raises(BenchComplete):
            _loop(strategy, tmp_path, every=2)
    finally:
        probe.uninstall()
    result = probe.results()
    assert probe.calls == 8 and len(result["records"]) == 6
    assert result["params"] == 16 * 4 + 4 and result["batch"] == 32
    assert result["strategy"] == "OneDeviceStrategy"
    for r in result["records"]:
        parts = r["compute"] + r["communication"] + r["input"] + r["optimizer"] + \
            r["checkpoint"]
        assert parts == pytest.approx(r["step"], rel=1e-6, abs=1e-7)
        assert r["optimizer"] > 0 and r["compute"] > 0 and r["collectives"] == 1
    saved = [r["checkpoint"] for r in result["records"]]
    assert sum(1 for s in saved if s > 0) == 3  # every second step saved
    # nothing of the library was replaced, and uninstall removed the observer
    assert OneDeviceStrategy.run.__qualname__ == "Strategy.run"
    assert probe.records and not probe._undo and probe not in observers._observers


def test_slice_batch_cuts_every_tensor_with_the_batch_dimension():
    batch = {"x": torch.zeros(8, 3), "y": torch.zeros(8), "w": torch.zeros(3)}
    out = slice_batch((batch, [torch.zeros(8, 2)]), 2, 8)
    assert out[0]["x"].shape == (2, 3) and out[0]["y"].shape == (2,)
    assert out[0]["w"].shape == (3,) and out[1][0].shape == (2, 2)


def _precision_of(model, x, autocast=False):
    from torch.utils.flop_counter import FlopCounterMode

    from replicator.plan.probe import _precision, _SavedBytes

    saved = _SavedBytes({p.untyped_storage().data_ptr() for p in model.parameters()})
    counter = FlopCounterMode(display=False)
    with counter, torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(x).float().sum().backward()
    return _precision(saved.floating, counter)


def test_the_probe_tells_mixed_precision_from_fp32_and_counts_the_tf32_convolutions():
    """A GPU plan picks the datasheet's bf16, TF32 or fp32 rate from these (a float32 model
    planned at the bf16 peak was predicted 9x too fast on an H100)."""
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(),
                               torch.nn.Linear(8 * 6 * 6, 4))
    x = torch.randn(5, 3, 8, 8)
    old = torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()
    try:
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("highest")
        fp32 = _precision_of(conv, x)
        assert fp32["compute_precision"] == "fp32" and 0.3 < fp32["tf32_fraction"] < 1.0
        torch.set_float32_matmul_precision("high")  # matmuls may use TF32 too
        assert _precision_of(conv, x)["tf32_fraction"] == pytest.approx(1.0)
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        assert _precision_of(conv, x)["tf32_fraction"] == 0.0
        assert _precision_of(conv, x, autocast=True)["compute_precision"] == "half"
    finally:
        torch.backends.cudnn.allow_tf32 = old[0]
        torch.set_float32_matmul_precision(old[1])


def _flops(model, x):
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        model(x).sum().backward()
    return counter.get_flop_counts()


def test_stage_shares_follow_the_pipelines_parameter_balanced_cut():
    """A CNN's first convolutions hold few parameters and most FLOPs: cut by parameters, its
    first stage of two does most of the work; a chain of equal layers splits evenly."""
    from replicator.plan.probe import stage_shares

    cnn = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10))
    shares = stage_shares(cnn, _flops(cnn, torch.randn(2, 3, 32, 32)))
    assert 0.6 < shares["2"] < 0.8 and set(shares) == {str(k) for k in range(2, 9)}
    mlp = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    even = stage_shares(mlp, _flops(mlp, torch.randn(8, 64, requires_grad=True)))
    assert even["2"] == pytest.approx(0.5) and even["4"] == pytest.approx(0.25)


def test_stage_shares_of_a_model_the_pipeline_cannot_cut_are_empty():
    from replicator.plan.probe import stage_shares

    class Residual(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 8)

        def forward(self, x):
            return x + self.a(x)

    model = Residual()
    assert stage_shares(model, _flops(model, torch.randn(2, 8))) == {}


def _profile_records(tmp_path, pause):
    """A profile of ``_loop`` whose steps take at least ``pause`` seconds."""
    import time

    from replicator.plan.probe import PROFILE_PHASES

    probe = Probe(steps=0, warmup=2, mode="profile")
    strategy = OneDeviceStrategy("cpu")
    original = strategy.reduce

    def slow_reduce(*args, **kwargs):
        time.sleep(pause)
        return original(*args, **kwargs)

    strategy.reduce = slow_reduce
    _run_until_complete(probe, strategy, tmp_path)
    result = probe.results()
    per_phase = [sum(r["phase"] == k for r in result["records"])
                 for k in range(len(PROFILE_PHASES))]
    return result, per_phase


def test_a_short_steps_profile_phases_run_long_enough_to_measure(tmp_path, monkeypatch):
    """Three steps of a millisecond are noise: a short step's phases run up to 20 times the
    steps, until the shortest lasts long enough; a long step keeps the counts."""
    from replicator.plan import probe as probe_module
    from replicator.plan.probe import PROFILE_MAX_SCALE, PROFILE_PHASES

    # the test's own pace: a step of a millisecond is short at 0.3 s even when a busy machine
    # stretches both warm steps to 90 ms (at 0.15 s, 50 ms counted as long)
    monkeypatch.setattr(probe_module, "PROFILE_PHASE_SECONDS", 0.3)
    short, counts = _profile_records(tmp_path, 0.0)
    scale = short["profile_phase_scale"]
    assert 1 < scale <= PROFILE_MAX_SCALE
    assert counts == [p[1] * scale for p in PROFILE_PHASES]
    long, counts = _profile_records(tmp_path, 0.12)  # 3 x 120 ms: past 0.3 s already
    assert long["profile_phase_scale"] == 1 and counts == [p[1] for p in PROFILE_PHASES]


def test_a_script_that_stops_early_still_has_its_flops_counted(tmp_path):
    """The FLOP-counting step comes first after the warmup: a script shorter than the
    profile's phases (which grow for short steps) still gives what a GPU plan needs."""
    probe = Probe(steps=0, warmup=2, mode="profile")
    strategy = OneDeviceStrategy("cpu")
    _, step, batch = _linear_step(strategy)
    probe.install()
    try:
        for _ in range(6):  # far fewer than the phases
            strategy.run(step, args=(batch,))
    finally:
        probe.uninstall()
    result = probe.results()
    # forward and the weight's gradient (the input needs none): 2 x 2 x 16 x 4 per sample
    assert result["flops_per_sample"] == pytest.approx(2 * 2 * 16 * 4, rel=0.01)
    assert result["activation_bytes_per_sample"] > 0 and result["compute_precision"] == "fp32"
    # after the warmup and the counted step; the last step closes at a call that never came
    assert len(result["records"]) == 6 - probe.warmup - 2


def test_a_gpu_plan_refuses_a_profile_without_flops():
    from replicator.plan.planner import plan_model
    from replicator.plan.profiles import ModelProfile

    model = ModelProfile(name="m", params=10, global_batch=8, param_bytes=40, grad_bytes=40)
    plan_model(model, [1, 2])  # the CPU plan uses the measured times
    with pytest.raises(ValueError, match="counted no FLOPs"):
        plan_model(model, [1, 2], device="h100")


def test_the_progress_file_is_written_at_most_every_interval_and_at_the_end(tmp_path):
    """The bench's bar reads the chief's step count from a file; written every step it cost
    a fifth of a small model's step, so it is written at most every ``PROGRESS_INTERVAL``
    seconds, and always at the last step."""
    from replicator.plan import probe as probe_module

    progress = tmp_path / "progress"
    writes = []
    probe = Probe(steps=40, warmup=2)
    original = probe._write_progress

    def counting() -> None:
        before = progress.stat().st_mtime_ns if progress.exists() else None
        original()
        if progress.exists() and progress.stat().st_mtime_ns != before:
            writes.append(progress.read_text())

    probe._write_progress = counting
    strategy = OneDeviceStrategy("cpu")
    _run_until_complete(probe, strategy, tmp_path, progress_path=str(progress))
    assert probe_module.PROGRESS_INTERVAL >= 0.1
    assert progress.read_text() == "42"  # the last step's count, whatever the interval
    assert 1 <= len(writes) < 42 and writes[0] == "1"


def test_the_profile_keeps_the_inputs_occasional_long_gaps_apart():
    """A loader's new epoch is a long gap every few steps; every replica has it whatever its
    share of the batch, so the profile keeps it apart from the typical step's input."""
    from replicator.plan.planner import model_from_probe

    def record(i, phase, gap):
        return {"step": 1e-3 + gap, "compute": 5e-4, "communication": 0.0, "optimizer": 1e-4,
                "input": 4e-4 - 1e-4 + gap, "checkpoint": 0.0, "overlapped": 0.0,
                "phase": phase, "batch": 32.0 / (1 + (phase > 1)), "collectives": 1.0}

    # one epoch start of 1.2 ms in every 6 steps (in the kept steps' mean: 1 in 8 there)
    records = [record(i, phase, 1.2e-3 if i % 6 == 5 else 0.0)
               for phase in (0, 1, 2) for i in range(24)]
    result = {"records": records, "params": 10, "param_bytes": 40, "grad_bytes": 40,
              "batch": 32}
    model = model_from_probe(result, "m")
    kept_mean = model.input_seconds_1thread
    assert kept_mean > 3e-4 + 1e-4  # the gaps count in the mean
    assert model.input_occasional_seconds == pytest.approx(kept_mean - 3e-4, rel=1e-6)


def test_the_profile_times_the_forward_pass_up_to_the_end_of_the_models_call(tmp_path):
    """In profile mode each step records the time from the run's start to the end of the
    model's call (a pipeline's second, value-only forward costs that share of the work),
    through a forward hook on the model, which uninstall removes; the planner takes the
    median share of compute. torch's functions are left as they are."""
    from replicator.plan.planner import model_from_probe

    original_backward = torch.autograd.backward
    probe = Probe(steps=0, warmup=2, mode="profile")
    strategy = OneDeviceStrategy("cpu")
    _run_until_complete(probe, strategy, tmp_path)
    assert torch.autograd.backward is original_backward
    records = probe.results()["records"]
    assert records and all(0 < r["forward"] < r["compute"] for r in records)
    model = model_from_probe(probe.results(), "m")
    assert 0 < model.forward_fraction < 1
    assert not probe._undo  # the model's forward hook went with the rest


def test_the_probe_counts_the_blocks_fsdp_would_shard_not_the_weight_matrices():
    # a transformer layer holds four weight matrices and is one block of FSDPStrategy's
    probe = Probe(steps=0, warmup=2, mode="profile")
    strategy = OneDeviceStrategy("cpu")
    with strategy.scope():
        layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)
        model = torch.nn.Sequential(torch.nn.Embedding(50, 16), layer, torch.nn.Flatten(),
                                    torch.nn.Linear(16 * 4, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randint(0, 50, (8, 4)), torch.randint(0, 2, (8,))

    def step(batch):
        F.cross_entropy(model(batch[0]), batch[1]).backward()
        optimizer.step()
        optimizer.zero_grad()

    probe.install()
    try:
        for _ in range(5):
            strategy.run(step, args=((x, y),))
    finally:
        probe.uninstall()
    result = probe.results()
    assert result["fsdp_units"] == 3  # the embedding, the layer, the head
    assert result["weight_tensors"] == 6
