"""The shipped demo and examples run end to end on 2 local workers.

Each is launched by ``replicator run`` (or ``replicator demo``) as typed: the command line's
own ``main``, in this process (one fresh interpreter fewer per test); the workers are new
processes as always, and their output reaches this process's stdout and stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replicator.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_demo_trains_digits_to_at_least_95_percent(capfd):
    code = main(["demo"])
    out = capfd.readouterr()
    assert code == 0, out.err
    lines = [ln.removeprefix("[rank 0] ") for ln in out.out.splitlines()]  # the relay's prefix
    line = next(ln for ln in lines if ln.startswith("test accuracy"))
    accuracy = float(line.split()[2])
    assert accuracy >= 0.95, out.out
    assert "replicas 2" in line and "wall time" in line


@pytest.mark.timeout(120)
def test_demo_under_the_parameter_server_says_the_epoch_was_shared(capfd):
    # 'replicator demo --strategy ps' was refused unless the parameter server's room had been
    # imported; its workers share an epoch's batches, so the chief's line says how many it ran
    code = main(["demo", "--strategy", "ps", "--num-ps", "1", "--nproc", "3", "--epochs", "1"])
    out = capfd.readouterr()
    assert code == 0, out.err
    line = next(ln.removeprefix("[rank 0] ") for ln in out.out.splitlines() if "epoch 1/1" in ln)
    ran = int(line.split("step ")[1].split()[0])
    assert 0 < ran < 45 and "of the epoch's 45 batches on this worker" in line, line


#: Examples that launch their own replicas and have their own smoke test (``--quick``).
SELF_LAUNCHING = {"large_batch.py"}  # tests/distributed/test_large_batch.py
#: actor-learner examples: one learner beside actors, not two data-parallel workers
ACTOR_EXAMPLES = {"rl_d4pg.py", "rl_impala.py"}
NOT_SCRIPTS = {"rl_plot.py"}  # a module the RL examples import


@pytest.mark.timeout(90)
@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.py")
                                           if p.name not in SELF_LAUNCHING | ACTOR_EXAMPLES
                                           | NOT_SCRIPTS))
def test_example_runs_two_steps_on_two_workers(example, capfd):
    code = main(["run", "--nproc", "2", str(ROOT / "examples" / example), "--steps", "2"])
    assert code == 0, capfd.readouterr().err


@pytest.mark.timeout(150)
@pytest.mark.parametrize("example", sorted(ACTOR_EXAMPLES))
def test_actor_example_runs_two_learner_steps_beside_an_actor(example, tmp_path, capfd,
                                                             monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = main(["run", "--nproc", "1", "--num-actors", "1", str(ROOT / "examples" / example),
                 "--steps", "2", "--plot", str(tmp_path / "returns.png")])
    out = capfd.readouterr()
    assert code == 0, out.err
    assert "learner_steps" in out.out, out.out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("example", sorted(ACTOR_EXAMPLES))
def test_actor_example_runs_in_one_process_without_actors(example, tmp_path):
    # the one-process baseline the rl benchmark times the actors against, run as documented
    done = subprocess.run([sys.executable, str(ROOT / "examples" / example), "--in-process",
                           "--steps", "2", "--plot", str(tmp_path / "returns.png")],
                          capture_output=True, text=True, timeout=110, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stderr
    result = next(line for line in done.stdout.splitlines() if "learner_steps" in line)
    assert "'learner_steps': 2" in result and "'max_policy_lag'" in result, result


@pytest.mark.timeout(150)
def test_gan_example_on_two_replicas_equals_one_device(tmp_path, capfd):
    # TF-Replicator's GAN shape: two optimizers in one step_fn, the generator's update going
    # through the discriminator's (whose gradients that backward also makes and syncs)
    script = str(ROOT / "examples" / "gan.py")
    weights = {}
    for nproc in (1, 2):
        path = tmp_path / f"gan_{nproc}.pt"
        code = main(["run", "--nproc", str(nproc), script, "--steps", "30", "--save",
                     str(path)])
        out = capfd.readouterr()
        assert code == 0, out.err
        assert f"replicas {nproc}, steps 30" in out.out, out.out
        weights[nproc] = torch.load(path, weights_only=True)
    for net in ("generator", "discriminator"):
        for name, one in weights[1][net].items():
            torch.testing.assert_close(weights[2][net][name], one, rtol=1e-5, atol=1e-5,
                                       msg=f"{net}.{name} differs between 1 and 2 replicas")
