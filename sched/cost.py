"""Per-stage cost: FLOPs of forward and backward and parameter bytes, counted on the meta device.

The stage's module is instantiated from its config under ``torch.device("meta")`` (no memory, no
weights), its ``forward`` runs on meta inputs of the given shapes under
``torch.utils.flop_counter.FlopCounterMode``, and a backward from a unit gradient of its outputs
counts the backward FLOPs of trainable stages. A 14B-parameter configuration costs seconds and no
memory. (Activation memory needs the backend's attention behaviour and is issue 6's estimator.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModel, PretrainedConfig

from mmpipe.graph import Stage


@dataclasses.dataclass(frozen=True)
class StageCost:
    """What one forward (and backward, for trainable stages) of a stage costs for given shapes."""

    forward_flops: int
    backward_flops: int
    param_bytes: int
    output_bytes: int


def build_meta_module(stage: Stage) -> nn.Module:
    """The stage's module with meta tensors, built from its config (diffusers or transformers)."""
    source = getattr(stage, "source", None)
    model_cls = getattr(stage, "model_cls", None)
    if source is None or model_cls is None:
        raise ValueError(f"stage {stage.name!r} ({type(stage).__name__}) has no config-built module to cost")
    with torch.device("meta"):
        if isinstance(source.config, PretrainedConfig):
            return AutoModel.from_config(source.config) if model_cls is AutoModel else model_cls(source.config)
        return model_cls.from_config(dict(source.config))


def measure_stage_cost(
    stage: Stage, inputs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], **options: Any
) -> StageCost:
    """Count FLOPs of ``stage`` on inputs of the given ``(shape, dtype)``, all on the meta device."""
    module = build_meta_module(stage)
    if stage.frozen:
        module.requires_grad_(False)
    meta_inputs = {k: _meta_tensor(shape, dtype) for k, (shape, dtype) in inputs.items()}
    counter = FlopCounterMode(display=False)
    with counter, torch.set_grad_enabled(not stage.frozen):
        out = stage.forward(module, meta_inputs, **options)
        forward = counter.get_total_flops()
        tensors = [t for t in out.values() if isinstance(t, torch.Tensor)]
        if not stage.frozen:
            grads = [torch.ones_like(t) for t in tensors if t.requires_grad]
            torch.autograd.backward([t for t in tensors if t.requires_grad], grads)
    return StageCost(
        forward_flops=forward,
        backward_flops=counter.get_total_flops() - forward,
        param_bytes=sum(p.numel() * p.element_size() for p in module.parameters()),
        output_bytes=sum(t.numel() * t.element_size() for t in tensors),
    )


def _meta_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.empty(shape, dtype=dtype, device="meta")
    return torch.ones(shape, dtype=dtype, device="meta")
