"""A parameter server's state in a checkpoint (values, optimizer state, versions, statistics,
claims, applied tasks), saved by the checkpoint manager under ``<directory>/ps-<index>``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from replicator.ps import protocol as P
from replicator.ps.server_updates import ServerUpdates, ShardState


class ServerCheckpoint(ServerUpdates):
    """The checkpoint side of :class:`~replicator.ps.server.ParameterServer` (its base)."""

    specs: dict[str, tuple[str, dict[str, Any]]]
    spec_text: str
    restored_step: int | None
    extra: dict[str, Any]
    checkpoint_dir: str | None

    def _set_optimizer(self, text: str) -> None:  # defined by the server
        raise NotImplementedError

    def _state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        tensors: dict[str, Any] = {}
        for sid, shard in self.shards.items():
            tensors[f"value_{sid}"] = shard.param.detach().clone()
            if shard.optimizer is not None:
                tensors[f"optimizer_state_{sid}"] = shard.optimizer.state_dict()
        info = {"versions": {str(s): sh.version for s, sh in self.shards.items()},
                "clock": self.clock, "histogram": list(self.histogram),
                "stale_sum": self.stale_sum, "stale_max": self.stale_max,
                "spec": self.spec_text, "claims": self.claims.state(),
                "specs": [t for t, _ in self.specs.values()], "tasks": self.tasks.state(),
                "sparse": sorted(sid for sid, sh in self.shards.items() if sh.sparse)}
        return tensors, info

    def _manager(self, directory: str) -> Any:
        from replicator.checkpoint.manager import CheckpointManager
        from replicator.comm.collectives import Collectives

        alone = Collectives(0, 1, torch.device("cpu"), self.timeout_seconds)  # a job of one
        return CheckpointManager(Path(directory) / f"ps-{self.index:03d}", keep=2,
                                 collectives=alone)

    def _save(self, step: int, extra: dict[str, Any]) -> str:
        directory = extra.get("directory") or self.checkpoint_dir
        if not directory:
            raise P.ParameterServerError("no checkpoint directory. HINT: pass "
                                         "checkpoint_dir= to ParameterServerStrategy")
        with self.lock:
            tensors, info = self._state()
            info["worker_data"] = extra.get("worker_data", {})
            path = self._manager(directory).save(step, replicated={"server": tensors},
                                                 info=info)
        return str(path)

    def _restore(self, directory: str) -> None:
        restored = self._manager(directory).restore()
        if restored is None:
            return
        tensors = restored.replicated.get("server", {})
        info = restored.info
        for key, value in tensors.items():
            if key.startswith("value_"):
                sid = int(key[len("value_"):])
                self.shards[sid] = ShardState(torch.nn.Parameter(value.clone()))
            else:
                self.extra[key] = value
        for sid, version in info.get("versions", {}).items():
            self.shards[int(sid)].version = int(version)
        for name in ("clock", "stale_sum", "stale_max"):
            setattr(self, name, int(info.get(name, 0)))
        self.histogram = list(info.get("histogram", self.histogram))
        self.extra["worker_data"] = info.get("worker_data", {})
        self.claims.load(info.get("claims", {}))
        self.tasks.load(info.get("tasks", []))
        for sid in info.get("sparse", []):
            self.shards[int(sid)].sparse = True
        for text in info.get("specs") or ([info["spec"]] if info.get("spec") else []):
            self._set_optimizer(text)
        self.restored_step = restored.step
