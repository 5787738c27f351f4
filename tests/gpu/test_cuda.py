"""The CUDA/NCCL paths on a real GPU: device placement, NCCL groups, the input pipeline's
pinned copies, fp16 loss scaling, and exact resume with CUDA random state.

Skipped where no GPU is visible (CI); run on a GPU machine with ``pytest tests/gpu``. Each
test states what would go wrong on a GPU that the CPU suite cannot see.
"""

from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

import replicator as rp
from replicator.resume import BackupAndRestore
from replicator.testing import assert_params_close, run_distributed
from tests.helpers import make_mlp, regression_data

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(300),
]

STEPS = 20
GLOBAL_BATCH = 32


@pytest.fixture(autouse=True)
def _exact_float32():
    """TF32 matmuls would differ from the CPU reference by ~1e-3; compare true float32."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _train(strategy: rp.Strategy, initial: dict | None = None) -> dict:
    """SGD with momentum on the MLP for STEPS global batches; the state on the CPU, plus
    where the batches and the parameters lived. ``initial``: weights to start from."""
    torch.backends.cuda.matmul.allow_tf32 = False
    with strategy.scope():
        model = make_mlp()  # made on the strategy's device, from that device's generator
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if initial is not None:
        model.load_state_dict(initial)
    seen: set[str] = set()

    def step(batch):
        x, y = batch
        seen.add(str(x.device))
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    loader = DataLoader(regression_data(), batch_size=GLOBAL_BATCH, shuffle=True)
    it = iter(strategy.distribute_dataset(loader, seed=3))
    for _ in range(STEPS):
        loss = strategy.reduce("mean", strategy.run(step, args=(next(it),)))
    return {"state": {k: v.detach().cpu() for k, v in model.state_dict().items()},
            "batch_devices": sorted(seen), "param_device": str(next(model.parameters()).device),
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "loss": float(loss)}


def test_one_device_on_cuda_equals_the_cpu_from_the_same_weights():
    """Placement in scope(), the input copied to the GPU, the optimizer state on the GPU.

    Modules made in scope() on a GPU are initialised there, by the GPU's generator: the same
    seed gives other initial weights than on the CPU (as under ``with torch.device("cuda")``),
    so the two start from one set of weights here.
    """
    initial = make_mlp().state_dict()
    cpu = _train(rp.OneDeviceStrategy("cpu"), initial)
    gpu = _train(rp.OneDeviceStrategy("cuda"), initial)
    assert gpu["param_device"] == "cuda:0" and gpu["batch_devices"] == ["cuda:0"]
    assert_params_close(cpu["state"], gpu["state"], atol=1e-5)
    assert any(not torch.equal(cpu["state"][k], v) for k, v in initial.items())


def _by_name(name: str) -> dict:
    return _train(rp.get_strategy(name))


@pytest.mark.parametrize("name", ["mirrored", "central_storage", "fsdp"])
def test_synchronous_strategies_on_one_gpu_use_nccl_and_equal_one_device(name):
    reference = _train(rp.OneDeviceStrategy("cuda"))
    (out,) = run_distributed(_by_name, world_size=1, args=(name,))
    assert out["backend"] == "nccl" and out["param_device"] == "cuda:0"
    assert out["batch_devices"] == ["cuda:0"]
    assert_params_close(reference["state"], out["state"], atol=1e-5)


@pytest.mark.skipif(torch.cuda.device_count() != 1 or
                    "," not in os.environ.get("CUDA_VISIBLE_DEVICES", ","),
                    reason="needs exactly one GPU, not given by CUDA_VISIBLE_DEVICES (a GPU named "
                           "there is each process's own)")
def test_more_processes_than_gpus_all_run_on_the_cpu():
    """2 processes, 1 GPU: rank 0 on NCCL beside rank 1 on gloo cannot form a group; both take
    the CPU and the result still equals one device."""
    reference = _train(rp.OneDeviceStrategy("cpu"))
    outs = run_distributed(_by_name, world_size=2, args=("mirrored",))
    assert [o["backend"] for o in outs] == ["gloo", "gloo"]
    assert [o["param_device"] for o in outs] == ["cpu", "cpu"]
    for out in outs:
        assert_params_close(reference["state"], out["state"], atol=1e-5)


def test_fp16_loss_scaling_on_cuda_trains_and_skips_overflowing_steps():
    strategy = rp.OneDeviceStrategy("cuda")
    policy = rp.MixedPrecision("fp16", init_scale=2.0 ** 16, growth_interval=5)
    with strategy.scope(precision=policy):
        model = make_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inner: list[torch.dtype] = []
    model[0].register_forward_hook(lambda m, a, out: inner.append(out.dtype))
    x, y = (t.cuda() for t in regression_data(256).tensors)
    losses, stepped = [], []
    for i in range(40):
        loss = F.cross_entropy(model(x), y)
        policy.backward(loss)
        if i == 3:  # an overflow as fp16 produces it: every replica must skip this step
            model[0].weight.grad[0, 0] = float("inf")
        before = model[0].weight.detach().clone()
        stepped.append(policy.step(optimizer))
        assert torch.equal(before, model[0].weight) == (not stepped[-1])
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    assert inner[0] == torch.float16 and all(p.dtype == torch.float32
                                             for p in model.parameters())
    assert not stepped[3] and policy.skipped_steps >= 1
    assert losses[-1] < 0.8 * losses[0]


def _backup_run(directory, crash_at=None):
    """BackupAndRestore on the GPU: dropout and input noise draw from the CUDA generator, so a
    resume is bit-identical only if the CUDA random state was saved and restored."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    device = torch.device("cuda")
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Dropout(0.3),
                                torch.nn.Linear(32, 3)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    backup = BackupAndRestore(directory, save_freq=5, delete_checkpoint=False)
    backup.track(model=model, optimizer=opt)
    data = rp.OneDeviceStrategy("cuda").distribute_dataset(regression_data(160), batch_size=8,
                                                          shuffle=True, seed=5)
    log = []
    for step, (x, y) in backup.steps(data, epochs=2):
        if step == crash_at:
            raise RuntimeError(f"crash at {step}")
        assert x.is_cuda
        loss = F.cross_entropy(model(x + 0.1 * torch.randn_like(x)), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        log.append((step, loss.item()))
    backup.close()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}, log, backup


def test_resume_on_cuda_is_bit_identical(tmp_path):
    ref_state, ref_log, _ = _backup_run(tmp_path / "ref")
    with pytest.raises(RuntimeError, match="crash at 23"):
        _backup_run(tmp_path / "run", crash_at=23)
    state, log, backup = _backup_run(tmp_path / "run")
    assert backup.restored.step == 20
    assert log == ref_log[20:]
    for key, value in ref_state.items():
        assert torch.equal(value, state[key]), key


def _fit(directory: str, crash_at_epoch: int | None) -> dict:
    """Trainer.fit under MirroredStrategy on NCCL with a backup (its step agreement and state
    exchange run on the GPU); a crash after an epoch, then a rerun resumes."""
    torch.backends.cuda.matmul.allow_tf32 = False
    strategy = rp.MirroredStrategy()
    with strategy.scope():
        model = make_mlp()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

    class Crash(rp.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == crash_at_epoch:
                raise RuntimeError(f"crash after epoch {epoch}")

    data = strategy.distribute_dataset(regression_data(), batch_size=GLOBAL_BATCH,
                                       shuffle=True, seed=4)
    trainer = rp.Trainer(strategy, model, optimizer, F.cross_entropy)
    try:
        trainer.fit(data, epochs=3, verbose=0,
                    callbacks=[BackupAndRestore(directory, save_freq="epoch"), Crash()])
    except Exception as exc:  # the launcher would restart the job; the test reruns it
        return {"error": str(exc)}
    return {"state": {k: v.detach().cpu() for k, v in model.state_dict().items()}}


def test_trainer_backup_on_nccl_resumes_to_the_uninterrupted_result(tmp_path):
    (reference,) = run_distributed(_fit, world_size=1, args=(str(tmp_path / "ref"), None))
    (crashed,) = run_distributed(_fit, world_size=1, args=(str(tmp_path / "run"), 1))
    assert "crash after epoch 1" in crashed["error"]
    (resumed,) = run_distributed(_fit, world_size=1, args=(str(tmp_path / "run"), None))
    for key, value in reference["state"].items():
        assert torch.equal(value, resumed["state"][key]), key


def test_bench_on_cuda_times_the_device_work_and_reports_gpu_memory(tmp_path):
    """A GPU kernel runs after the call that queued it returns: timed without synchronizing,
    ``bench``'s compute would be launch time and the step's real cost would land in whatever
    part waited next. Its step must match the same step timed here, synchronized."""
    from pathlib import Path

    from replicator.plan.benchmark import bench_script

    width, batch = 8192, 1024  # ~0.4 TFLOP a step: milliseconds on the GPU, not launches
    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_tiny.py"
    report = bench_script(str(script), ["--width", str(width), "--batch", str(batch)],
                          nproc="1", strategies="one_device", steps=8, warmup=2,
                          out_dir=str(tmp_path), quiet=True)
    (result,) = report.results
    assert result.ok, result.error

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, 2)).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, 16, device="cuda"), torch.randint(0, 2, (batch,), device="cuda")
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    reference = float(np.median(times[2:]))

    b = result.breakdown
    assert sum(b.values()) == pytest.approx(result.step_seconds, rel=0.10)
    # unsynchronized, compute would be launch time and the rest would move to the input part
    assert 0.7 < (b["compute"] + b["optimizer"]) / reference < 1.6, (b, reference)
    assert b["optimizer"] > 0.05 * reference  # Adam streams 4 copies of 268 MB of weights
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    (device_peak,) = result.peak_device
    assert device_peak >= 4 * param_bytes  # weights, gradients and Adam's two moments
    assert "(GPU " in (tmp_path / "report.md").read_text()
