"""The launch room: the parent side of a job.

Spawning local worker processes, relaying their output, the restart policy and the failure
summary, multi-node launching through torchrun's elastic agent, replica groups and their
lighthouse, and the roles a job starts beside its workers. Worker-side code never imports this
room (the import contract puts it above every room a worker runs).
"""

from replicator.launch.function_launch import launch
from replicator.launch.script_launch import run_script

__all__ = ["launch", "run_script"]
