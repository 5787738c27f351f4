"""``replicator checkpoints list|verify|export``: on a local directory and on a real S3 server
(moto): steps, sizes and status, a damaged object named with its hash mismatch, a partial save
shown as such, and an exported model that loads with safetensors and equals the saved one."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from replicator.checkpoint import CheckpointManager
from replicator.cli import main
from tests.s3_server import s3_server  # noqa: F401 - a fixture


def _model(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"0.weight": torch.randn(4, 3, generator=g), "0.bias": torch.randn(4, generator=g)}


def _fill(location: str) -> CheckpointManager:
    manager = CheckpointManager(location, keep=3)
    for step in (10, 20, 30):
        manager.save(step, {"model": _model(step), "optimizer": {"lr": 0.1}},
                     {"rng": torch.tensor([step])}, {"step": step})
    return manager


def _flip(manager: CheckpointManager, location: str, step: int) -> str:
    if location.startswith("s3://"):
        name = [n for s, n in manager.commits() if s == step][0]  # type: ignore[attr-defined]
        prefix = json.loads(manager.store.get(f"commits/{name}"))["prefix"]  # type: ignore
        key = f"{prefix}/model.safetensors"
        raw = bytearray(manager.store.get(key))  # type: ignore[attr-defined]
        raw[-1] ^= 0xFF
        manager.store.put(key, bytes(raw))  # type: ignore[attr-defined]
        return key
    path = manager.directory / f"step-{step:08d}" / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    return "model.safetensors"


def _check(location: str, tmp_path, capsys) -> None:
    manager = _fill(location)
    manager.close()
    assert main(["checkpoints", "list", location]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["10", "20", "30"]
    assert out.count("committed") == 3 and out.count("B  committed") == 3
    assert main(["checkpoints", "verify", location]) == 0
    assert capsys.readouterr().out.count(" ok ") == 3
    damaged = _flip(manager, location, 30)
    assert main(["checkpoints", "verify", location]) == 1
    out = capsys.readouterr().out
    assert "step       30  FAILED" in out and damaged in out and "SHA-256" in out
    # export skips the damaged newest backup and writes step 20's model
    target = tmp_path / "model.safetensors"
    assert main(["checkpoints", "export", location, str(target)]) == 0
    assert "model of step 20" in capsys.readouterr().out
    exported = load_file(str(target))
    assert exported.keys() == _model(20).keys()
    for key, value in _model(20).items():
        assert torch.equal(exported[key], value)
    assert main(["checkpoints", "export", location, str(target), "--step", "10",
                 "--state", "scheduler"]) == 1
    assert "holds no 'scheduler' state" in capsys.readouterr().err


def test_checkpoints_command_on_a_local_directory(tmp_path, capsys):
    _check(str(tmp_path / "backups"), tmp_path, capsys)
    (tmp_path / "backups" / "step-00000040").mkdir()
    assert main(["checkpoints", "list", str(tmp_path / "backups")]) == 0
    assert "partial (no commit)" in capsys.readouterr().out


@pytest.mark.timeout(180)
def test_checkpoints_command_on_s3(s3_server, tmp_path, capsys):  # noqa: F811
    s3_server.make_bucket("cli")
    _check("s3://cli/run", tmp_path, capsys)
    manager = CheckpointManager("s3://cli/run")
    manager.store.put("data/step-00000040.ab12-0x9/rank-00000.safetensors", b"x")  # type: ignore
    assert main(["checkpoints", "list", "s3://cli/run", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["step"], r["status"]) for r in rows] == [
        (10, "committed"), (20, "committed"), (30, "committed"), (40, "partial (no commit)")]
    assert main(["checkpoints", "list", "foo://x"]) == 1
    assert "unknown URL scheme" in capsys.readouterr().err


def test_a_read_of_an_unknown_scheme_or_a_missing_location_says_so(tmp_path, capsys):
    assert main(["checkpoints", "list", "foo://x"]) == 1
    err = capsys.readouterr().err
    assert "unknown URL scheme 'foo'" in err and "cannot be opened" in err
    assert "written" not in err  # a read writes nothing: the message must not speak of it
    assert main(["checkpoints", "verify", str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and str(tmp_path / "nowhere") in err
