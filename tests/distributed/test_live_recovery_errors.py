"""Errors of live recovery name the replica group and rank and never hang: an unreachable
lighthouse, a quorum of --min-replicas groups that never forms, a group whose model differs,
a strategy that cannot run in replica groups, and a missing lighthouse address."""

from __future__ import annotations

import time

import pytest

from replicator.errors import ClusterConfigError
from replicator.strategies.live.settings import LiveSettings
from replicator.testing.live_groups import free_port, start_group, start_lighthouse
from tests.live_helpers import SCRIPT, env, needs_torchft

FAST = {"REPLICATOR_QUORUM_TIMEOUT_SECONDS": "5"}


def _run_alone(tmp_path, lighthouse: str, *, min_replicas: int = 1, group: int = 0) -> str:
    start = time.monotonic()
    g = start_group(SCRIPT, group, 2, lighthouse, min_replicas=min_replicas,
                    env={**env(), **FAST}, log_dir=tmp_path, args=["--out", str(tmp_path)])
    assert g.wait(120) == [1]
    assert time.monotonic() - start < 90
    log = (tmp_path / f"group{group}_rank0.log").read_text()
    # a failed start stops the group's state server: nothing is left for the exit to wait on
    assert "helper thread(s)" not in log, log[-2000:]
    return log


@pytest.mark.timeout(180)
@needs_torchft
def test_unreachable_lighthouse_names_group_and_rank(tmp_path):
    log = _run_alone(tmp_path, f"http://127.0.0.1:{free_port()}", group=1)
    assert "LighthouseUnreachableError: replica group 1, rank 0 could not join the lighthouse" \
        in log


@pytest.mark.timeout(180)
@needs_torchft
def test_quorum_below_min_replicas_times_out_with_a_named_error(tmp_path):
    lighthouse = start_lighthouse(2)
    try:
        log = _run_alone(tmp_path, lighthouse.address, min_replicas=2)
    finally:
        lighthouse.stop()
    assert ("QuorumTimeoutError: replica group 0, rank 0 waited 5 s for a quorum of at least 2 "
            "replica group(s)") in log
    assert "REPLICATOR_QUORUM_TIMEOUT_SECONDS" in log


@pytest.mark.timeout(300)
@needs_torchft
def test_a_group_whose_model_differs_is_refused(tmp_path):
    lighthouse = start_lighthouse(2, join_timeout_ms=10000)
    groups = []
    try:
        for g, width in ((0, "32"), (1, "16")):
            groups.append(start_group(SCRIPT, g, 2, lighthouse.address, min_replicas=2,
                                      env={**env(), **FAST}, log_dir=tmp_path,
                                      args=["--out", str(tmp_path), "--width", width]))
        codes = [g.wait(200) for g in groups]
    finally:
        for g in groups:
            g.kill()
        lighthouse.stop()
    logs = [(tmp_path / f"group{g}_rank0.log").read_text() for g in range(2)]
    assert codes == [[1], [1]], logs
    refused = [g for g in range(2) if "ReplicaGroupMismatchError" in logs[g]]
    assert len(refused) == 1, logs
    g = refused[0]
    assert f"replica group {g}, rank 0 built a model that differs from its peer group's" \
        in logs[g]
    # the other group is left below --min-replicas 2 and says so instead of waiting forever
    assert "QuorumTimeoutError" in logs[1 - g]


def test_settings_errors_name_the_fix():
    assert LiveSettings.from_env({}) is None
    with pytest.raises(ClusterConfigError, match="REPLICATOR_LIGHTHOUSE is not set"):
        LiveSettings.from_env({"REPLICATOR_REPLICA_GROUPS": "2", "REPLICATOR_REPLICA_GROUP": "1"})
    with pytest.raises(ClusterConfigError, match="needs an integer REPLICATOR_REPLICA_GROUP"):
        LiveSettings.from_env({"REPLICATOR_REPLICA_GROUPS": "2"})
    s = LiveSettings.from_env({"REPLICATOR_REPLICA_GROUPS": "3", "REPLICATOR_REPLICA_GROUP": "2",
                               "REPLICATOR_LIGHTHOUSE": "127.0.0.1:29510", "RANK": "1",
                               "WORLD_SIZE": "2", "REPLICATOR_MIN_REPLICAS": "2"})
    assert s is not None and s.lighthouse == "http://127.0.0.1:29510"
    assert (s.group, s.groups, s.rank, s.group_size, s.min_replicas) == (2, 3, 1, 2, 2)
    assert s.who == "replica group 2, rank 1"
    assert s.quorum_every == 10
    base = {"REPLICATOR_REPLICA_GROUPS": "2", "REPLICATOR_REPLICA_GROUP": "0",
            "REPLICATOR_LIGHTHOUSE": "127.0.0.1:29510"}
    every = LiveSettings.from_env({**base, "REPLICATOR_QUORUM_EVERY_STEPS": "1"})
    assert every is not None and every.quorum_every == 1
    with pytest.raises(ClusterConfigError, match="whole number of steps"):
        LiveSettings.from_env({**base, "REPLICATOR_QUORUM_EVERY_STEPS": "2.5"})
    assert every.transport == "auto"
    gloo = LiveSettings.from_env({**base, "REPLICATOR_LIVE_TRANSPORT": "gloo"})
    assert gloo is not None and gloo.transport == "gloo"
    with pytest.raises(ClusterConfigError, match="must be one of auto, gloo"):
        LiveSettings.from_env({**base, "REPLICATOR_LIVE_TRANSPORT": "nccl"})


_FIT = """
import torch, replicator as rp
from torch.utils.data import TensorDataset
strategy = rp.MirroredStrategy()
trainer = rp.Trainer(strategy, lambda: torch.nn.Linear(4, 2),
                     lambda params: torch.optim.SGD(params, lr=0.1),
                     torch.nn.functional.cross_entropy)
data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
trainer.fit(torch.utils.data.DataLoader(data, batch_size=8), epochs=2, verbose=0)
"""


@pytest.mark.timeout(180)
@needs_torchft
def test_trainer_fit_in_replica_groups_is_refused_with_the_loop_to_write(tmp_path):
    script = tmp_path / "fit.py"
    script.write_text(_FIT)
    lighthouse = start_lighthouse(1)
    try:
        g = start_group(script, 0, 1, lighthouse.address, env={**env(), **FAST},
                        log_dir=tmp_path)
        assert g.wait(120) == [1]
    finally:
        lighthouse.stop()
    log = (tmp_path / "group0_rank0.log").read_text()
    assert "LiveRecoveryError: Trainer.fit does not run in replica groups" in log, log[-3000:]
    assert "backup.steps(dist, epochs=E)" in log
