"""The denoising loop as a stage: a DiT plus a diffusers scheduler, with classifier-free guidance.

It reproduces ``WanPipeline.__call__``'s loop step for step (same scheduler calls, same guidance
formula, conditional and unconditional passes as separate forward calls), so a graph built by
``mmpipe.from_diffusers`` returns the pipeline's frames. The pieces of one denoising step (the
initial noise, the request's scheduler, whether guidance is on and its formula) are functions here,
used by this stage and by the serving engine's step-level batching (``mmpipe.serve.engine``) alike.

Legend: B batch, Z latent channels, t/h/w latent frames/height/width, L text tokens, D text dim.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from diffusers import WanTransformer3DModel
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from torch import nn
from tqdm.auto import tqdm

from mmpipe.graph import Capabilities, TensorSpec
from mmpipe.parallel.denoise import COND, UNCOND, DenoiseGroup, DenoiseLayout
from mmpipe.parallel.sequence import check_heads
from mmpipe.stages._source import ModuleSource, SourcedStage
from mmpipe.stages.cache import StepCache
from mmpipe.stages.dit import wan_sequence_hooks


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


def cache_context(model: nn.Module, branch: str) -> contextlib.AbstractContextManager[Any]:
    """``model.cache_context(branch)`` where the model has one (diffusers' step caches keep one state
    per guidance branch, and the pipelines call each branch in its context), else nothing."""
    context = getattr(model, "cache_context", None)
    return context(branch) if context is not None else contextlib.nullcontext()


def step_predictions(
    model: nn.Module,
    predict: Callable[[str], torch.Tensor],
    *,
    guided: bool,
    group: DenoiseGroup | None = None,
    frames: int = 0,
    tokens_per_frame: Callable[[], int] = lambda: 0,
    batched: Callable[[], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """One denoising step's noise predictions by guidance branch (``COND``, and ``UNCOND`` when
    ``guided``), whole on every rank of ``group``.

    ``predict(branch)`` runs ``model`` on this rank's part of the latents for one branch, in the
    branch's cache context. Without a group this process runs every branch. Over a group this rank
    runs its CFG row's branches on its latent frames (of ``frames``; the attention sees
    ``tokens_per_frame()`` tokens a frame), and one gather gives every rank both whole predictions.
    ``batched()``, when given and this rank runs both branches, predicts them as one batch (their
    concatenation, ``COND`` first) in one forward instead."""
    branches = group.branches(guided) if group is not None else ((COND, UNCOND) if guided else (COND,))
    split = group is not None and group.state is not None  # latents cut by frames: (B, C, t, h, w)
    preds: dict[str, torch.Tensor] = {}
    with group.tokens(frames, tokens_per_frame()) if split and group is not None else contextlib.nullcontext():
        if batched is not None and len(branches) == 2:  # one forward: one collective a layer, not two
            preds = dict(zip(branches, batched().chunk(2), strict=True))
        for branch in branches if not preds else ():
            with cache_context(model, branch):
                preds[branch] = predict(branch)
    return group.gather(preds, frames, guided) if group is not None else preds


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

    def parallelize(self, group: DenoiseGroup) -> None:
        """Denoise each request over ``group``'s ranks (:mod:`mmpipe.parallel.denoise`): its
        CFG rows run one guidance branch each, its sequence-parallel ranks their latent frames."""
        check_denoise_layout(self.source.config, group.layout, key=f"stage {self.name!r}")
        if group.state is not None:
            wan_sequence_hooks(self.module, group.state)
        self.parallel = group

    parallel: DenoiseGroup | None = None
    #: the step cache each request runs with (``cache.policy``; none by default)
    step_cache: StepCache = StepCache()

    def use_step_cache(self, cache: StepCache) -> None:
        """Run every request with ``cache`` (checked against the DiT and the parallel layout now)."""
        cache.check([self.module], sequence_parallel=self.parallel is not None and self.parallel.layout.sp > 1)
        self.step_cache = cache

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
        dtype = cast(torch.dtype, module.dtype)  # diffusers ModelMixin.dtype
        context = {COND: inputs["context"].to(dtype)}
        if cfg_on:
            context[UNCOND] = inputs["negative_context"].to(dtype)
        latents = inputs["latents"].float()
        scheduler = self.scheduler_for(num_inference_steps, latents.device)
        par = self.parallel
        if par is not None:
            par.layout.check_frames(latents.shape[2], key=f"stage {self.name!r}")
        p_h, p_w = self.source.config.patch_size[1:]
        per_frame = (latents.shape[3] // p_h) * (latents.shape[4] // p_w)

        # Sequence-parallel ranks run both guidance branches as one batch: their attention's
        # collectives then carry both (half the calls); not under a step cache, which keeps one
        # state per branch. One process runs them apart, as WanPipeline does (its output is bitwise
        # the pipeline's).
        batch_branches = par is not None and par.layout.sp > 1 and self.step_cache.policy == "none"

        def loop() -> torch.Tensor:
            x0 = latents
            for t in tqdm(scheduler.timesteps, desc=self.name, disable=not progress, leave=False):
                x = (par.local(x0) if par is not None else x0).to(dtype)
                timestep_B = t.expand(x0.shape[0])

                # (x and timestep_B bound now: ruff's B023; both run before the loop moves on)
                def predict(branch: str, x: torch.Tensor = x, timestep_B: torch.Tensor = timestep_B) -> torch.Tensor:
                    return module(
                        hidden_states=x, timestep=timestep_B, encoder_hidden_states=context[branch], return_dict=False
                    )[0]

                def both(x: torch.Tensor = x, timestep_B: torch.Tensor = timestep_B) -> torch.Tensor:
                    return module(
                        hidden_states=torch.cat([x, x]),
                        timestep=torch.cat([timestep_B, timestep_B]),
                        encoder_hidden_states=torch.cat([context[COND], context[UNCOND]]),
                        return_dict=False,
                    )[0]

                preds = step_predictions(
                    module,
                    predict,
                    guided=cfg_on,
                    group=par,
                    frames=x0.shape[2],
                    tokens_per_frame=lambda: per_frame,
                    batched=both if batch_branches else None,
                )
                pred = guide(preds[COND], preds[UNCOND], guidance_scale) if cfg_on else preds[COND]
                x0 = scheduler.step(pred, t, x0, return_dict=False)[0]
            return x0

        return {"latents": self.step_cache.run([module], num_inference_steps, loop)}


def check_denoise_layout(config: Any, layout: DenoiseLayout, *, key: str) -> None:
    """Refuse a denoise layout a Wan-style DiT config cannot run: Ulysses must divide the heads, and
    sequence parallelism splits whole latent frames (``patch_size_t == 1``)."""
    if layout.ulysses > 1:
        check_heads(config.num_attention_heads, layout.ulysses, what=key)
    patch = config.patch_size
    patch_t = patch[0] if isinstance(patch, list | tuple) else getattr(config, "patch_size_t", 1) or 1
    if layout.sp > 1 and patch_t != 1:
        raise ValueError(f"{key}: sequence parallelism splits whole latent frames, but patch_size_t={patch_t}")
