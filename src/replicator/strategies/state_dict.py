"""``strategy.full_state_dict(model)``: the whole model's state, to save it as one file.

As Accelerate's ``get_state_dict``, one collective call under every strategy. An unsplit model:
every rank gets ``model.state_dict()`` detached (parameter servers' values pulled first). A
split model: the chief gets full CPU tensors with the one-device keys, others ``{}``. A pipeline
rank's own ``model.state_dict()`` holds a ``Placeholder`` for other ranks' tensors
(:func:`mark_stage_placeholders`), which the library's save paths refuse.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from replicator.checkpoint.serialization import placeholder
from replicator.parallel.pipeline import PipelineRunner


def plain_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` with detached tensors (no copy)."""
    return {k: v.detach() if isinstance(v, torch.Tensor) else v
            for k, v in model.state_dict().items()}


def gathered_state_dict(model: torch.nn.Module, keep: bool) -> dict[str, Any]:
    """Full tensors of a model whose parameters may be DTensors (tensor-parallel or FSDP
    shards): each DTensor's ``full_tensor()`` in turn (a collective over its mesh: every
    rank calls this), kept on the CPU where ``keep`` (the chief), dropped elsewhere."""
    out: dict[str, Any] = {}
    for key, value in model.state_dict().items():
        if isinstance(value, torch.Tensor):
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            if keep:
                out[key] = full.detach().to("cpu", copy=True)
            del full
        elif keep:
            out[key] = value
    return out


def pipeline_state_dict(runner: PipelineRunner, keep: bool) -> dict[str, Any]:
    """The pipeline's stages gathered on its first rank (every rank of the pipeline calls
    this), on the CPU where ``keep``."""
    state = runner.full_state_dict(dst=0)
    if not keep:
        return {}
    return {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
            for k, v in state.items()}


def mark_stage_placeholders(model: torch.nn.Module, runner: PipelineRunner) -> None:
    """Make this rank's ``model.state_dict()`` (also inside a parent's) hold a placeholder for
    every tensor of other ranks' stages; ``keep_vars=True`` keeps the tensors (for the gather)."""
    ref = weakref.ref(runner)

    def hook(module: torch.nn.Module, state: dict[str, Any], prefix: str,
             local_metadata: Any) -> None:
        pipeline = ref()
        if pipeline is None or not pipeline.stages:
            return  # cut at the first batch: nothing is freed yet
        held = {id(t) for m in pipeline.local_modules
                for t in [*m.parameters(), *m.buffers()]}
        for name, t in [*module.named_parameters(remove_duplicate=False),
                        *module.named_buffers(remove_duplicate=False)]:
            value = state.get(prefix + name)
            if (isinstance(value, torch.Tensor) and value is not t and id(t) not in held
                    and value.numel() == 0):
                state[prefix + name] = placeholder(value)

    model.register_state_dict_post_hook(hook)
