"""The denoising loop as a stage: a DiT plus a diffusers scheduler, with classifier-free guidance.

It reproduces ``WanPipeline.__call__``'s loop step for step (same scheduler calls, same guidance
formula, conditional and unconditional passes as separate forward calls), so a graph built by
``mmpipe.from_diffusers`` returns the pipeline's frames. The pieces of one denoising step (the
initial noise, the request's scheduler, whether guidance is on and its formula) are functions here,
used by this stage and by the serving engine's step-level batching (``mmpipe.serve.engine``) alike.

Legend: B batch, Z latent channels, t/h/w latent frames/height/width, L text tokens, D text dim.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from diffusers import WanTransformer3DModel
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from torch import nn
from tqdm.auto import tqdm

from mmpipe.graph import Capabilities, TensorSpec
from mmpipe.stages._source import ModuleSource, SourcedStage


def guidance_on(guidance_scale: float) -> bool:
    """Whether ``guidance_scale`` turns classifier-free guidance on (``WanPipeline``: above 1): a
    negative prompt is encoded and each step runs the DiT on it too."""
    return guidance_scale > 1.0


def guide(pred: torch.Tensor, pred_uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """The guided prediction, ``WanPipeline``'s formula."""
    return pred_uncond + guidance_scale * (pred - pred_uncond)


def initial_noise(shape: tuple[int, ...], seed: int | None) -> torch.Tensor:
    """The initial latents: float32 noise drawn on the CPU by one generator seeded with ``seed``
    (fresh entropy for ``None``), as ``WanPipeline``'s ``randn_tensor`` draws it with a CPU generator;
    the same seed gives the same noise whatever device then denoises it."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return torch.randn(shape, generator=generator, dtype=torch.float32, device="cpu")


class DenoiseStage(SourcedStage):
    """``latents (noise), context[, negative_context] -> latents`` over ``num_inference_steps``."""

    kind = "denoise"
    model_cls = WanTransformer3DModel
    capabilities = Capabilities(sequence_parallel=True, fsdp=True, offload=True)

    def __init__(self, name: str, source: ModuleSource, scheduler: SchedulerMixin) -> None:
        super().__init__(name, source, frozen=True)
        self.scheduler = scheduler

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        cfg = self.source.config
        return {
            "latents": TensorSpec(("B", cfg.out_channels, "t", "h", "w"), torch.float32),
            "context": TensorSpec(("B", "L", cfg.text_dim)),
            "negative_context": TensorSpec(("B", "L", cfg.text_dim), required=False),
        }

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        return {"latents": TensorSpec(("B", self.source.config.out_channels, "t", "h", "w"), torch.float32)}

    def scheduler_for(self, num_inference_steps: int, device: torch.device) -> Any:
        """A private copy of the scheduler set for ``num_inference_steps`` steps: schedulers are
        stateful (step index, multistep history), and one stage serves many requests."""
        scheduler: Any = copy.deepcopy(self.scheduler)
        scheduler.set_timesteps(num_inference_steps, device=device)
        scheduler.set_begin_index(0)
        return scheduler

    def forward(
        self,
        module: nn.Module,
        inputs: Mapping[str, Any],
        *,
        num_inference_steps: int = 50,
        guidance_scale: float = 5.0,
        progress: bool = False,
        **_: Any,
    ) -> dict[str, Any]:
        if num_inference_steps <= 0:
            raise ValueError(f"num_inference_steps must be positive, got {num_inference_steps}")
        cfg_on = guidance_on(guidance_scale)
        if cfg_on and "negative_context" not in inputs:
            raise ValueError(f"stage {self.name!r}: guidance_scale={guidance_scale} needs a negative_context")
        dtype = module.dtype
        cond_BLD = inputs["context"].to(dtype)
        uncond_BLD = inputs["negative_context"].to(dtype) if cfg_on else None
        latents = inputs["latents"].float()
        scheduler = self.scheduler_for(num_inference_steps, latents.device)
        for t in tqdm(scheduler.timesteps, desc=self.name, disable=not progress, leave=False):
            x = latents.to(dtype)
            timestep_B = t.expand(latents.shape[0])
            pred = module(hidden_states=x, timestep=timestep_B, encoder_hidden_states=cond_BLD, return_dict=False)[0]
            if uncond_BLD is not None:
                pred_u = module(
                    hidden_states=x, timestep=timestep_B, encoder_hidden_states=uncond_BLD, return_dict=False
                )[0]
                pred = guide(pred, pred_u, guidance_scale)
            latents = scheduler.step(pred, t, latents, return_dict=False)[0]
        return {"latents": latents}
