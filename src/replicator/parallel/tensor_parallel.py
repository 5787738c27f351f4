"""Tensor parallelism: each layer's weights split over a ``DeviceMesh`` (``parallelize_module``)
in Megatron's layout (docs/model_parallel.md). A plan maps module names (``fnmatch``) to
``"colwise"``, ``"rowwise"``, ``"embedding"`` or a ``ParallelStyle``.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

from replicator.errors import ReplicatorError

#: Names of attention projections: (query, key, value, output).
ATTENTION_NAMES = (("q", "k", "v", "o"), ("q_proj", "k_proj", "v_proj", "o_proj"),
                   ("q_proj", "k_proj", "v_proj", "out_proj"),
                   ("query", "key", "value", "out"), ("wq", "wk", "wv", "wo"))
#: Names of gated MLPs: (gate, up, down).
GATED_MLP_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
#: Attributes holding a head count, divided by the degree in parallelized attention blocks.
HEAD_COUNT_ATTRS = ("n_heads", "num_heads", "n_head", "n_local_heads")

STYLE_NAMES = ("colwise", "rowwise", "embedding")
#: Norms that run on a sequence shard (torch's ``SequenceParallel`` supports these).
NORM_TYPES: tuple[type[torch.nn.Module], ...] = (torch.nn.LayerNorm, torch.nn.RMSNorm)


class TensorPlanError(ReplicatorError, ValueError):
    """A tensor-parallel plan that names a module the model does not have, or a bad style."""


def style_for(value: Any, where: str) -> ParallelStyle:
    """``"colwise"`` / ``"rowwise"`` / ``"embedding"`` or a ``ParallelStyle`` -> the style."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

    if isinstance(value, ParallelStyle):
        return value
    if value == "colwise":
        return ColwiseParallel()
    if value == "rowwise":
        return RowwiseParallel()
    if value == "embedding":
        return RowwiseParallel(input_layouts=Replicate())
    raise TensorPlanError(f"tensor plan entry {where!r} has style {value!r}; use one of "
                          f"{', '.join(STYLE_NAMES)} or a torch ParallelStyle such as "
                          "ColwiseParallel(output_layouts=Replicate())")


def _divisible(n: int, degree: int) -> bool:
    return n % degree == 0 and n >= degree


def _linear_children(module: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {n: c for n, c in module.named_children() if isinstance(c, torch.nn.Linear)}


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _has_params(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _block_plan(module: torch.nn.Module, degree: int) -> dict[str, str]:
    """The styles of ``module``'s own ``Linear`` children (names relative to it) when it is an
    attention block, a gated MLP or an MLP whose split dimension divides by ``degree``."""
    linears = _linear_children(module)
    for q, k, v, o in ATTENTION_NAMES:
        if {q, k, v, o} <= linears.keys() and \
                all(_divisible(linears[n].out_features, degree) for n in (q, k, v)):
            return {q: "colwise", k: "colwise", v: "colwise", o: "rowwise"}
    for gate, up, down in GATED_MLP_NAMES:
        if {gate, up, down} <= linears.keys() and _divisible(linears[gate].out_features, degree):
            return {gate: "colwise", up: "colwise", down: "rowwise"}
    plan: dict[str, str] = {}
    if isinstance(module, torch.nn.Sequential):
        pending: tuple[str, torch.nn.Linear] | None = None
        for name, child in module.named_children():
            if isinstance(child, torch.nn.Linear):
                if pending is not None and pending[1].out_features == child.in_features \
                        and _divisible(child.in_features, degree):
                    plan.update({pending[0]: "colwise", name: "rowwise"})
                    pending = None
                else:
                    pending = (name, child)
            elif _has_params(child):
                pending = None  # something with weights between: not an MLP pair
    elif len(linears) == 2 and all(isinstance(c, torch.nn.Linear) or not _has_params(c)
                                   for c in module.children()):
        (a, first), (b, second) = linears.items()
        if first.out_features == second.in_features and _divisible(first.out_features, degree):
            plan.update({a: "colwise", b: "rowwise"})
    return plan


def default_plan(model: torch.nn.Module, degree: int) -> dict[str, str]:
    """The plan used when none is given: attention blocks, gated MLPs, MLPs (two ``Linear``
    children, or consecutive ones in an ``nn.Sequential``) and embeddings whose split dimension
    divides by ``degree`` (see :func:`_block_plan`); the rest stays replicated."""
    plan: dict[str, str] = {}
    for prefix, module in model.named_modules():
        plan.update({_join(prefix, n): style for n, style in _block_plan(module, degree).items()})
        if isinstance(module, torch.nn.Embedding) and _divisible(module.num_embeddings, degree):
            plan[prefix] = "embedding"
    return plan


def sequence_parallel_plan(model: torch.nn.Module, plan: Mapping[str, Any]) -> dict[str, Any]:
    """``plan`` (a default plan) with sequence-parallel norms in every module whose weighted
    children are norms and sub-blocks the plan splits (docs/model_parallel.md)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    out: dict[str, Any] = dict(plan)
    for prefix, block in model.named_modules():
        norms, subs, other = [], [], False
        for name, child in block.named_children():
            rowwise = [_join(_join(prefix, name), n) for n in _linear_children(child)
                       if plan.get(_join(_join(prefix, name), n)) == "rowwise"]
            if isinstance(child, NORM_TYPES):
                norms.append(_join(prefix, name))
            elif rowwise:
                subs.append((_join(prefix, name), rowwise))
            elif _has_params(child):
                other = True
        if not prefix or not norms or not subs or other or isinstance(block, torch.nn.Sequential):
            continue
        out[prefix] = PrepareModuleInputOutput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
            use_local_input=True, output_layouts=(Shard(1),),
            desired_output_layouts=(Replicate(),), use_local_output=True)
        for norm in norms:
            out[norm] = SequenceParallel(use_local_output=True)
        for sub, rowwise in subs:
            out[sub] = PrepareModuleInput(input_layouts=(Shard(1),),
                                          desired_input_layouts=(Replicate(),))
            for name in rowwise:
                out[name] = RowwiseParallel(output_layouts=Shard(1))
    return out


def _sequence_check(name: str, degree: int) -> Any:
    """A forward pre-hook: the block's input splits evenly along the sequence (dimension 1)."""
    def hook(module: torch.nn.Module, args: tuple) -> None:
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and (x.dim() < 2 or x.shape[1] % degree):
            raise ValueError(
                f"sequence-parallel block {name!r} got an input of shape {tuple(x.shape)}: its "
                f"sequence (dimension 1) must divide by the tensor-parallel degree {degree}. HINT: "
                f"pad the sequences to a multiple of {degree}, or leave sequence_parallel off.")
    return hook


def check_plan(model: torch.nn.Module, plan: Mapping[str, Any]) -> dict[str, ParallelStyle]:
    """Each entry as a style; a name matching no module is an error naming the closest ones."""
    names = [n for n, _ in model.named_modules() if n]
    out: dict[str, ParallelStyle] = {}
    for key, value in plan.items():
        if not isinstance(key, str):
            raise TensorPlanError(f"tensor plan keys are module names, got {key!r}")
        if not any(fnmatch.fnmatchcase(n, key) for n in names):
            close = difflib.get_close_matches(key, names, n=5, cutoff=0.5)
            hint = f" Close names: {', '.join(close)}." if close else ""
            raise TensorPlanError(
                f"tensor plan names module {key!r}, which {type(model).__name__} does not have."
                f"{hint} HINT: use names from model.named_modules() (patterns such as "
                "'layers.*.mlp.fc1' are allowed).")
        out[key] = style_for(value, key)
    return out


def validate_plan(plan: Mapping[str, Any] | None, sequence_parallel: bool = False) -> None:
    """Check a plan before any model exists (type, styles, ``sequence_parallel`` only with the
    default plan), so a bad one fails where the strategy is built rather than at scope exit."""
    if plan is None:
        return
    if not isinstance(plan, Mapping):
        raise TypeError(f"plan must be a dict of module name -> style, got "
                        f"{type(plan).__name__}")
    for key, value in plan.items():
        style_for(value, str(key))
    if sequence_parallel:
        raise TensorPlanError("sequence_parallel=True extends the default plan; with your own "
                              "plan, give the norms SequenceParallel() entries yourself")


def apply_tensor_parallel(model: torch.nn.Module, mesh: DeviceMesh,
                          plan: Mapping[str, Any] | None = None, *,
                          sequence_parallel: bool = False) -> torch.nn.Module:
    """Parallelize ``model`` over the 1-D ``mesh`` with ``plan`` (``None``: the default plan,
    with sequence-parallel norms when ``sequence_parallel``); head-count attributes of
    attention blocks the plan splits are divided by the degree."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInputOutput,
        parallelize_module,
    )

    degree = mesh.size()
    validate_plan(plan, sequence_parallel)
    chosen: dict[str, Any] = default_plan(model, degree) if plan is None else dict(plan)
    if sequence_parallel:
        chosen = sequence_parallel_plan(model, chosen)
    styles = check_plan(model, chosen)
    if not styles:
        return model
    parallelize_module(model, mesh, styles)
    for name, style in styles.items():
        if sequence_parallel and isinstance(style, PrepareModuleInputOutput):
            model.get_submodule(name).register_forward_pre_hook(
                _sequence_check(name, degree), prepend=True)
    for prefix, module in model.named_modules():
        linears = set(_linear_children(module))
        split = any(fnmatch.fnmatchcase(_join(prefix, n), key)
                    for n in linears for key in chosen
                    if chosen[key] == "colwise" or isinstance(chosen[key], ColwiseParallel))
        if not split or not any(set(names) <= linears for names in ATTENTION_NAMES):
            continue
        for attr in HEAD_COUNT_ATTRS:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(module, attr, value // degree)
    return model
