"""``strategy.full_state_dict(model)`` under pipeline, tensor and FSDP loads into the
one-device model and equals one device's parameters; a pipeline rank's own state dict holds
placeholders that the library refuses to save and that ``torch.save`` warns about."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch.utils.data import DataLoader

import replicator as rp
from replicator.checkpoint import serialization
from replicator.checkpoint.serialization import Placeholder
from replicator.errors import CheckpointError
from replicator.testing import run_distributed
from replicator.train.callbacks import _atomic_save_weights
from tests.distributed.model_parallel_models import MODELS, loss_of, token_data, train


def _make(kind: str) -> rp.Strategy:
    return {"pipeline": lambda: rp.PipelineStrategy(num_stages=2, num_microbatches=4),
            "tensor": lambda: rp.TensorParallelStrategy(),
            "fsdp": lambda: rp.FSDPStrategy(),
            "mirrored": lambda: rp.MirroredStrategy()}[kind]()


def _saving_attempts(model: torch.nn.Module, tmp: str) -> dict:
    """What happens to this rank's own state dict on the ways to save it."""
    state = model.state_dict()
    out: dict = {"placeholders": sorted(k for k, v in state.items() if isinstance(v, Placeholder))}
    if not out["placeholders"]:
        return out
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.save({k: v.cpu() for k, v in state.items()}, io.BytesIO())
    out["torch_save"] = [str(w.message) for w in caught if "placeholder" in str(w.message)]
    for name, save in (("serialization", lambda: serialization.encode({"model": state})),
                       ("safetensors", lambda: serialization.to_bytes(state, {})),
                       ("ModelCheckpoint", lambda: _atomic_save_weights(state, tmp))):
        try:
            save()
            out[name] = "saved"
        except CheckpointError as exc:
            out[name] = str(exc)
    return out


def _train_and_gather(kind: str, tmp: str) -> dict:
    strategy = _make(kind)
    seen: dict = {}

    def inspect(model: torch.nn.Module) -> dict:
        seen["attempts"] = _saving_attempts(model, tmp)
        return strategy.full_state_dict(model)  # every rank calls it

    out = train(strategy, "transformer", "adam", inspect=inspect)
    return {"full": out["inspected"], "attempts": seen["attempts"],
            "is_chief": strategy.is_chief}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["pipeline", "tensor", "fsdp"])
def test_full_state_dict_loads_into_one_device_model(kind, tmp_path):
    reference = train(rp.OneDeviceStrategy("cpu"), "transformer", "adam")["state"]
    results = run_distributed(_train_and_gather, 2, args=(kind, str(tmp_path / "w.safetensors")))
    chief, other = results
    assert chief["is_chief"] and other["full"] == {}
    full = chief["full"]
    assert set(full) == set(reference)
    model = MODELS["transformer"]()
    model.load_state_dict(full, strict=True)  # shapes and keys of the one-device model
    for name, value in model.state_dict().items():
        assert value.device.type == "cpu" and type(full[name]) is torch.Tensor
        torch.testing.assert_close(value, reference[name], atol=1e-5, rtol=1e-5,
                                   msg=f"{kind} {name}")
    # a file written from the full state dict on the chief loads with weights_only
    buf = io.BytesIO()
    torch.save(full, buf)
    buf.seek(0)
    model.load_state_dict(torch.load(buf, weights_only=True))
    if kind == "pipeline":
        for attempts in (chief["attempts"], other["attempts"]):
            assert attempts["placeholders"], "each stage's rank frees the other's tensors"
            assert len(attempts["torch_save"]) == len(attempts["placeholders"])
            assert "full_state_dict" in attempts["torch_save"][0]
            for where in ("serialization", "safetensors", "ModelCheckpoint"):
                assert "placeholder" in attempts[where] and \
                    "strategy.full_state_dict(model)" in attempts[where], attempts[where]
    else:
        assert chief["attempts"] == {"placeholders": []}


def _mirrored(_: int) -> dict:
    strategy = rp.MirroredStrategy()
    with strategy.scope():
        model = MODELS["mlp"]()
    state = strategy.full_state_dict(model)
    return {k: v.clone() for k, v in state.items()}


@pytest.mark.timeout(120)
def test_replicated_model_gives_the_plain_state_dict_everywhere():
    a, b = run_distributed(_mirrored, 2, args=(0,))
    assert set(a) == set(MODELS["mlp"]().state_dict())
    for k in a:
        assert torch.equal(a[k], b[k])


def test_one_device_plain_state_dict():
    strategy = rp.OneDeviceStrategy("cpu")
    with strategy.scope():
        model = MODELS["mlp"]()
    state = strategy.full_state_dict(model)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    with pytest.raises(TypeError, match="nn.Module"):
        strategy.full_state_dict(state)  # type: ignore[arg-type]


def _fit_with_model_checkpoint(path: str) -> dict:
    strategy = rp.PipelineStrategy(num_stages=2, num_microbatches=4)
    trainer = rp.Trainer(strategy, MODELS["transformer"],
                         lambda params: torch.optim.SGD(params, lr=0.1),
                         lambda out, y: loss_of(out, y))
    trainer.fit(DataLoader(token_data(64), batch_size=16), epochs=1, verbose=0,
                callbacks=[rp.ModelCheckpoint(path, monitor="loss")])
    return strategy.full_state_dict(trainer.model)


@pytest.mark.timeout(240)
def test_model_checkpoint_saves_a_split_model_whole(tmp_path):
    from safetensors.torch import load_file

    path = str(tmp_path / "weights.safetensors")
    chief, other = run_distributed(_fit_with_model_checkpoint, 2, args=(path,))
    assert other == {}
    saved = load_file(path)
    model = MODELS["transformer"]()
    model.load_state_dict(saved, strict=True)
    for name, value in chief.items():
        torch.testing.assert_close(saved[name], value)
