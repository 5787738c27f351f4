"""Tied weights across pipeline stages (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``).

As in Megatron each holding rank keeps a copy: copies start equal (a broadcast from the lowest
holder) and stay equal because after every schedule run each copy's gradient becomes the sum of
all copies' over a private group of the holders. Only that run's gradient is summed, so
gradients accumulated under ``no_sync`` are summed once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from replicator.comm.groups import new_private_group
from replicator.parallel.pipeline_split import Stage, shared_parameters


@dataclass
class Tie:
    """Parameters held by the same ranks of the pipeline (global ranks, lowest first)."""

    ranks: tuple[int, ...]
    names: list[str] = field(default_factory=list)
    params: list[torch.nn.Parameter] = field(default_factory=list)
    stages: list[list[int]] = field(default_factory=list)
    group: dist.ProcessGroup | None = None  # made by connect(), on members only


class TiedWeights:
    """The parameters that stages on different ranks share, and how to keep them in step
    (``owners``: each stage's pipeline rank; ``global_ranks``: each pipeline rank's global rank;
    ``me``: this process's; ``names``: parameter names by identity, for messages).
    """

    def __init__(self, stages: Sequence[Stage], owners: Sequence[int],
                 global_ranks: Sequence[int], me: int,
                 names: dict[int, str]) -> None:
        by_ranks: dict[tuple[int, ...], Tie] = {}
        for param, used_by in shared_parameters(stages):
            holders = tuple(sorted({global_ranks[owners[s]] for s in used_by}))
            if len(holders) < 2:
                continue  # one rank runs every stage that uses it: one tensor, nothing to sum
            tie = by_ranks.setdefault(holders, Tie(holders))
            tie.names.append(names.get(id(param), f"a parameter of shape {tuple(param.shape)}"))
            tie.params.append(param)
            tie.stages.append(list(used_by))
        #: every tie of the pipeline (the same list on all its ranks), in a fixed order
        self.ties = [by_ranks[k] for k in sorted(by_ranks)]
        self.global_rank = global_ranks[me]
        #: the ties this rank holds a copy of
        self.mine = [t for t in self.ties if self.global_rank in t.ranks]

    def __bool__(self) -> bool:
        """True when some parameter is shared by stages on different ranks."""
        return bool(self.ties)

    def describe(self) -> str:
        """``"lm_head.weight (stages 0 and 3)"`` for each tied parameter, ``"; "``-joined."""
        return "; ".join(f"{name} (stages {' and '.join(map(str, stages))})"
                         for tie in self.ties for name, stages in zip(tie.names, tie.stages))

    def what(self, doing: str) -> str:
        """A pass's name for errors: what this rank did, with which ranks."""
        peers = sorted({r for t in self.mine for r in t.ranks} - {self.global_rank})
        held = ", ".join(n for t in self.mine for n in t.names) or "none"
        with_ranks = f" with rank {', '.join(map(str, peers))}" if peers else ""
        return (f"pipeline {doing} of tied weights on rank {self.global_rank}{with_ranks} "
                f"(held here: {held})")

    def connect(self, timeout_seconds: float) -> None:
        """Make the groups of the holding ranks (members only, in the same order on each)
        and give every copy the lowest holding rank's value. Every rank of the pipeline calls
        it, inside one guarded pass."""
        for tie in self.mine:
            tie.group = new_private_group(list(tie.ranks), "pipeline-tied", timeout_seconds)
            with torch.no_grad():
                for p in tie.params:
                    dist.broadcast(p.detach(), group=tie.group, group_src=0)

    def set_aside(self) -> list[list[torch.Tensor | None]]:
        """Take this rank's copies' gradients out before a run of the schedule, so the run's
        gradient arrives alone (see the module doc)."""
        kept = [[p.grad for p in tie.params] for tie in self.mine]
        self.put_back([[None] * len(tie.params) for tie in self.mine])
        return kept

    def sum_gradients(self, kept: list[list[torch.Tensor | None]]) -> None:
        """Sum the run's gradient of each tied parameter over its holding ranks and add it to
        what :meth:`set_aside` took out (its tensor kept, in place)."""
        for tie, before in zip(self.mine, kept):
            assert tie.group is not None, "connect() makes the groups when the pipeline is cut"
            for p, old in zip(tie.params, before):
                if not p.requires_grad:  # frozen (on every holder): nothing to sum
                    p.grad = old
                    continue
                new = p.grad if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(new, group=tie.group)
                p.grad = new if old is None else old.add_(new)

    def put_back(self, kept: list[list[torch.Tensor | None]]) -> None:
        """Undo :meth:`set_aside` after a failed run (the run's partial gradient dropped)."""
        for tie, before in zip(self.mine, kept):
            for p, old in zip(tie.params, before):
                p.grad = old
