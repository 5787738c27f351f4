"""Checkpoint storage in one process: pickle-free serialization, atomic commits, verification,
fallback to the previous checkpoint, full disks and refusal of pickle payloads."""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import subprocess
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from replicator.checkpoint import CheckpointManager, serialization
from replicator.checkpoint.atomic import hash_file
from replicator.checkpoint.manifest import MARKER_NAME, FileEntry, build, write_marker
from replicator.errors import (
    CheckpointCorruptError,
    CheckpointWriteError,
    UnsafeCheckpointError,
)
from replicator.testing import corrupt_latest_checkpoint


def _state(seed: int, size: int = 64) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(size, generator=g), "b": torch.randn(3, generator=g)}


def _save(manager: CheckpointManager, step: int, size: int = 64) -> None:
    manager.save(step, {"model": _state(step, size)}, {"rank_value": torch.tensor([step])},
                 {"step": step})


# -- serialization ---------------------------------------------------------------------------------
def test_optimizer_and_scheduler_state_round_trip_exactly():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    sched.step()
    state = {"opt": opt.state_dict(), "sched": sched.state_dict(), "nan": math.nan,
             "inf": -math.inf, "np": np.arange(4, dtype=np.uint32), "npf": np.float32(1.5),
             "dtype": torch.bfloat16, "tuple": (1, "a", None), "int_keys": {3: "x", 7: [1.25]},
             "tricky": {"__rp__": 1}}
    back = serialization.decode(serialization.encode(state))
    assert back["opt"]["param_groups"][0]["betas"] == (0.8, 0.9)
    assert set(back["opt"]["state"]) == {0, 1}
    for pid in (0, 1):
        for key, value in opt.state_dict()["state"][pid].items():
            assert torch.equal(back["opt"]["state"][pid][key], value)
    assert back["sched"] == sched.state_dict()
    assert math.isnan(back["nan"]) and back["inf"] == -math.inf
    assert back["np"].dtype == np.uint32 and back["np"].tolist() == [0, 1, 2, 3]
    assert back["npf"] == np.float32(1.5) and back["dtype"] is torch.bfloat16
    assert back["tuple"] == (1, "a", None) and back["int_keys"] == {3: "x", 7: [1.25]}
    assert back["tricky"] == {"__rp__": 1}


def test_tied_and_non_contiguous_tensors_are_stored():
    w = torch.randn(4, 6)
    state = {"a": w, "b": w, "t": w.t(), "part": w[1:3]}
    back = serialization.decode(serialization.encode(state))
    for key in state:
        assert torch.equal(back[key], state[key])


def test_objects_that_need_pickle_are_rejected_with_their_location():
    with pytest.raises(TypeError, match=r"optimizer\['state/0/fn'\].*never\s+pickles"):
        serialization.encode({"state": {"0": {"fn": object()}}}, "optimizer")


def test_model_file_is_a_plain_safetensors_file(tmp_path):
    from safetensors.torch import load

    model = torch.nn.Linear(3, 2)
    data = serialization.encode(model.state_dict(), "model")
    assert set(load(data)) == {"weight", "bias"}


# -- atomic commits and verification ---------------------------------------------------------------
def test_save_commits_atomically_and_keeps_the_newest(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (10, 20, 30):
        _save(manager, step)
    assert manager.committed_steps() == [20, 30]
    step_dir = tmp_path / "step-00000030"
    manifest = json.loads((step_dir / MARKER_NAME).read_text())
    assert set(manifest["files"]) == {"model.safetensors", "rank-00000.safetensors"}
    for name, entry in manifest["files"].items():
        assert hash_file(step_dir / name) == entry["sha256"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    restored = CheckpointManager(tmp_path).restore()
    assert restored.step == 30 and restored.info == {"step": 30}
    assert torch.equal(restored.replicated["model"]["w"], _state(30)["w"])
    assert torch.equal(restored.per_rank["rank_value"], torch.tensor([30]))


def test_no_checkpoint_is_a_fresh_start(tmp_path):
    assert CheckpointManager(tmp_path / "nothing").restore() is None


@pytest.mark.parametrize("mode", ["flip", "truncate", "delete"])
def test_damaged_latest_checkpoint_is_skipped_for_the_previous(tmp_path, mode):
    manager = CheckpointManager(tmp_path, keep=3)
    for step in (10, 20):
        _save(manager, step)
    damaged = corrupt_latest_checkpoint(tmp_path, mode)
    assert damaged.parent.name == "step-00000020"
    with pytest.warns(RuntimeWarning, match="skipping checkpoint step-00000020"):
        restored = CheckpointManager(tmp_path).restore()
    assert restored.step == 10
    assert torch.equal(restored.replicated["model"]["w"], _state(10)["w"])


def test_damaged_commit_marker_and_partial_directory_are_skipped(tmp_path):
    manager = CheckpointManager(tmp_path, keep=5)
    for step in (10, 20, 30):
        _save(manager, step)
    marker = tmp_path / "step-00000030" / MARKER_NAME
    marker.write_text(marker.read_text().replace('"step": 30', '"step": 31'))
    (tmp_path / "step-00000020" / MARKER_NAME).unlink()  # as if killed before the commit
    (tmp_path / ".tmp-step-00000040-a0").mkdir()
    with pytest.warns(RuntimeWarning) as record:
        restored = CheckpointManager(tmp_path).restore()
    text = " ".join(str(w.message) for w in record)
    assert "fails its own checksum" in text and "no commit marker" in text
    assert restored.step == 10
    assert not (tmp_path / ".tmp-step-00000040-a0").exists()  # old temporaries are cleaned
    # The next save at 20 replaces the partial directory; stale newer ones are removed.
    _save(CheckpointManager(tmp_path, keep=5), 20)
    assert CheckpointManager(tmp_path).committed_steps() == [10, 20]


def test_no_valid_checkpoint_is_a_clear_error(tmp_path):
    manager = CheckpointManager(tmp_path)
    _save(manager, 10)
    corrupt_latest_checkpoint(tmp_path, "truncate")
    with pytest.warns(RuntimeWarning), pytest.raises(CheckpointCorruptError,
                                                     match="no valid checkpoint.*HINT"):
        CheckpointManager(tmp_path).restore()


def test_state_that_cannot_be_stored_fails_the_save_and_commits_nothing(tmp_path):
    manager = CheckpointManager(tmp_path)
    with pytest.raises(TypeError, match="never"):
        manager.save(10, {"model": {"x": object()}})
    assert list(tmp_path.iterdir()) == []


# -- a full disk --------------------------------------------------------------------------------
@pytest.fixture
def small_tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)],
                              capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        pytest.skip("cannot mount a tmpfs here")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=10)


def test_save_onto_a_full_disk_raises_and_keeps_the_previous(small_tmpfs):
    manager = CheckpointManager(small_tmpfs, keep=2)
    _save(manager, 10, size=1000)  # ~4 KB: fits
    with pytest.raises(CheckpointWriteError, match="No space left.*step 10.*intact.*free space"):
        _save(manager, 20, size=1_000_000)  # ~4 MB onto 512 KB
    assert not (small_tmpfs / "step-00000020").exists()
    assert not [p for p in small_tmpfs.iterdir() if p.name.startswith(".tmp-")]
    restored = CheckpointManager(small_tmpfs).restore()
    assert restored.step == 10
    assert torch.equal(restored.replicated["model"]["w"], _state(10, 1000)["w"])


# -- pickle payloads are refused ------------------------------------------------------------
class _RunsCode:
    """Unpickling this creates a file: the side effect a malicious checkpoint would have."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _commit_foreign_file(tmp_path: Path, name: str, data: bytes) -> None:
    step_dir = tmp_path / "step-00000010"
    step_dir.mkdir(parents=True)
    (step_dir / name).write_bytes(data)
    entry = {"bytes": len(data), "sha256": hash_file(step_dir / name)}
    # Built by hand: build() itself refuses to list a non-safetensors file.
    body = {"format": "replicator.checkpoint", "version": 1, "step": 10, "world_size": 1,
            "created": 0.0, "files": {name: entry}, "info": {}}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    body["checksum"] = hashlib.sha256(canonical.encode()).hexdigest()
    write_marker(step_dir, body)


@pytest.mark.parametrize("name,writer", [
    ("model.pt", lambda obj, path: torch.save(obj, path)),
    ("model.safetensors", lambda obj, path: Path(path).write_bytes(pickle.dumps(obj))),
    ("model.safetensors", lambda obj, path: torch.save({"w": obj}, path)),
])
def test_checkpoint_with_a_pickle_payload_is_refused_unread(tmp_path, name, writer):
    marker = tmp_path / f"side-effect-{uuid.uuid4().hex}"
    payload = tmp_path / "payload"
    writer(_RunsCode(str(marker)), payload)
    _commit_foreign_file(tmp_path / "ckpt", name, payload.read_bytes())
    with pytest.raises(UnsafeCheckpointError, match="pickle"):
        CheckpointManager(tmp_path / "ckpt").restore()
    assert not marker.exists()
    assert (tmp_path / "ckpt" / "step-00000010" / name).exists()  # refused, not deleted


def test_marker_names_must_stay_inside_the_directory(tmp_path):
    with pytest.raises(CheckpointCorruptError, match="not allowed"):
        build(1, 1, {"../escape.safetensors": FileEntry(1, "0" * 64)}, {})
    assert os.sep not in "rank-00000.safetensors"


# -- the safetensors format ------------------------------------------------------------------------
def test_files_interoperate_with_the_safetensors_library(tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = {"f": torch.randn(3, 5), "h": torch.randn(7).bfloat16(), "b": torch.tensor(
        [True, False, True]), "u": torch.arange(5, dtype=torch.uint8), "e": torch.empty(0, 4),
        "s": torch.tensor(2.5, dtype=torch.float64)}
    size, digest = serialization.write_file(tmp_path / "ours.safetensors", tensors, {"k": "v"})
    assert size == (tmp_path / "ours.safetensors").stat().st_size
    assert digest == hash_file(tmp_path / "ours.safetensors")
    theirs = load_file(tmp_path / "ours.safetensors")
    save_file(tensors, tmp_path / "theirs.safetensors")
    ours, _ = serialization.read(bytearray((tmp_path / "theirs.safetensors").read_bytes()), "x")
    for key, value in tensors.items():
        assert torch.equal(theirs[key], value) and torch.equal(ours[key], value), key


def test_malformed_headers_are_corrupt_not_crashes():
    good = bytearray(serialization.to_bytes({"a": torch.ones(4)}, {}))
    header = json.loads(good[8:8 + int.from_bytes(good[:8], "little")])
    for entry in ({"dtype": "F32", "shape": [5], "data_offsets": [0, 16]},
                  {"dtype": "F32", "shape": [4], "data_offsets": [0, 10**9]},
                  {"dtype": "OBJ", "shape": [4], "data_offsets": [0, 16]},
                  {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}):
        header["a"] = entry
        raw = json.dumps(header).encode()
        data = bytearray(len(raw).to_bytes(8, "little") + raw + good[-16:])
        with pytest.raises(CheckpointCorruptError):
            serialization.read(data, "bad")


def test_leftovers_of_an_interrupted_deletion_are_removed_unread_and_said_once(tmp_path, capfd):
    # what a chief SIGKILLed while deleting an old backup leaves: its trash and a save's
    # staging directory; the next start removes them without reading them, and says so once
    manager = CheckpointManager(tmp_path, keep=1)
    manager.save(10, {"model": {"w": torch.ones(3)}})
    for name in (".trash-step-00000005-1a2b3c4d", ".tmp-step-00000015-a0"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"not a safetensors file")
    capfd.readouterr()
    restored = CheckpointManager(tmp_path).restore()
    assert restored is not None and restored.step == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000010"]
    err = capfd.readouterr().err
    assert err.count("[replicator] removed") == 1
    assert ".trash-step-00000005-1a2b3c4d" in err and ".tmp-step-00000015-a0" in err
    CheckpointManager(tmp_path).restore()
    assert "[replicator] removed" not in capfd.readouterr().err
