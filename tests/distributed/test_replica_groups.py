"""Every strategy composes one replica-group core: a rank stalled in a collective of the
strategy's group fails the job after the timeout, naming that rank (also on a mesh axis whose
groups run side by side); and the mesh's data axis runs the one gradient engine, so
``accumulate(4)`` communicates once per 4 micro-batches and still equals one device."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import replicator as rp
from replicator.cluster.topology import Topology
from replicator.comm.options import CommunicationOptions
from replicator.errors import WorkerFailedError
from replicator.launch.script_launch import launch
from replicator.testing import assert_params_close, run_distributed
from tests.distributed.model_parallel_models import full_state, loss_of, make_mlp, mlp_data

TIMEOUT_SECONDS = 5.0
STALL_SECONDS = 120.0

# kind -> (processes, parameter servers, the stalled rank)
STALLS = {"mesh_data2_tensor2": (4, 0, 3), "mirrored_on_a_mesh_axis": (4, 0, 3),
          "mirrored": (2, 0, 1), "central_storage": (2, 0, 1),
          "parameter_server_sync": (3, 1, 1)}


def _strategy(kind: str) -> rp.Strategy:
    options = CommunicationOptions(timeout_seconds=TIMEOUT_SECONDS)
    if kind == "mesh_data2_tensor2":
        return rp.MeshStrategy(data=2, tensor=2, timeout_seconds=TIMEOUT_SECONDS)
    if kind == "mirrored_on_a_mesh_axis":
        return rp.MirroredStrategy(mesh=Topology({"data": 2, "tensor": 2}), axis="data",
                                   communication_options=options)
    if kind == "mirrored":
        return rp.MirroredStrategy(communication_options=options)
    if kind == "central_storage":
        return rp.CentralStorageStrategy(communication_options=options)
    return rp.ParameterServerStrategy(num_ps=1, staleness=0, timeout_seconds=TIMEOUT_SECONDS)


def _stall_before_reduce(kind: str) -> float:
    strategy = _strategy(kind)
    stalled = STALLS[kind][2]
    strategy.reduce("sum", 1.0)  # everyone is up and in step once
    if dist.get_rank() == stalled:
        time.sleep(STALL_SECONDS)  # far longer than the timeout
    return float(strategy.reduce("sum", 1.0))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", [
    k if k in ("mesh_data2_tensor2", "mirrored", "parameter_server_sync")
    else pytest.param(k, marks=pytest.mark.slow)  # the same timeout path on fewer ranks
    for k in STALLS])
def test_a_rank_stalled_in_a_replica_collective_fails_the_job_naming_it(kind):
    processes, num_ps, stalled = STALLS[kind]
    start = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        launch(_stall_before_reduce, num_replicas=processes, num_ps=num_ps, args=(kind,),
               timeout_seconds=TIMEOUT_SECONDS, start_method="forkserver")
    elapsed = time.monotonic() - start
    text = str(info.value)
    assert "ReplicaTimeoutError" in text, text
    assert f"did not arrive: rank {stalled} " in text, text  # the tracker of the right group
    assert info.value.rank != stalled
    assert elapsed < STALL_SECONDS * 0.75, f"the job waited {elapsed:.0f} s"


# -- one gradient engine on the mesh's data axis --------------------------------------------
K = 4
BATCH = 16


def _accumulated(degrees: dict[str, int] | None, k: int, batch: int, steps: int = 3) -> dict:
    """``steps`` optimizer steps of ``k`` micro-batches of ``batch``; per micro-batch, the
    number of collectives on the data axis's tracker during its backward."""
    strategy = rp.MeshStrategy(**degrees) if degrees else rp.OneDeviceStrategy("cpu")
    with strategy.scope():
        model = make_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    accum = strategy.accumulate(k)
    tracker = strategy.collectives.tracker
    counts: list[int] = []

    def step_fn(b):
        x, y = b
        before = tracker.seq
        with accum:
            accum.backward(loss_of(model(x), y))
        counts.append(tracker.seq - before)
        accum.step(optimizer)

    loader = DataLoader(mlp_data(n=k * batch * steps), batch_size=batch)
    for b in strategy.distribute_dataset(loader, shuffle=False):
        strategy.run(step_fn, args=(b,))
    assert not accum.ready and accum.micro_step == 0
    return {"state": full_state(strategy, model), "counts": counts}


MESHES = {"data2xtensor2": {"data": 2, "tensor": 2},
          "data2xpipeline2": {"data": 2, "pipeline": 2},
          "data2xfsdp2": {"data": 2, "fsdp": 2}}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(MESHES))
def test_accumulate_4_under_a_mesh_syncs_once_per_4_micro_batches_and_equals_one_device(name):
    reference = run_distributed(_accumulated, 1, args=(None, 1, K * BATCH))[0]["state"]
    out = run_distributed(_accumulated, 4, args=(MESHES[name], K, BATCH), timeout_seconds=120)
    if "pipeline" in name:  # replica 0 is stage 0 on rank 0 and stage 1 on rank 2
        state = {**out[0]["state"], **out[2]["state"]}
    else:
        state = out[0]["state"]
    assert_params_close(reference, state, atol=1e-5, label=f"{name}: ")
    if "fsdp" in name:
        return  # FSDP reduce-scatters on its own groups: checked by equivalence only
    for rank, res in enumerate(out):
        counts = res["counts"]
        assert len(counts) == 3 * K
        synced = counts[K - 1]
        assert synced > 0, (rank, counts)
        assert counts == ([0] * (K - 1) + [synced]) * 3, (rank, counts)
