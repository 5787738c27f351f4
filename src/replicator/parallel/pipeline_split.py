"""Cutting a model into pipeline stages: contiguous runs of a chain of blocks (an
``nn.Sequential``, nested ones flattened), balanced by a cost per block or cut before named
blocks; :class:`TiedWeights` keeps weights tied across stages in step, Megatron's way
(docs/model_parallel.md, "Tied weights across stages").
"""

from __future__ import annotations

import difflib
import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from replicator.comm.groups import new_private_group
from replicator.errors import ReplicatorError


class PipelineSplitError(ReplicatorError, ValueError):
    """The model cannot be cut as asked (not a chain, too few blocks, unknown cut point)."""


class _TokenAndPositionEmbedding(torch.nn.Module):
    """GPT-2's input: token plus position embeddings, then dropout."""

    def __init__(self, wte: torch.nn.Module, wpe: torch.nn.Module, drop: torch.nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[-1], device=ids.device)
        return self.drop(self.wte(ids) + self.wpe(positions))


class _HiddenOnly(torch.nn.Module):
    """A transformer block on the hidden state alone, keeping only the hidden state it returns."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out


def known_chain(model: torch.nn.Module) -> tuple[torch.nn.Sequential, Any] | None:
    """A chain sharing ``model``'s modules and ``wrap(logits, loss=None)`` for its output, for a
    Hugging Face GPT-2 LM (blocks see no attention mask, as with sdpa); ``None`` otherwise."""
    body = getattr(model, "transformer", None)
    head = getattr(model, "lm_head", None)
    parts = ("wte", "wpe", "drop", "h", "ln_f")
    if body is None or head is None or not all(hasattr(body, p) for p in parts):
        return None
    chain = torch.nn.Sequential(_TokenAndPositionEmbedding(body.wte, body.wpe, body.drop),
                                *[_HiddenOnly(b) for b in body.h],
                                Stage([("ln_f", body.ln_f), ("lm_head", head)]))
    try:
        from transformers.modeling_outputs import (  # type: ignore[import-not-found, unused-ignore]
            CausalLMOutputWithCrossAttentions,
        )

        def wrap(logits: torch.Tensor | None, loss: torch.Tensor | None = None) -> Any:
            return CausalLMOutputWithCrossAttentions(loss=loss, logits=logits)
    except ImportError:  # pragma: no cover - a look-alike without transformers
        def wrap(logits: torch.Tensor | None, loss: torch.Tensor | None = None) -> Any:
            return logits if loss is None else loss
    return chain, wrap


def known_loss(model: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss a :func:`known_chain` model computes with ``labels=``: its ``loss_function``, or
    that rule written out (labels shifted by one, ``-100`` ignored, mean over counted tokens)."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    own = getattr(model, "loss_function", None)
    if callable(own) and vocab is not None:
        return functools.partial(own, vocab_size=vocab)

    def shifted_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        shifted = logits[..., :-1, :].float()
        return torch.nn.functional.cross_entropy(
            shifted.reshape(-1, shifted.shape[-1]),
            labels[..., 1:].reshape(-1).to(logits.device), ignore_index=-100)
    return shifted_cross_entropy


def flatten_chain(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The blocks of ``model`` in order, with their names in ``model`` (nested
    ``nn.Sequential`` flattened); an error with a hint for a model that is not a chain."""
    if not isinstance(model, torch.nn.Sequential):
        lists = [n for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)]
        where = f" (it holds block lists at {', '.join(lists[:3])})" if lists else ""
        raise PipelineSplitError(
            f"PipelineStrategy cannot cut a {type(model).__name__}{where}: its forward is "
            "arbitrary Python, so where one stage ends and the next begins is unknown (known "
            "layouts: nn.Sequential, Hugging Face GPT-2). HINT: build the model as an "
            "nn.Sequential of its parts, e.g. nn.Sequential(embedding, *blocks, head), where "
            "each part takes the previous part's output.")
    chain: list[tuple[str, torch.nn.Module]] = []

    def walk(prefix: str, seq: torch.nn.Sequential) -> None:
        for name, child in seq.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if isinstance(child, torch.nn.Sequential):
                walk(full, child)
            else:
                chain.append((full, child))

    walk("", model)
    if not chain:
        raise PipelineSplitError("PipelineStrategy got an empty nn.Sequential; there is "
                                 "nothing to cut into stages")
    return chain


def parameter_costs(chain: Sequence[tuple[str, torch.nn.Module]]) -> list[float]:
    """Each block's parameter count (at least 1: a block without parameters costs a little)."""
    return [float(sum(p.numel() for p in m.parameters())) or 1.0 for _, m in chain]


def balanced_starts(costs: Sequence[float], num_stages: int) -> list[int]:
    """Each stage's start so the costliest stage costs least (contiguous, one block or more)."""
    n = len(costs)
    prefix = list(itertools.accumulate(costs, initial=0.0))
    inf = float("inf")
    # best[s][i]: least max-stage cost of splitting blocks[:i] into s stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    starts, i = [], n
    for s in range(num_stages, 0, -1):
        i = cut[s][i]
        starts.append(i)
    return starts[::-1]


def named_starts(chain: Sequence[tuple[str, torch.nn.Module]], split_points: Sequence[str],
                 num_stages: int) -> list[int]:
    """Stage starts from cut points: each name is the first block of a new stage."""
    names = [n for n, _ in chain]
    if len(split_points) != num_stages - 1:
        raise PipelineSplitError(f"{num_stages} stages need {num_stages - 1} split point(s), got "
                                 f"{len(split_points)}: {list(split_points)}. HINT: name the "
                                 "first block of each stage after the first.")
    starts = [0]
    for point in split_points:
        if point not in names:
            close = difflib.get_close_matches(point, names, n=3, cutoff=0.4)
            hint = f" Close names: {', '.join(close)}." if close else ""
            raise PipelineSplitError(
                f"split point {point!r} is not a block of the model's chain.{hint} HINT: cut "
                f"points are names of the chain's blocks: {', '.join(names)}.")
        starts.append(names.index(point))
    if starts != sorted(set(starts)) or starts[1] == 0:
        raise PipelineSplitError(f"split points {list(split_points)} must name different "
                                 "blocks in model order, none of them the first block")
    return starts


def check_stage_count(chain: Sequence[tuple[str, torch.nn.Module]], num_stages: int) -> None:
    if num_stages > len(chain):
        raise PipelineSplitError(
            f"PipelineStrategy asked for {num_stages} stages but the model has only "
            f"{len(chain)} block(s) ({', '.join(n for n, _ in chain)}). HINT: use at most "
            f"{len(chain)} stages, or split the model into more nn.Sequential parts.")


class Stage(torch.nn.Module):
    """A contiguous run of the chain's blocks applied in order (the model's own, not copies)."""

    def __init__(self, blocks: Sequence[tuple[str, torch.nn.Module]]) -> None:
        super().__init__()
        self.block_names = [n for n, _ in blocks]
        self.blocks = torch.nn.ModuleList(m for _, m in blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build_stages(chain: Sequence[tuple[str, torch.nn.Module]], starts: Sequence[int]
                 ) -> list[Stage]:
    """One :class:`Stage` per start index; a parameter several stages use stays one parameter."""
    ends = [*starts[1:], len(chain)]
    return [Stage(chain[a:b]) for a, b in zip(starts, ends)]


def shared_parameters(stages: Sequence[Stage]) -> list[tuple[torch.nn.Parameter, list[int]]]:
    """Each parameter several stages use (tied weights), with the stages using it, by first use."""
    users: dict[torch.nn.Parameter, list[int]] = {}  # tensors hash by identity
    for i, stage in enumerate(stages):
        for p in stage.parameters():  # each once per stage
            users.setdefault(p, []).append(i)
    return [(p, used) for p, used in users.items() if len(used) > 1]


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
                 global_ranks: Sequence[int], me: int, names: dict[int, str]) -> None:
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
        """Make the holding ranks' groups (members only, in the same order on each) and give every
        copy the lowest holder's value; every pipeline rank calls it, in one guarded pass."""
        for tie in self.mine:
            tie.group = new_private_group(list(tie.ranks), "pipeline-tied", timeout_seconds)
            with torch.no_grad():
                for p in tie.params:
                    dist.broadcast(p.detach(), group=tie.group, group_src=0)

    def set_aside(self) -> list[list[torch.Tensor | None]]:
        """Take this rank's copies' gradients out before a run, so its gradient arrives alone."""
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
