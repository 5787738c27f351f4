"""``replicator checkpoints list|verify|export``: the command's arguments, apart from the
inspection itself (:mod:`replicator.checkpoint.inspection`), so the command line parses without
importing torch."""

from __future__ import annotations

from typing import Any


def add_subcommand(sub: Any) -> None:
    """Add ``checkpoints`` to the ``replicator`` command's subparsers."""
    p = sub.add_parser("checkpoints", help="list, verify or export the backups at a location",
                       description="Look into the backups of BackupAndRestore or "
                       "CheckpointManager at a local directory or an fsspec URL (s3://..., "
                       "gs://...): read-only. S3 credentials and endpoint come from AWS_* and "
                       "FSSPEC_S3_ENDPOINT_URL.")
    actions = p.add_subparsers(dest="checkpoints_action", required=True)
    ls = actions.add_parser("list", help="each backup's step, time, size and status")
    ls.add_argument("location")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    ver = actions.add_parser("verify", help="check every file's size and SHA-256")
    ver.add_argument("location")
    ver.add_argument("--step", type=int, default=None, help="only this step")
    exp = actions.add_parser("export", help="write one backup's model as a safetensors file")
    exp.add_argument("location")
    exp.add_argument("out", help="the safetensors file to write")
    exp.add_argument("--step", type=int, default=None,
                     help="the backup's step (default: the newest that verifies)")
    exp.add_argument("--state", default="model",
                     help="which tracked state to export (default: model)")
