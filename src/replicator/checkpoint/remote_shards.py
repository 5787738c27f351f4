"""Sharded (DCP) checkpoints at an fsspec URL, committed with commit objects.

Layout under the URL (a backup's ``sharded/`` folder, or any URL given to ``save_sharded``)::

    data/step-00000030.3f2a9c01d2e4/          every rank's safetensors shards and DCP's index
                                              (and the optimizers' param groups)
    commits/step-00000030.3f2a9c01d2e4.json   the manifest (SHA-256 and size of each), last

DCP's Hugging Face writer writes local files only, so each rank writes its shards into a
scratch folder of its own (the system's temporary directory), uploads them under the save's
prefix, hashing as it goes, and deletes the folder. The ranks agree that every upload
succeeded; the chief checks the listing, writes the commit object and prunes as the backups do
(``commit_objects.py``). A load lists the commits, and every rank downloads the chosen save's
files into a scratch folder and verifies each hash before DCP reads them (any layout loads
into any other, so a rank may need any shard: each rank reads the whole checkpoint once). A
partial or damaged save is skipped with the object's name, and the next older one is tried.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch

from replicator.checkpoint.commit_objects import (
    COMMITS,
    DATA,
    hash_bytes,
    list_commits,
    parse_commit_name,
    prune_commits,
    read_commit,
    remove_upload,
)
from replicator.checkpoint.dcp_state import StagedShards, read_dcp, write_dcp
from replicator.checkpoint.exchange import Channel, describe_failures
from replicator.checkpoint.manifest import FileEntry, build, check_bytes, check_file_name
from replicator.checkpoint.store import RemoteStore
from replicator.errors import CheckpointCorruptError, CheckpointWriteError

_SCRATCH_PREFIX = "replicator-shards-"


def _store(location: Any) -> RemoteStore:
    if isinstance(location, RemoteStore):
        return location
    return RemoteStore(str(location), what="the sharded checkpoint location")


def _scratch() -> Path:
    return Path(tempfile.mkdtemp(prefix=_SCRATCH_PREFIX))


def write_staged(location: Any, step: int, staged: StagedShards | Exception, ch: Channel, *,
                 keep: int = 2) -> str:
    """Write, upload and commit ``staged`` as ``step``; every rank of ``ch`` calls it. Returns
    the commit object's URL; :class:`CheckpointWriteError` on every rank when a rank failed
    (nothing committed, the previous saves intact)."""
    store = _store(location)
    token = ch.from_chief(uuid.uuid4().hex[:12] if ch.is_chief else None,
                          f"sharded save of step {step} (its name)")
    name = f"step-{step:08d}.{token}"
    prefix = f"{DATA}/{name}"
    files: dict[str, dict[str, Any]] = {}
    error = ""
    scratch = _scratch()
    try:
        if isinstance(staged, Exception):
            raise staged
        write_dcp(scratch, staged, ch)
        for path in sorted(scratch.iterdir()):
            if path.is_file():
                data = path.read_bytes()
                store.put(f"{prefix}/{path.name}", data)
                files[path.name] = FileEntry(bytes=len(data), sha256=hash_bytes(data)).as_json()
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks below
        error = f"{type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    gathered = ch.all_gather({"error": error, "files": files},
                             f"sharded save of step {step} (uploads)")
    failures = {r: g["error"] for r, g in enumerate(gathered) if g["error"]}
    if failures:
        if ch.is_chief:
            remove_upload(store, prefix)
        raise CheckpointWriteError(
            f"saving the sharded checkpoint of step {step} to {store.url} failed "
            f"({describe_failures(failures)}). Nothing was committed. HINT: check that the "
            f"store is reachable and that every rank can write to {store.url}.")
    commit_error = ""
    if ch.is_chief:
        try:
            _commit(store, step, name, gathered, ch.world_size)
            prune_commits(store, step, f"{name}.json", keep)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            commit_error = f"{type(exc).__name__}: {exc}"
            remove_upload(store, prefix)
    outcome = ch.from_chief(commit_error, f"sharded save of step {step} (commit)")
    if outcome:
        raise CheckpointWriteError(f"committing the sharded checkpoint of step {step} in "
                                   f"{store.url} failed on the chief: {outcome}")
    return store.name_url(f"{COMMITS}/{name}.json")


def _commit(store: RemoteStore, step: int, name: str, gathered: list[dict[str, Any]],
            world_size: int) -> None:
    """Check that every rank's files are in the store, then write the commit object."""
    prefix = f"{DATA}/{name}"
    entries: dict[str, FileEntry] = {}
    for rank, report in enumerate(gathered):
        for fname, entry in report["files"].items():
            if fname in entries:
                raise CheckpointWriteError(f"two ranks wrote the file {fname!r} (rank {rank} "
                                           "and an earlier one)")
            entries[fname] = FileEntry(bytes=int(entry["bytes"]), sha256=str(entry["sha256"]))
    listed = dict(store.objects(prefix))
    for fname, fentry in entries.items():
        if listed.get(fname) != fentry.bytes:
            raise OSError(f"{store.name_url(prefix)}/{fname} is "
                          f"{'missing' if fname not in listed else 'the wrong size'} in the "
                          "store after its upload")
    manifest = build(step, world_size, entries, {"layout": "dcp-safetensors"}, prefix=prefix)
    store.put(f"{COMMITS}/{name}.json",
              json.dumps(manifest, indent=1, sort_keys=True, allow_nan=True).encode())


def _download(store: RemoteStore, name: str, into: Path) -> None:
    """Every file of the commit ``name`` into ``into``, each checked against its hash."""
    manifest = read_commit(store, name)
    where = f"commit {store.url}/{COMMITS}/{name}"
    for fname, entry in manifest["files"].items():
        check_file_name(fname, where)
        url = f"{store.name_url(manifest['prefix'])}/{fname}"
        try:
            data = store.get(f"{manifest['prefix']}/{fname}")
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{where}: object {url} is missing") from None
        check_bytes(where, f"object {url}", entry, len(data), hash_bytes(data))
        (into / fname).write_bytes(data)


def load(location: Any, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
         step: int | None, ch: Channel) -> int | None:
    """Load the newest verified sharded save (or the one of ``step``) into ``model`` and
    ``optimizers``; every rank of ``ch`` calls it. ``None`` when the store holds none."""
    store = _store(location)
    listed = ch.from_chief([[s, n] for s, n in list_commits(store)
                            if step is None or s == step] if ch.is_chief else None,
                           "sharded checkpoint restore (listing)")
    if not listed and step is None:
        return None
    skipped: list[str] = []
    for saved_step, name in reversed(listed):
        scratch = _scratch()
        try:
            error = ""
            try:
                _download(store, name, scratch)
            except CheckpointCorruptError as exc:
                error = str(exc)
            errors = [e for e in ch.all_gather(error, "sharded checkpoint restore (verify)")
                      if e]
            if errors:
                skipped.append(errors[0])
                continue
            for text in skipped:
                warnings.warn(f"skipping a damaged checkpoint: {text}", RuntimeWarning,
                              stacklevel=3)
            read_dcp(scratch, model, optimizers, ch)
            return int(saved_step)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    raise CheckpointCorruptError(
        f"no valid sharded checkpoint to load in {store.url}: "
        f"{'; '.join(skipped) or f'no committed checkpoint of step {step}'}. HINT: delete the "
        "damaged commit objects, or load an older step=.")


def discard_uncommitted(location: Any, after: int | None = None) -> None:
    """Delete uploads that never got a commit and, with ``after``, every save newer than
    ``after`` (a run resumed from ``after`` writes them again). The chief calls it while no
    save is running."""
    store = _store(location)
    try:
        commits = list_commits(store)
        for saved_step, name in commits:
            if after is not None and saved_step > after:
                store.remove(f"{COMMITS}/{name}")
        kept = {name.removesuffix(".json") for s, name in commits
                if after is None or s <= after}
        for folder in store.folders(DATA):
            if folder not in kept and parse_commit_name(f"{folder}.json") is not None:
                store.remove(f"{DATA}/{folder}", recursive=True)
    except OSError as exc:
        warnings.warn(f"could not remove interrupted sharded saves in {store.url}: {exc}",
                      RuntimeWarning, stacklevel=2)


__all__ = ["discard_uncommitted", "load", "write_staged"]
