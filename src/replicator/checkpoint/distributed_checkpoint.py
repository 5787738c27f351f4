"""Sharded checkpoints of model-parallel runs through ``torch.distributed.checkpoint`` (DCP).

Each rank writes only the shards it holds (FSDP shards, tensor-parallel slices, its pipeline
stages), in safetensors files through DCP's ``HuggingFaceStorageWriter`` (no pickle: DCP's
default ``.metadata`` file is a pickle, which replicator refuses to load). Tensors are named
by the model's own parameter names (``get_state_dict``), so a checkpoint saved in one layout
loads into any other: data x pipeline into FSDP, tensor parallel into one device.

The commit is the checkpoint room's: every rank writes into ``.tmp-step-N-aK``, the ranks
agree that all writes succeeded, then the chief hashes every file, renames the directory to
``step-N`` and writes ``COMMIT.json`` (SHA-256 of each file) last. Loading verifies the
marker and every hash first and skips partial or damaged checkpoints. A URL (``s3://...``)
goes to ``remote_shards.py``: the same files, committed with commit objects in the store.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

from replicator.checkpoint import remote_shards
from replicator.checkpoint.atomic import fsync_dir, hash_file, remove_tree
from replicator.checkpoint.dcp_state import (
    GROUPS_FILE,
    Optimizers,
    StagedShards,
    as_list,
    flat_state,
    read_dcp,
    stage_sharded,
    write_dcp,
)
from replicator.checkpoint.exchange import Channel, describe_failures, group_collectives
from replicator.checkpoint.manifest import (
    MARKER_NAME,
    FileEntry,
    build,
    read_marker,
    verify,
    write_marker,
)
from replicator.checkpoint.store import RemoteStore, is_remote, local_path
from replicator.cluster.environment import resolve_cluster
from replicator.comm.collectives import Collectives
from replicator.errors import CheckpointCorruptError, CheckpointWriteError

_STEP_PREFIX = "step-"

#: A local folder, a URL, or an opened store (a URL with its fsspec options).
Location = str | os.PathLike[str] | RemoteStore


def _remote(directory: Location) -> bool:
    return isinstance(directory, RemoteStore) or is_remote(directory)


def _step_dir(step: int) -> str:
    return f"{_STEP_PREFIX}{step:08d}"


def save_sharded(directory: Location, step: int, model: torch.nn.Module,
                 optimizer: Optimizers = None, *, collectives: Collectives | None = None,
                 keep: int = 2) -> Path | str:
    """Save ``model`` (and ``optimizer``, or a list of them) at ``step`` under ``directory``;
    every rank of ``collectives`` (default: the whole job) calls it.

    The optimizers must already hold the model's (sharded) parameters: under a strategy use
    :func:`replicator.resume.save_sharded`, which lets the strategy prepare them first.
    ``directory`` may be a URL (see ``remote_shards.py``). Returns the committed ``step-N``
    directory (for a URL, its commit object's URL). Raises :class:`CheckpointWriteError` on every
    rank when any rank fails, leaving the previous checkpoints as they were.
    """
    optimizers = as_list(optimizer)
    ch = Channel(collectives if collectives is not None else group_collectives())
    try:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, optimizers)
        flat, groups = flat_state(msd, osd, bool(optimizers))
        staged: StagedShards | Exception = StagedShards(flat, groups, bool(optimizers))
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks in write_staged
        staged = exc
    return write_staged(directory, step, staged, ch, keep=keep)


def write_staged(directory: Location, step: int, staged: StagedShards | Exception,
                 ch: Channel, *, keep: int = 2) -> Path | str:
    """Write and commit ``staged`` (from :func:`stage_sharded`) as ``step``; every rank of
    ``ch`` calls it (on a background thread, ``ch`` runs over a private group)."""
    if _remote(directory):
        return remote_shards.write_staged(directory, step, staged, ch, keep=keep)
    root = local_path(directory)  # type: ignore[arg-type]
    attempt = resolve_cluster().restart_count
    tmp = root / f".tmp-{_step_dir(step)}-a{attempt}"
    final = root / _step_dir(step)
    error = ""
    try:
        if isinstance(staged, Exception):
            raise staged
        if ch.is_chief:
            tmp.mkdir(parents=True, exist_ok=True)
        ch.all_gather("", f"checkpoint save of step {step} (directory)")
        write_dcp(tmp, staged, ch)
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks below
        error = f"{type(exc).__name__}: {exc}"
    failures = ch.failures(error, f"checkpoint save of step {step} (writes)")
    if failures:
        if ch.is_chief:
            remove_tree(tmp)
        raise CheckpointWriteError(
            f"saving the sharded checkpoint of step {step} to {root} failed "
            f"({describe_failures(failures)}). Nothing was committed. HINT: check that every "
            f"rank can write to {root} and has space there.")
    commit_error = ""
    if ch.is_chief:
        try:
            files = {p.name: FileEntry(bytes=p.stat().st_size, sha256=hash_file(p))
                     for p in sorted(tmp.iterdir()) if p.is_file()}
            manifest = build(step, ch.world_size, files, {"layout": "dcp-safetensors"})
            fsync_dir(tmp)
            if final.exists():
                remove_tree(final)
            os.rename(tmp, final)
            fsync_dir(root)
            write_marker(final, manifest)
            _prune(root, keep)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            commit_error = f"{type(exc).__name__}: {exc}"
            remove_tree(tmp)
    outcome = ch.from_chief(commit_error, f"checkpoint save of step {step} (commit)")
    if outcome:
        raise CheckpointWriteError(f"committing the sharded checkpoint of step {step} in "
                                   f"{root} failed on the chief: {outcome}")
    return final


def _committed(root: Path) -> list[tuple[int, Path]]:
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return []
    found = []
    for p in entries:
        if p.name.startswith(_STEP_PREFIX) and p.name[len(_STEP_PREFIX):].isdigit() and \
                (p / MARKER_NAME).exists():
            found.append((int(p.name[len(_STEP_PREFIX):]), p))
    return sorted(found)


def _prune(root: Path, keep: int) -> None:
    for _, p in _committed(root)[:-keep]:
        remove_tree(p, wait=False)


def load_sharded(directory: Location, model: torch.nn.Module,
                 optimizer: Optimizers = None, *, step: int | None = None,
                 collectives: Collectives | None = None) -> int | None:
    """Load the newest verified checkpoint (or ``step``) into ``model`` (and ``optimizer``),
    whatever the layout it was saved in and the one it loads into; every rank of
    ``collectives`` (default: the whole job) calls it.

    The optimizers must already hold the model's (sharded) parameters (see
    :func:`save_sharded`). Returns the step loaded, or ``None`` when ``directory`` holds no
    checkpoint. Damaged or partial checkpoints are skipped with a warning;
    :class:`CheckpointCorruptError` when checkpoints exist but none verifies.
    """
    optimizers = as_list(optimizer)
    ch = Channel(collectives if collectives is not None else group_collectives())
    if _remote(directory):
        return remote_shards.load(directory, model, optimizers, step, ch)
    root = local_path(directory)  # type: ignore[arg-type]
    choice: dict[str, Any] = {"step": -1, "skipped": [], "error": ""}
    if ch.is_chief:
        candidates = [(s, p) for s, p in _committed(root) if step is None or s == step]
        for s, p in reversed(candidates):
            try:
                verify(p, read_marker(p))
                choice["step"] = s
                break
            except CheckpointCorruptError as exc:
                choice["skipped"].append(str(exc))
        if choice["step"] < 0 and (candidates or step is not None):
            choice["error"] = ("; ".join(choice["skipped"]) or
                               f"no committed checkpoint of step {step} in {root}")
    choice = ch.from_chief(choice, "sharded checkpoint restore (choice)")
    for text in choice["skipped"]:
        warnings.warn(f"skipping a damaged checkpoint: {text}", RuntimeWarning, stacklevel=2)
    if choice["error"]:
        raise CheckpointCorruptError(f"no valid sharded checkpoint to load in {root}: "
                                     f"{choice['error']}. HINT: delete the damaged step "
                                     "directories, or load an older step=.")
    if choice["step"] < 0:
        return None
    read_dcp(root / _step_dir(choice["step"]), model, optimizers, ch)
    return int(choice["step"])


def discard_uncommitted(directory: Location, after: int | None = None) -> None:
    """Remove interrupted saves (``.tmp-*``, ``.trash-*``) and, with ``after``, every step
    newer than ``after`` (a run resumed from ``after`` writes them again). The chief calls it
    while no save is running."""
    if _remote(directory):
        remote_shards.discard_uncommitted(directory, after)
        return
    root = Path(directory)  # type: ignore[arg-type]
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return
    for p in entries:
        name = p.name
        newer = (after is not None and name.startswith(_STEP_PREFIX)
                 and name[len(_STEP_PREFIX):].isdigit() and int(name[len(_STEP_PREFIX):]) > after)
        if name.startswith((".tmp-", ".trash-")) or newer:
            remove_tree(p)


__all__ = ["GROUPS_FILE", "Location", "Optimizers", "StagedShards", "discard_uncommitted",
           "load_sharded", "save_sharded", "stage_sharded", "write_staged"]
