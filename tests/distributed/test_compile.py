"""torch.compile under Mirrored and CentralStorage (2 gloo processes): the same parameters as
eager, and no recompile per step (graphs counted by a counting backend)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import replicator as rp
from replicator.testing import assert_params_close, run_distributed
from tests.helpers import make_mlp

STEPS = 8
WARMUP = 3


def _counting_backend(counter: list[int]):
    """aot_eager (forward and backward graphs, no C++ build) that counts dynamo graphs."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    inner = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                         bw_compiler=lambda gm, _: make_boxed_func(gm.forward))

    def backend(gm, example_inputs):
        counter[0] += 1
        return inner(gm, example_inputs)

    return backend


def train_compiled(strategy_name: str, how: str, backend: str = "counting") -> dict:
    """``how``: "eager", "model" (torch.compile(model)) or "step" (torch.compile(step_fn))."""
    torch._dynamo.reset()
    strategy = rp.MirroredStrategy() if strategy_name == "mirrored" \
        else rp.CentralStorageStrategy()
    with strategy.scope():
        model = make_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    graphs = [0]
    chosen = _counting_backend(graphs) if backend == "counting" else backend
    forward = torch.compile(model, backend=chosen) if how == "model" else model

    def step_fn(x, y):
        loss = F.cross_entropy(forward(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    step = torch.compile(step_fn, backend=chosen) if how == "step" else step_fn
    g = torch.Generator().manual_seed(strategy.replica_id)
    after_warmup = None
    for i in range(STEPS):
        x, y = torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g)
        strategy.run(step, args=(x, y))
        if i == WARMUP - 1:
            after_warmup = (graphs[0], torch._dynamo.utils.counters["stats"]["unique_graphs"])
    final = (graphs[0], torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "after_warmup": after_warmup, "final": final}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy_name", ["mirrored", "central_storage"])
def test_compiled_model_and_step_equal_eager_without_recompiles(strategy_name):
    eager = run_distributed(train_compiled, world_size=2, args=(strategy_name, "eager"))
    for how in ("model", "step"):
        out = run_distributed(train_compiled, world_size=2, args=(strategy_name, how),
                              timeout_seconds=120)
        for rank in (0, 1):
            assert_params_close(eager[0]["state"], out[rank]["state"], atol=1e-5)
            compiled_graphs = out[rank]["final"][0]
            assert compiled_graphs >= 1, f"{how}: nothing was compiled"
            # every graph was built in the first steps: the gradient hooks cause no recompile
            assert out[rank]["after_warmup"] == out[rank]["final"], (how, out[rank])
        if how == "model":
            assert out[0]["final"][0] == 1, out[0]  # one graph: forward (+ its backward)


@pytest.mark.timeout(900)
def test_inductor_compiled_model_under_mirrored_equals_eager():
    """The default backend (C++ code generated and built by inductor): slow to build."""
    eager = run_distributed(train_compiled, world_size=2, args=("mirrored", "eager"))
    out = run_distributed(train_compiled, world_size=2, args=("mirrored", "model", "inductor"),
                          timeout_seconds=600)
    for rank in (0, 1):
        assert_params_close(eager[0]["state"], out[rank]["state"], atol=1e-5)
        assert out[rank]["after_warmup"][1] == out[rank]["final"][1] >= 1, out[rank]
