"""The launch room: the parent side of a job (workers, their output, restarts, the failure
summary, multi-node, replica groups); no room a worker runs imports it."""

from replicator.launch.script_launch import launch, run_script

__all__ = ["launch", "run_script"]
