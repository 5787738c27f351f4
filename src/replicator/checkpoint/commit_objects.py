"""Commit objects in a store: how a save in a store without atomic rename becomes visible.

A save uploads its files under ``data/<save id>/`` and is committed by the object
``commits/<save id>.json`` written last (the manifest of ``manifest.py`` with the prefix).
``<save id>`` is ``step-00000030.<token>``. These helpers list, read and prune them; the
backups (``remote_manager.py``) and the sharded saves (``remote_shards.py``) share them.
"""

from __future__ import annotations

import hashlib
import re
import warnings
from typing import Any

from replicator.checkpoint.manifest import parse_marker
from replicator.checkpoint.store import RemoteStore
from replicator.errors import CheckpointCorruptError

COMMITS = "commits"
DATA = "data"
_COMMIT = re.compile(r"^step-(\d{8,})\.([A-Za-z0-9-]{1,80})\.json$")


def parse_commit_name(name: str) -> tuple[int, str] | None:
    """``(step, save id)`` of a commit object's name, ``None`` for anything else."""
    m = _COMMIT.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def hash_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def list_commits(store: RemoteStore) -> list[tuple[int, str]]:
    """``(step, commit object name)`` of every commit object, oldest first."""
    found = []
    for name, _ in store.objects(COMMITS):
        parsed = parse_commit_name(name)
        if parsed is not None:
            found.append((parsed[0], name))
    return sorted(found)


def read_commit(store: RemoteStore, name: str) -> dict[str, Any]:
    """The checked manifest of the commit object ``name``; :class:`CheckpointCorruptError`
    when it is gone, damaged or names no data prefix."""
    where = f"commit {store.url}/{COMMITS}/{name}"
    try:
        raw = store.get(f"{COMMITS}/{name}")
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{where} disappeared while reading it") from None
    manifest = parse_marker(raw, where)
    if not isinstance(manifest.get("prefix"), str) or not manifest["prefix"].startswith(
            f"{DATA}/"):
        raise CheckpointCorruptError(f"{where} names no data prefix")
    return manifest


def remove_upload(store: RemoteStore, prefix: str) -> None:
    """Delete an upload that will not be committed; a later save's pruning retries."""
    try:
        store.remove(prefix, recursive=True)
    except OSError:
        pass


def prune_commits(store: RemoteStore, step: int, newest: str, keep: int) -> None:
    """Keep the newest ``keep`` commits up to ``step``; delete older commits, then their
    data; delete uploads that never got a commit and commits newer than ``step``."""
    try:
        commits = list_commits(store)
        upto = [n for s, n in commits if s <= step]
        kept = set(upto[-keep:]) | {newest}
        for _, n in commits:
            if n not in kept:
                store.remove(f"{COMMITS}/{n}")
        kept_ids = {n.removesuffix(".json") for n in kept}
        for folder in store.folders(DATA):
            parsed = parse_commit_name(f"{folder}.json")
            # a newer step's folder is the next save, which other ranks may be uploading
            # already (this rank prunes after they were told of this commit)
            if folder not in kept_ids and (parsed is None or parsed[0] <= step):
                store.remove(f"{DATA}/{folder}", recursive=True)
    except OSError as exc:
        warnings.warn(f"could not remove old checkpoints in {store.url}: {exc}",
                      RuntimeWarning, stacklevel=3)


__all__ = ["COMMITS", "DATA", "hash_bytes", "list_commits", "parse_commit_name",
           "prune_commits", "read_commit", "remove_upload"]
