"""The planner's recommendations for models profiled in this process, its speed, its JSON lines
and its errors on nonsense input."""

import json
import time

import pytest
import torch
import torch.nn.functional as F

from replicator.cli import main
from replicator.plan.planner import model_from_probe, plan_model, profile_here
from replicator.plan.profiles import MachineProfile, ModelProfile

DATA_PARALLEL = {"mirrored", "central_storage", "parameter_server"}


def _trainer(make_model, x, y):
    """``train(strategy)``: an endless loop of SGD steps on one fixed batch."""
    def train(strategy):
        torch.manual_seed(0)
        with strategy.scope():
            model = make_model()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

        def step(batch):
            xb, yb = batch
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss.detach()

        while True:
            strategy.run(step, args=((x, y),))
    return train


def mlp_10k():
    return torch.nn.Sequential(torch.nn.Linear(20, 100), torch.nn.ReLU(),
                               torch.nn.Linear(100, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


class ConvNet(torch.nn.Module):
    """Compute-bound: convolutions on 24x24 images, ~28k parameters."""

    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 32, 3, padding=1)
        self.c2 = torch.nn.Conv2d(32, 64, 3, padding=1)
        self.fc = torch.nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        return self.fc(F.relu(self.c2(x)).mean((2, 3)))


def test_a_10k_parameter_mlp_stays_on_one_process():
    x, y = torch.randn(64, 20), torch.randint(0, 10, (64,))
    model = profile_here(_trainer(mlp_10k, x, y), "mlp")
    assert 9_000 <= model.params <= 11_000 and model.global_batch == 64
    assert model.flops_per_sample > 0 and model.activation_bytes_per_sample > 0
    plan = plan_model(model, [2], machine=MachineProfile.nominal())
    assert plan.recommended is not None
    assert plan.recommended.setting == "one_device x1", plan.reason
    assert plan.reason.startswith("stay on one process")


def test_a_compute_bound_cnn_is_trained_data_parallel():
    x, y = torch.randn(64, 3, 24, 24), torch.randint(0, 10, (64,))
    model = profile_here(_trainer(ConvNet, x, y), "cnn")
    plan = plan_model(model, [2, 8], machine=MachineProfile.nominal())
    chosen = plan.recommended
    assert chosen is not None and chosen.strategy in DATA_PARALLEL and chosen.workers > 1, \
        plan.reason
    single = next(p for p in plan.predictions if p.strategy == "one_device")
    assert chosen.samples_per_second > 1.5 * single.samples_per_second


def test_the_compute_fit_follows_the_batch():
    result = {"params": 10, "param_bytes": 40, "grad_bytes": 40, "batch": 64, "records": [
        {"phase": 0, "batch": 64, "step": 0.02, "compute": 0.01, "optimizer": 0.002,
         "input": 0.001, "collectives": 1},
        *[{"phase": ph, "batch": b, "step": 0.0, "compute": 0.001 + 1e-4 * b,
           "optimizer": 0.003, "input": 0.002, "collectives": 1}
          for ph, b in ((1, 64), (2, 32), (3, 16)) for _ in range(3)]]}
    model = model_from_probe(result, "synthetic")
    assert model.compute_fit == pytest.approx((0.001, 1e-4), rel=1e-6)
    assert model.compute_seconds == 0.01 and model.optimizer_seconds_1thread == 0.003
    assert model.collectives_per_step == 1


def test_a_few_preempted_optimizer_steps_do_not_move_the_optimizer_time():
    # 30 one-thread steps whose optimizer takes 0.1 ms, 4 of them preempted by a busy
    # neighbour for 25 ms: their mean (3.4 ms) made FSDP's sharded optimizer win a CNN's plan
    records = [{"phase": 0, "batch": 64, "step": 0.02, "compute": 0.01, "optimizer": 1e-4,
                "input": 0.001, "collectives": 1}]
    for i in range(30):
        records.append({"phase": 1 + i % 3, "batch": (64, 32, 16)[i % 3], "step": 0.0,
                        "compute": 0.001 + 1e-4 * (64, 32, 16)[i % 3],
                        "optimizer": 0.025 if i % 8 == 0 else 1e-4, "input": 0.002,
                        "collectives": 1})
    model = model_from_probe({"params": 10, "param_bytes": 40, "grad_bytes": 40, "batch": 64,
                              "records": records}, "synthetic")
    assert model.optimizer_seconds_1thread == pytest.approx(1e-4)
    assert model.optimizer_seconds == pytest.approx(1e-4)


def test_a_plan_takes_well_under_two_seconds():
    model = ModelProfile.from_parameter_count(7e9, global_batch=512, seq_len=2048)
    start = time.perf_counter()
    for device in ("cpu", "a100", "h100"):
        plan_model(model, [2, 8, 64, 1024], device=device, link="100gbit",
                   machine=MachineProfile.nominal())
    assert time.perf_counter() - start < 2.0


def test_json_lines_have_exactly_one_recommendation(capsys, tmp_path):
    rc = main(["plan", "--model-params", "7e9", "--device", "h100", "--workers", "8,64,1024",
               "--link", "100gbit", "--json", "--out", str(tmp_path)])
    assert rc == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 1 + 6 * 3  # one process, then six strategies at three counts
    assert sum(line["recommended"] for line in lines) == 1
    for line in lines:
        assert set(line) >= {"setting", "strategy", "workers", "predicted_step_s",
                             "measured_step_s", "fits", "recommended", "reason"}
        assert line["measured_step_s"] is None and line["reason"]
    best = next(line for line in lines if line["recommended"])
    assert best["fits"] and best["predicted_step_s"] > 0


@pytest.mark.parametrize("argv, match", [
    (["--workers", "0"], "positive"),
    (["--workers", "two"], "comma-separated"),
    (["--link=-5gbit"], "negative"),
    (["--device", "tpu9"], "unknown device"),
    (["--model-params", "-3"], "--model-params"),
])
def test_nonsense_is_a_clear_error(argv, match, capsys, tmp_path):
    base = ["plan", "--model-params", "1e6", "--device", "a100", "--out", str(tmp_path)]
    rc = main(base + argv)
    err = capsys.readouterr().err
    assert rc == 2 and match in err and "replicator plan: error" in err


def test_plan_needs_a_script_or_a_size(capsys, tmp_path):
    assert main(["plan", "--device", "a100", "--out", str(tmp_path)]) == 2
    assert "give a training script or --model-params" in capsys.readouterr().err


def test_a_short_steps_profile_takes_trimmed_means_whose_parts_add_up():
    """A loader's new epoch makes one short step in twenty long: medians of the parts miss
    it (and no longer add up to the step), the bench's trimmed means count it."""
    def record(step, inp, phase=0):
        return {"step": step, "compute": 0.4e-3, "input": inp, "optimizer": 0.2e-3,
                "communication": 0.0, "checkpoint": 0.0, "phase": phase, "batch": 64.0,
                "collectives": 1.0, "overlapped": 0.0}

    records = []
    for phase in range(4):
        for i in range(40):
            slow = i % 5 == 4  # every fifth step waits 1 ms more for its input
            inp = 1.4e-3 if slow else 0.4e-3
            records.append(record(0.6e-3 + inp, inp, phase))
    result = {"params": 100, "param_bytes": 400, "grad_bytes": 400, "batch": 64,
              "records": records}
    model = model_from_probe(result, "m")
    kept = sorted(records[:40], key=lambda r: r["step"])[4:36]
    mean_input = sum(r["input"] for r in kept) / len(kept)
    assert model.input_seconds == pytest.approx(mean_input) and mean_input > 0.5e-3
    assert model.compute_seconds + model.optimizer_seconds + model.input_seconds == \
        pytest.approx(model.step_seconds)


def test_a_cached_machine_profile_from_an_older_calibration_is_measured_again(tmp_path,
                                                                               monkeypatch):
    """``machine.json`` keeps its calibration's version; one from before the current
    calibration is measured again instead of feeding the plan outdated figures."""
    from replicator.plan import measure, planner
    from replicator.plan.profiles import MACHINE_VERSION, save_json

    fresh = MachineProfile.nominal()
    fresh.source, fresh.version, fresh.cores = "measured", MACHINE_VERSION, 7
    measured = []
    monkeypatch.setattr(measure, "measure_machine",
                        lambda log=print: measured.append(1) or fresh)
    old = MachineProfile.nominal().to_json()
    old.pop("version")  # written before versions were kept
    old["source"] = "measured"
    save_json(tmp_path / "machine.json", old)
    lines = []
    machine = planner.load_machine(str(tmp_path), log=lines.append)
    assert measured == [1] and machine.cores == 7
    assert "older calibration (version 1" in lines[0]
    assert json.loads((tmp_path / "machine.json").read_text())["version"] == MACHINE_VERSION
    assert planner.load_machine(str(tmp_path), log=lines.append).cores == 7
    assert measured == [1]  # the current version is kept


def test_the_demos_plan_line_recommends_nothing_before_this_machine_is_measured(tmp_path):
    """Figures not measured here recommended "mirrored x8 at 1.8x" on a machine where plan,
    once it had measured, said "stay on one process": without bench/machine.json the line
    names no setting and says how to measure; with it, it recommends from those figures."""
    from torch.utils.data import TensorDataset

    from replicator.plan.planner import plan_line
    from replicator.plan.profiles import save_json

    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))

    def model_fn():
        return torch.nn.Linear(8, 2)

    line = plan_line(model_fn, data, 16, out_dir=str(tmp_path), script="demo.py",
                     script_args="--strategy {strategy}")
    assert line.startswith("plan: no recommendation yet") and "->" not in line
    assert "replicator plan demo.py --workers 2,8,64 -- --strategy {strategy}" in line
    assert str(tmp_path / "machine.json") in line
    assert not any(word in line for word in ("mirrored", "stay on one process"))
    save_json(tmp_path / "machine.json", MachineProfile.nominal().to_json())
    line = plan_line(model_fn, data, 16, out_dir=str(tmp_path))
    assert "this machine's measured figures) -> " in line
