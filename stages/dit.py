"""The Wan DiT (diffusers ``WanTransformer3DModel``) as a trainable flow-matching stage.

The objective is the rectified-flow one Wan trains with: ``x_s = (1 - s) x0 + s eps``, the model
predicts the velocity ``eps - x0`` at timestep ``1000 s``; ``s`` is drawn uniformly and then
shifted by the scheduler's ``shift`` (``s' = k s / (1 + (k - 1) s)``), the same warp the sampler
applies to its sigmas. Noise and ``s`` come from a generator seeded by the ``seed`` option, so a
micro-batch's loss is a pure function of (parameters, inputs, seed): resumed and pipelined runs
reproduce an uninterrupted single-process run bit for bit. A stage may train on a part of the
noise range only (``sigma_range``): each expert of Wan 2.2's two-expert DiT trains on the timesteps
the sampler gives it (the high-noise expert from ``boundary_ratio`` up, the low-noise one below).

Wan image-to-video's DiTs (:class:`WanI2VDiTFlowMatchingStage`: Wan 2.1 I2V, each expert of Wan 2.2
I2V) train with the same objective on the latents, the first frame's condition concatenated on the
channel axis and (Wan 2.1) CLIP's image embeddings beside the text, as ``WanImageToVideoPipeline``
calls them. Wan 2.2 TI2V's (:class:`WanTI2VDiTFlowMatchingStage`) keeps the clip's first latent
frame clean at timestep 0 and learns the others.

HunyuanVideo's DiT (``HunyuanVideoTransformer3DModel``) trains with the same objective and the same
draw; it additionally takes a text mask and a pooled text vector: the real ones (CLIP's pooled
vector and the Llama mask, from a ``HunyuanVideoPipeline`` directory's text stage) or, for the
architecture-only presets, both derived from the (zero-padded) context. LTX-Video's DiT
(``LTXVideoTransformer3DModel``) trains with the same objective on packed latents, with the text
mask and the rope interpolation scale ``LTXPipeline`` gives it.

CogVideoX's DiT (``CogVideoXTransformer3DModel``, :class:`CogVideoXDiTStage`) trains with its own
objective instead: DDPM-style v-prediction on the pipeline scheduler's ``alphas_cumprod``, as
diffusers' CogVideoX training example does.

Legend: B batch, Z latent channels, C a DiT's input channels (I2V: latents and condition), t/h/w
latent frames/height/width, L text tokens, D text dim.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from diffusers import (
    CogVideoXPipeline,
    CogVideoXTransformer3DModel,
    HunyuanVideoTransformer3DModel,
    LTXPipeline,
    LTXVideoTransformer3DModel,
    WanTransformer3DModel,
)
from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift
from torch import nn

from mmpipe.graph import Capabilities, TensorSpec
from mmpipe.kernels.registry import KernelChoice
from mmpipe.parallel.attention import select_backend
from mmpipe.parallel.modules import JointSequenceParallelProcessor, SequenceParallelProcessor, SequenceState
from mmpipe.parallel.reshard import Region
from mmpipe.parallel.sequence import SequenceMesh, check_heads
from mmpipe.stages._source import ModuleSource, SourcedStage
from mmpipe.stages.wan_kernels import GridRotary, use_kernels


def sample_flow_matching(
    latents_BZthw: torch.Tensor,
    *,
    seed: int,
    shift: float,
    rows: tuple[int, int, int] | None = None,
    frames: tuple[int, int, int] | None = None,
    sigma_range: tuple[float, float] = (0.0, 1.0),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``(noise, sigma_B)`` on the CPU from ``seed`` (device-independent), shifted by ``shift``
    and inside ``sigma_range`` (the uniform draw is mapped onto the part of ``[0, 1)`` whose shifted
    sigmas fall in the range, so the range's sigmas keep the shifted density).

    ``rows=(start, stop, total)``: the latents are rows ``[start, stop)`` of a micro-batch of
    ``total``; ``frames=(start, stop, total)``: and latent frames ``[start, stop)`` of ``total``
    (a sequence-parallel shard). The draw is made for the whole micro-batch and sliced, so a
    data- or sequence-parallel shard sees exactly the noise the single-process run gives it.
    """
    start, stop, total = rows if rows is not None else (0, latents_BZthw.shape[0], latents_BZthw.shape[0])
    f0, f1, frames_total = frames if frames is not None else (0, latents_BZthw.shape[2], latents_BZthw.shape[2])
    if stop - start != latents_BZthw.shape[0] or f1 - f0 != latents_BZthw.shape[2]:
        raise ValueError(
            f"rows {start}:{stop} and frames {f0}:{f1} do not match latents of shape {tuple(latents_BZthw.shape)}"
        )
    gen = torch.Generator().manual_seed(seed)
    lo, hi = (s / (shift - (shift - 1) * s) for s in sigma_range)  # the shift's inverse
    u_B = lo + (hi - lo) * torch.rand(total, generator=gen, dtype=torch.float32)
    sigma_B = shift * u_B / (1 + (shift - 1) * u_B)
    z, _, h, w = latents_BZthw.shape[1:]
    noise = torch.randn((total, z, frames_total, h, w), generator=gen, dtype=torch.float32)
    return noise[start:stop, :, f0:f1].to(latents_BZthw.device), sigma_B[start:stop].to(latents_BZthw.device)


def refuse_kernels(stage: SourcedStage, choice: KernelChoice) -> None:
    """A ``ValueError`` naming ``stage`` when ``choice`` (``model.kernels``) asks for any of
    mmpipe's kernels: they are written to the Wan DiT's block."""
    if choice != KernelChoice():
        raise ValueError(
            f"stage {stage.name!r}: model.kernels asks for mmpipe's Triton kernels, which are written to the "
            f"Wan DiT's block, not {type(stage).__name__}'s; leave model.kernels at auto or torch"
        )


class FlowMatchingDiTStage(SourcedStage):
    """``latents, context -> loss``: one flow-matching training step of a DiT on a micro-batch.

    Subclasses name the module class, the config key of the context width and how the module is
    called on the noised latents (:meth:`predict`); noise, timesteps and the loss are shared.
    """

    kind = "dit"
    capabilities = Capabilities(sequence_parallel=True, fsdp=True, offload=True)
    context_dim_key: ClassVar[str]

    def __init__(
        self,
        name: str,
        source: ModuleSource,
        *,
        shift: float = 1.0,
        num_train_timesteps: int = 1000,
        sigma_range: tuple[float, float] = (0.0, 1.0),
    ) -> None:
        super().__init__(name, source, frozen=False)
        if shift <= 0:
            raise ValueError(f"stage {name!r}: flow shift must be positive, got {shift}")
        if not 0.0 <= sigma_range[0] < sigma_range[1] <= 1.0:
            raise ValueError(f"stage {name!r}: sigma_range must satisfy 0 <= lo < hi <= 1, got {sigma_range}")
        self.sigma_range = sigma_range
        self.shift = shift
        self.num_train_timesteps = num_train_timesteps
        self._sequence: SequenceState | None = None

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        cfg = self.source.config
        return {
            "latents": TensorSpec(("B", cfg.in_channels, "t", "h", "w"), torch.float32),
            "context": TensorSpec(("B", "L", getattr(cfg, self.context_dim_key))),
        }

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        return {"loss": TensorSpec((), torch.float32)}

    # A sequence-parallel replica splits the latents by whole frames (patch_size_t == 1): each rank
    # patch-embeds and unpatchifies only its frames, whose tokens are a contiguous range of the
    # (frame, height, width)-ordered sequence. The VAE -> DiT edge then moves only each rank's frames
    # and training needs no gather: each rank's loss is its frames' share of the mean.
    sequence_inputs = {"latents": 2}

    def check_sequence_parallel(self, ulysses: int, ring: int) -> None:
        super().check_sequence_parallel(ulysses, ring)
        cfg = self.source.config
        check_heads(cfg.num_attention_heads, ulysses, what=f"stage {self.name!r}")
        patch_t = cfg.patch_size[0] if isinstance(cfg.patch_size, list | tuple) else getattr(cfg, "patch_size_t", 1)
        if ulysses * ring > 1 and patch_t != 1:
            raise ValueError(
                f"stage {self.name!r}: sequence parallelism splits whole frames, but patch_size_t={patch_t}"
            )

    def parallelize_sequence(self, module: nn.Module, mesh: SequenceMesh, *, attention: str = "torch") -> None:
        self._sequence = SequenceState(mesh, select_backend(attention))
        self.apply_sequence_hooks(module, self._sequence)

    @abc.abstractmethod
    def apply_sequence_hooks(self, module: nn.Module, state: SequenceState) -> None:
        """Wrap the module's self-attention processors and position embedding for ``state``."""

    def check_kernels(self, choice: KernelChoice) -> None:
        """A ``ValueError`` unless :meth:`use_kernels` can swap ``choice`` into this DiT (before any worker)."""
        refuse_kernels(self, choice)

    def use_kernels(self, module: nn.Module, choice: KernelChoice) -> None:
        """Swap the chosen non-``torch`` kernels (``mmpipe.kernels``) into the module."""
        self.check_kernels(choice)

    def forward(
        self,
        module: nn.Module,
        inputs: Mapping[str, Any],
        *,
        seed: int = 0,
        rows: tuple[int, int, int] | None = None,
        shards: Mapping[str, Region] | None = None,
        **_: Any,
    ) -> dict[str, Any]:
        x0_BZthw, context_BLD = inputs["latents"], inputs["context"]
        frames = self.shard_frames(shards)
        noise_BZthw, sigma_B, xs_BZthw = self.noised(x0_BZthw, seed=seed, rows=rows, frames=frames)
        timestep_B = sigma_B * self.num_train_timesteps
        pred_BZthw = self.predict_frames(module, xs_BZthw, timestep_B, context_BLD, inputs, frames)
        if frames is None:
            return {"loss": F.mse_loss(pred_BZthw.float(), (noise_BZthw - x0_BZthw).float())}
        # This rank's share of the mean over all frames: the shares of a replica sum to its loss.
        whole = x0_BZthw.numel() // x0_BZthw.shape[2] * frames[2]
        return {"loss": (pred_BZthw.float() - (noise_BZthw - x0_BZthw).float()).square().sum() / whole}

    def noised(
        self,
        x0_BZthw: torch.Tensor,
        *,
        seed: int,
        rows: tuple[int, int, int] | None,
        frames: tuple[int, int, int] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(noise, sigma_B, x_s)``: the micro-batch's draw (:func:`sample_flow_matching`, shifted for
        the whole clip's grid) and the latents noised to ``sigma``."""
        noise_BZthw, sigma_B = sample_flow_matching(
            x0_BZthw,
            seed=seed,
            shift=self.flow_shift(self.latent_grid(x0_BZthw, frames)),
            rows=rows,
            frames=frames,
            sigma_range=self.sigma_range,
        )
        s_B11111 = sigma_B.view(-1, 1, 1, 1, 1)
        return noise_BZthw, sigma_B, (1 - s_B11111) * x0_BZthw + s_B11111 * noise_BZthw

    def predict_frames(
        self,
        module: nn.Module,
        xs_BZthw: torch.Tensor,
        timestep: torch.Tensor,
        context_BLD: torch.Tensor,
        inputs: Mapping[str, Any],
        frames: tuple[int, int, int] | None,
    ) -> torch.Tensor:
        """:meth:`predict`; on a sequence-parallel shard (``frames``), with attention over the whole
        clip's tokens."""
        if frames is None:
            return self.predict(module, xs_BZthw, timestep, context_BLD, inputs)
        per_frame = self.tokens_per_frame(xs_BZthw)
        assert self._sequence is not None, "shards are only passed to a stage made sequence parallel"
        with self._sequence.tokens(frames[2] * per_frame, unit=per_frame):
            return self.predict(module, xs_BZthw, timestep, context_BLD, inputs)

    def shard_frames(self, shards: Mapping[str, Region] | None) -> tuple[int, int, int] | None:
        """``(start, stop, total)``: the latent frames this sequence-parallel rank holds (``None``:
        not split); a ``ValueError`` when a rank would hold none."""
        if shards is None or "latents" not in shards:
            return None
        region = shards["latents"]
        if len(region.ranges) != 1:
            raise ValueError(
                f"stage {self.name!r}: {region.length} latent frames cannot be split over "
                "its sequence-parallel ranks (every rank needs at least one frame)"
            )
        return (*region.ranges[0], region.length)

    def tokens_per_frame(self, x0_BZthw: torch.Tensor) -> int:
        """The DiT's tokens for one latent frame of ``x0_BZthw`` (its spatial patches)."""
        cfg = self.source.config
        p_h, p_w = cfg.patch_size[1:] if isinstance(cfg.patch_size, list | tuple) else (cfg.patch_size,) * 2
        return (x0_BZthw.shape[3] // p_h) * (x0_BZthw.shape[4] // p_w)

    @staticmethod
    def latent_grid(x0_BZthw: torch.Tensor, frames: tuple[int, int, int] | None) -> tuple[int, int, int]:
        """``(t, h, w)`` of the whole clip's latents (``frames``: a sequence-parallel shard's, whose
        third entry is the clip's frame count)."""
        t, h, w = x0_BZthw.shape[2:]
        return (frames[2] if frames is not None else t, h, w)

    def flow_shift(self, grid: tuple[int, int, int]) -> float:
        """The timestep shift of a micro-batch's draw for the whole clip's latent ``grid`` ``(t, h, w)``
        (the constant ``shift``; LTX's depends on the grid)."""
        return self.shift

    @abc.abstractmethod
    def predict(
        self,
        module: nn.Module,
        xs_BZthw: torch.Tensor,
        timestep_B: torch.Tensor,
        context_BLD: torch.Tensor,
        inputs: Mapping[str, Any],
    ) -> torch.Tensor:
        """The module's velocity prediction for the noised latents (``inputs``: the stage's other ports)."""


def _rotary_for_shard(state: SequenceState, *, token_dim: int) -> Callable[..., tuple[torch.Tensor, ...] | GridRotary]:
    """A forward hook for a rotary module called on this rank's latent frames: the table of the
    whole frame grid (the module reads only the input's shape), cut to this rank's tokens."""

    def hook(rope: nn.Module, args: tuple[Any, ...], _: Any) -> tuple[torch.Tensor, ...] | GridRotary:
        (local_BZthw,) = args
        assert state.length is not None
        shape = (*local_BZthw.shape[:2], state.length // state.unit, *local_BZthw.shape[3:])
        whole = local_BZthw.new_empty(()).expand(shape)  # the shape, without the memory
        layout, index = state.token_mesh.layout, state.mesh.index
        out = rope.forward(whole)
        if isinstance(out, GridRotary):  # the rope kernel's grid: this rank's tokens start at its offset
            ranges = layout.ranges(state.length, index)
            if len(ranges) != 1:
                raise ValueError(
                    f"the rope kernel needs one contiguous token range per rank, rank {index} has {ranges}"
                )
            return dataclasses.replace(out, token_offset=ranges[0][0])
        return tuple(layout.shard(f, token_dim, index) for f in out)

    return hook


def _rotary_cut_to_shard(state: SequenceState, *, token_dim: int) -> Callable[..., tuple[torch.Tensor, ...]]:
    """A forward hook for a rotary module that is given the whole grid's size (LTX's takes
    ``num_frames``, ``height``, ``width``): its tables cut to this rank's tokens."""

    def hook(rope: nn.Module, args: tuple[Any, ...], out: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return tuple(state.token_mesh.layout.shard(f, token_dim, state.mesh.index) for f in out)

    return hook


def wan_sequence_hooks(module: nn.Module, state: SequenceState) -> None:
    """Make a ``WanTransformer3DModel`` run on this rank's latent frames (training and inference):
    self-attention (``attn1``) through the sequence-parallel processor, the rotary table of the whole
    frame grid cut to this rank's tokens; cross-attention to the (replicated) text stays local."""
    for block in cast(Any, module).blocks:
        block.attn1.set_processor(SequenceParallelProcessor(block.attn1.processor, state))
    cast(Any, module).rope.register_forward_hook(_rotary_for_shard(state, token_dim=1))


def ltx_sequence_hooks(module: nn.Module, state: SequenceState) -> None:
    """Make an ``LTXVideoTransformer3DModel`` run on this rank's latent frames (packed into a
    contiguous token range): self-attention (``attn1``) through the sequence-parallel processor;
    the rotary tables, which the module computes from the whole grid it is told, cut to this
    rank's tokens; cross-attention to the (replicated) text stays local."""
    m = cast(Any, module)
    for block in m.transformer_blocks:
        block.attn1.set_processor(SequenceParallelProcessor(block.attn1.processor, state))
    m.rope.register_forward_hook(_rotary_cut_to_shard(state, token_dim=1))


def hunyuan_sequence_hooks(module: nn.Module, state: SequenceState) -> None:
    """Make a ``HunyuanVideoTransformer3DModel`` run on this rank's latent frames: every dual- and
    single-stream block attends jointly over this rank's video tokens and the whole (padded) text
    (joint sequence-parallel attention, the text a replicated tail). The token refiner (text only)
    is left alone; the rotary table is cut like Wan's."""
    m = cast(Any, module)
    for block in [*m.transformer_blocks, *m.single_transformer_blocks]:
        block.attn.set_processor(JointSequenceParallelProcessor(block.attn.processor, state))
    m.rope.register_forward_hook(_rotary_for_shard(state, token_dim=0))


class WanDiTFlowMatchingStage(FlowMatchingDiTStage):
    """The Wan DiT (diffusers ``WanTransformer3DModel``)."""

    model_cls = WanTransformer3DModel
    context_dim_key = "text_dim"

    def apply_sequence_hooks(self, module: nn.Module, state: SequenceState) -> None:
        wan_sequence_hooks(module, state)

    def check_kernels(self, choice: KernelChoice) -> None:
        pass  # every kernel covers the Wan DiT

    def use_kernels(self, module: nn.Module, choice: KernelChoice) -> None:
        use_kernels(module, choice)

    def predict(
        self,
        module: nn.Module,
        xs_BZthw: torch.Tensor,
        timestep_B: torch.Tensor,
        context_BLD: torch.Tensor,
        inputs: Mapping[str, Any],
    ) -> torch.Tensor:
        dtype = cast(torch.dtype, module.dtype)  # diffusers ModelMixin.dtype
        return module(
            hidden_states=xs_BZthw.to(dtype),
            timestep=timestep_B,
            encoder_hidden_states=context_BLD.to(dtype),
            return_dict=False,
        )[0]


class WanI2VDiTFlowMatchingStage(WanDiTFlowMatchingStage):
    """``latents, context, condition[, image_embeds] -> loss``: a Wan image-to-video DiT
    (``WanTransformer3DModel`` whose input has condition channels), trained like the text-to-video one.

    The module sees ``cat([noisy latents, condition])`` on the channel axis, ``condition`` ``(B, S + Z,
    t, h, w)`` being the first-frame mask and the first frame's latents of
    :class:`~mmpipe.stages.WanI2VVAEEncodeStage`, and, where the transformer has an ``image_dim``
    (Wan 2.1 I2V), the CLIP embeddings ``image_embeds`` ``(B, N, D)`` as
    ``encoder_hidden_states_image``: ``WanImageToVideoPipeline``'s call of its transformer. Wan 2.2
    I2V's experts take no CLIP embeddings (no ``image_embeds`` port), each training on its noise
    range (``sigma_range``). Wan 2.1 FLF2V's (``pos_embed_seq_len``) takes the first and the last
    frame's embeddings, ``(B, 2N, D)``. The target is the velocity of the ``Z`` latent channels only
    (the module's ``out_channels``). Sequence parallel, the condition is split by frames like the
    latents (its frames are theirs).
    """

    sequence_inputs = {"latents": 2, "condition": 2}

    def __init__(self, name: str, source: ModuleSource, **kw: Any) -> None:
        super().__init__(name, source, **kw)
        cfg = source.config
        if cfg.in_channels <= cfg.out_channels:
            raise ValueError(
                f"stage {name!r}: in_channels={cfg.in_channels} leaves no condition channels beside "
                f"out_channels={cfg.out_channels} latent channels"
            )

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        cfg = self.source.config
        ports = {
            "latents": TensorSpec(("B", cfg.out_channels, "t", "h", "w"), torch.float32),
            "context": TensorSpec(("B", "L", cfg.text_dim)),
            "condition": TensorSpec(("B", cfg.in_channels - cfg.out_channels, "t", "h", "w"), torch.float32),
        }
        if cfg.image_dim is not None:
            ports["image_embeds"] = TensorSpec(("B", "N", cfg.image_dim))
        return ports

    def predict(
        self,
        module: nn.Module,
        xs_BZthw: torch.Tensor,
        timestep_B: torch.Tensor,
        context_BLD: torch.Tensor,
        inputs: Mapping[str, Any],
    ) -> torch.Tensor:
        dtype = cast(torch.dtype, module.dtype)  # diffusers ModelMixin.dtype
        x_BCthw = torch.cat([xs_BZthw, inputs["condition"]], dim=1)  # as WanImageToVideoPipeline.__call__
        image_BND = inputs.get("image_embeds")
        if image_BND is not None and self.source.config.pos_embed_seq_len is not None:
            # FLF2V: the first and the last frame's tokens of a clip as two rows, as encode_image gives
            # them for [image, last_image]; the module's image embedding views each pair as one row
            image_BND = image_BND.reshape(-1, image_BND.shape[1] // 2, image_BND.shape[2])
        return module(
            hidden_states=x_BCthw.to(dtype),
            timestep=timestep_B,
            encoder_hidden_states=context_BLD.to(dtype),
            encoder_hidden_states_image=image_BND.to(dtype) if image_BND is not None else None,
            return_dict=False,
        )[0]


class WanTI2VDiTFlowMatchingStage(WanDiTFlowMatchingStage):
    """``latents, context -> loss``: Wan 2.2 TI2V's DiT (``expand_timesteps``) trained on
    image-to-video as ``WanImageToVideoPipeline`` runs it: the clip's first latent frame is the
    image's, clean, its tokens at timestep 0; the other frames are noised at the drawn timestep,
    one timestep per token; the loss is over the noised frames only (the first frame has nothing
    to predict), as DiffSynth-Studio's TI2V training computes it.

    Sequence parallel, the rank holding latent frame 0 keeps it clean and leaves it out of its
    share of the loss; every rank's per-token timesteps are its own tokens'.
    """

    def forward(
        self,
        module: nn.Module,
        inputs: Mapping[str, Any],
        *,
        seed: int = 0,
        rows: tuple[int, int, int] | None = None,
        shards: Mapping[str, Region] | None = None,
        **_: Any,
    ) -> dict[str, Any]:
        x0_BZthw, context_BLD = inputs["latents"], inputs["context"]
        frames = self.shard_frames(shards)
        start, stop, total = frames if frames is not None else (0, x0_BZthw.shape[2], x0_BZthw.shape[2])
        if total < 2:
            raise ValueError(
                f"stage {self.name!r}: TI2V training conditions on the first latent frame and needs at least "
                f"2 latent frames, got {total} (raise data.frames)"
            )
        noise_BZthw, sigma_B, xs_BZthw = self.noised(x0_BZthw, seed=seed, rows=rows, frames=frames)
        per_frame = self.tokens_per_frame(x0_BZthw)
        # the pipeline's (mask * t).flatten(): a timestep per token, 0 on the image's frame
        timestep_BN = (sigma_B * self.num_train_timesteps)[:, None].repeat(1, (stop - start) * per_frame)
        first = 1 if start == 0 else 0  # this rank holds the image's frame
        if first:
            xs_BZthw = torch.cat([x0_BZthw[:, :, :1], xs_BZthw[:, :, 1:]], dim=2)
            timestep_BN[:, :per_frame] = 0
        pred_BZthw = self.predict_frames(module, xs_BZthw, timestep_BN, context_BLD, inputs, frames)
        err_BZthw = (pred_BZthw.float() - (noise_BZthw - x0_BZthw).float()).square()[:, :, first:]
        # this rank's share of the mean over the noised frames of the whole clip
        return {"loss": err_BZthw.sum() / (x0_BZthw.numel() // x0_BZthw.shape[2] * (total - 1))}


class HunyuanVideoDiTFlowMatchingStage(FlowMatchingDiTStage):
    """``latents, context[, context_mask, pooled] -> loss``: one flow-matching training step of the
    HunyuanVideo DiT.

    The module also needs ``encoder_attention_mask`` and ``pooled_projections``. With
    ``text_inputs=True`` (a ``HunyuanVideoPipeline`` directory) they are the ports ``context_mask``
    ``(B, L)`` (the Llama tokens' mask, cropped like the context) and ``pooled`` ``(B, D_clip)``
    (CLIP's pooled vector), as ``HunyuanVideoPipeline.encode_prompt`` returns them. Without (the
    architecture-only presets, one text encoder) both come from the context, whose padded positions
    the text stages set to exactly zero: the mask is ``(context != 0).any(-1)`` (token 0 always
    counts, so an all-padding row stays finite) and the pooled vector the mean of the valid tokens
    (so the module's ``pooled_projection_dim`` must equal its ``text_embed_dim``).
    Guidance-distilled checkpoints (``guidance_embeds=True``) get the embedded guidance scale
    ``guidance`` (default 6.0, the pipeline's), times 1000 as ``HunyuanVideoPipeline`` passes it.
    """

    model_cls = HunyuanVideoTransformer3DModel
    context_dim_key = "text_embed_dim"

    def __init__(
        self,
        name: str,
        source: ModuleSource,
        *,
        shift: float = 1.0,
        num_train_timesteps: int = 1000,
        guidance: float | None = None,
        text_inputs: bool = False,
    ) -> None:
        super().__init__(name, source, shift=shift, num_train_timesteps=num_train_timesteps)
        cfg = source.config
        self.text_inputs = text_inputs
        if not text_inputs and cfg.pooled_projection_dim != cfg.text_embed_dim:
            raise ValueError(
                f"stage {name!r}: pooled_projections are the masked mean of the context, so "
                f"pooled_projection_dim ({cfg.pooled_projection_dim}) must equal text_embed_dim ({cfg.text_embed_dim})"
            )
        if cfg.guidance_embeds:
            guidance = 6.0 if guidance is None else guidance
        elif guidance is not None:
            raise ValueError(f"stage {name!r}: guidance={guidance} given but the module has guidance_embeds=False")
        self.guidance = guidance

    def apply_sequence_hooks(self, module: nn.Module, state: SequenceState) -> None:
        hunyuan_sequence_hooks(module, state)

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        ports = dict(super().inputs)
        if self.text_inputs:
            ports["context_mask"] = TensorSpec(("B", "L"), torch.int64)
            ports["pooled"] = TensorSpec(("B", self.source.config.pooled_projection_dim))
        return ports

    def predict(
        self,
        module: nn.Module,
        xs_BZthw: torch.Tensor,
        timestep_B: torch.Tensor,
        context_BLD: torch.Tensor,
        inputs: Mapping[str, Any],
    ) -> torch.Tensor:
        dtype = cast(torch.dtype, module.dtype)  # diffusers ModelMixin.dtype
        if self.text_inputs:  # as HunyuanVideoPipeline passes them: all in the DiT's dtype
            mask_BL: torch.Tensor = inputs["context_mask"].to(dtype)
            pooled_BD: torch.Tensor = inputs["pooled"]
        else:
            # Text stages zero padded positions exactly; a real token is never all-zero. The module builds
            # its joint-attention mask from the *count* of valid tokens (valid tokens must come first) and
            # its token refiner divides by that count: an all-padding row (a zeroed prompt) keeps token 0.
            mask_BL = (context_BLD != 0).any(-1)
            mask_BL[:, 0] = True
            mask_BL1 = mask_BL.unsqueeze(-1).float()
            pooled_BD = (context_BLD.float() * mask_BL1).sum(1) / mask_BL1.sum(1).clamp(min=1)
        guidance_B = None
        if self.guidance is not None:
            guidance_B = torch.full(timestep_B.shape, self.guidance * 1000.0, device=timestep_B.device)
        return module(
            hidden_states=xs_BZthw.to(dtype),
            timestep=timestep_B,
            encoder_hidden_states=context_BLD.to(dtype),
            encoder_attention_mask=mask_BL,
            pooled_projections=pooled_BD.to(dtype),
            guidance=guidance_B,
            return_dict=False,
        )[0]


class LTXDiTFlowMatchingStage(FlowMatchingDiTStage):
    """``latents, context, context_mask -> loss``: one flow-matching training step of the LTX-Video DiT
    (diffusers ``LTXVideoTransformer3DModel``).

    The latents ``(B, C, t, h, w)`` (normalised as ``LTXPipeline._normalize_latents`` does) are noised
    unpacked, packed into tokens for the module (``LTXPipeline._pack_latents``) and its prediction
    unpacked again; the module also takes the T5 mask (``encoder_attention_mask``), the latent grid and
    the rope interpolation scale ``(vae_temporal / frame_rate, vae_spatial, vae_spatial)``, as
    ``LTXPipeline.__call__`` passes them. ``dynamic_shift=(base_seq_len, max_seq_len, base_shift,
    max_shift)`` (a scheduler with ``use_dynamic_shifting``): the shift of each draw is
    ``exp(mu)`` with ``mu = calculate_shift(t * h * w, ...)``, the warp the sampler applies to its
    sigmas for that grid; otherwise the constant ``shift`` (the whole clip's grid, sequence
    parallel too). Sequence parallel, each rank packs and predicts its latent frames; the module is
    told the whole grid, so its rotary tables are the clip's, cut to the rank's tokens
    (:func:`ltx_sequence_hooks`).
    """

    model_cls = LTXVideoTransformer3DModel
    context_dim_key = "caption_channels"

    def __init__(
        self,
        name: str,
        source: ModuleSource,
        *,
        vae_compression: tuple[int, int],
        frame_rate: float = 25.0,
        shift: float = 1.0,
        dynamic_shift: tuple[int, int, float, float] | None = None,
        num_train_timesteps: int = 1000,
    ) -> None:
        super().__init__(name, source, shift=shift, num_train_timesteps=num_train_timesteps)
        if frame_rate <= 0:
            raise ValueError(f"stage {name!r}: frame_rate must be positive, got {frame_rate}")
        temporal, spatial = vae_compression
        self.rope_interpolation_scale = (temporal / frame_rate, float(spatial), float(spatial))
        self.dynamic_shift = dynamic_shift

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        return {**super().inputs, "context_mask": TensorSpec(("B", "L"), torch.int64)}

    def apply_sequence_hooks(self, module: nn.Module, state: SequenceState) -> None:
        ltx_sequence_hooks(module, state)

    def flow_shift(self, grid: tuple[int, int, int]) -> float:
        if self.dynamic_shift is None:
            return self.shift
        base_seq, max_seq, base_shift, max_shift = self.dynamic_shift
        return math.exp(calculate_shift(math.prod(grid), base_seq, max_seq, base_shift, max_shift))

    def predict(
        self,
        module: nn.Module,
        xs_BZthw: torch.Tensor,
        timestep_B: torch.Tensor,
        context_BLD: torch.Tensor,
        inputs: Mapping[str, Any],
    ) -> torch.Tensor:
        cfg = self.source.config
        p, p_t = cfg.patch_size, cfg.patch_size_t
        t, h, w = xs_BZthw.shape[2:]
        dtype = cast(torch.dtype, module.dtype)  # the pipeline's: the text embeddings' (= the DiT's) dtype
        xs_BSD = LTXPipeline._pack_latents(xs_BZthw, p, p_t)
        state = self._sequence
        # sequence parallel: this rank's frames, the rotary tables of the whole clip's grid
        frames = state.length // state.unit if state is not None and state.length is not None else t
        pred_BSD = module(
            hidden_states=xs_BSD.to(dtype),
            encoder_hidden_states=context_BLD.to(dtype),
            timestep=timestep_B,
            encoder_attention_mask=inputs["context_mask"].bool(),
            num_frames=frames,
            height=h,
            width=w,
            rope_interpolation_scale=self.rope_interpolation_scale,
            return_dict=False,
        )[0]
        return cast(torch.Tensor, LTXPipeline._unpack_latents(pred_BSD.float(), t // p_t, h // p, w // p, p, p_t))


def sample_v_prediction(
    latents_BtZhw: torch.Tensor, *, seed: int, num_train_timesteps: int, rows: tuple[int, int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``(noise, timestep_B)`` on the CPU from ``seed`` (device-independent): the noise first,
    then integer timesteps uniform in ``[0, num_train_timesteps)``, as
    ``examples/cogvideo/train_cogvideox_lora.py`` draws them. ``rows=(start, stop, total)``: the
    latents are rows ``[start, stop)`` of a micro-batch of ``total``; the draw is made for the whole
    micro-batch and sliced, like :func:`sample_flow_matching`."""
    start, stop, total = rows if rows is not None else (0, latents_BtZhw.shape[0], latents_BtZhw.shape[0])
    if stop - start != latents_BtZhw.shape[0]:
        raise ValueError(f"rows {start}:{stop} do not match latents of shape {tuple(latents_BtZhw.shape)}")
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn((total, *latents_BtZhw.shape[1:]), generator=gen, dtype=torch.float32)
    timestep_B = torch.randint(0, num_train_timesteps, (total,), generator=gen, dtype=torch.int64)
    return noise[start:stop].to(latents_BtZhw.device), timestep_B[start:stop].to(latents_BtZhw.device)


class CogVideoXDiTStage(SourcedStage):
    """``latents, context -> loss``: one training step of the CogVideoX DiT (diffusers
    ``CogVideoXTransformer3DModel``) with CogVideoX's own v-prediction objective.

    Followed: diffusers' ``examples/cogvideo/train_cogvideox_lora.py``. Latents ``(B, t, C, h, w)``
    (frames before channels, scaled by the VAE's ``scaling_factor``); an integer timestep ``t``
    uniform in ``[0, num_train_timesteps)`` and Gaussian noise (:func:`sample_v_prediction`, from the
    ``seed`` option, drawn for the whole micro-batch and sliced by ``rows``); ``noisy =
    scheduler.add_noise(x0, noise, t)`` with the pipeline's scheduler (its ``alphas_cumprod``, with
    ``snr_shift_scale`` and ``rescale_betas_zero_snr`` as its config says); the module's
    v-prediction turned into an ``x0`` prediction by ``scheduler.get_velocity(pred, noisy, t)`` and
    the loss ``mean_B(mean((1 / (1 - alphas_cumprod[t])) * (x0_pred - x0)^2))``, exactly the
    script's (equal to the plain v-prediction MSE against ``get_velocity(x0, noise, t)``, since
    ``x0_pred - x0 = sqrt(1 - alphas_cumprod[t]) (v - v_pred)``). The module takes the integer
    timesteps, and with ``use_rotary_positional_embeddings`` the 3-D rotary embedding of
    ``CogVideoXPipeline._prepare_rotary_positional_embeddings`` for the latent grid. Sequence
    parallelism is not supported (text and video tokens are one full-attention sequence); a
    CogVideoX 1.5 DiT (``patch_size_t``) needs a multiple of ``patch_size_t`` latent frames.
    """

    kind = "dit"
    model_cls = CogVideoXTransformer3DModel
    capabilities = Capabilities(sequence_parallel=False, fsdp=True, offload=True)

    def check_kernels(self, choice: KernelChoice) -> None:
        """A ``ValueError`` naming the stage when ``model.kernels`` asks for mmpipe's (Wan) kernels."""
        refuse_kernels(self, choice)

    def __init__(self, name: str, source: ModuleSource, *, scheduler: Any, vae_scale_factor_spatial: int) -> None:
        super().__init__(name, source, frozen=False)
        if scheduler.config.prediction_type != "v_prediction":
            raise ValueError(
                f"stage {name!r}: CogVideoX trains v-prediction, the scheduler's prediction_type is "
                f"{scheduler.config.prediction_type!r}"
            )
        self.scheduler = scheduler
        self.num_train_timesteps = int(scheduler.config.num_train_timesteps)
        self.vae_scale_factor_spatial = vae_scale_factor_spatial

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        cfg = self.source.config
        return {
            "latents": TensorSpec(("B", "t", cfg.in_channels, "h", "w"), torch.float32),
            "context": TensorSpec(("B", "L", cfg.text_embed_dim)),
        }

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        return {"loss": TensorSpec((), torch.float32)}

    def rotary_embedding(self, latents_BtZhw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``CogVideoXPipeline._prepare_rotary_positional_embeddings`` for the latents' grid (``None``
        without ``use_rotary_positional_embeddings``: the module's own sin-cos positions)."""
        cfg = self.source.config
        if not cfg.use_rotary_positional_embeddings:
            return None
        t, _, h, w = latents_BtZhw.shape[1:]
        pipe = SimpleNamespace(
            vae_scale_factor_spatial=self.vae_scale_factor_spatial, transformer=SimpleNamespace(config=cfg)
        )
        scale = self.vae_scale_factor_spatial
        return cast(
            tuple[torch.Tensor, torch.Tensor],
            CogVideoXPipeline._prepare_rotary_positional_embeddings(
                cast(Any, pipe), h * scale, w * scale, t, latents_BtZhw.device
            ),
        )

    def forward(
        self,
        module: nn.Module,
        inputs: Mapping[str, Any],
        *,
        seed: int = 0,
        rows: tuple[int, int, int] | None = None,
        **_: Any,
    ) -> dict[str, Any]:
        x0_BtZhw, context_BLD = inputs["latents"].float(), inputs["context"]
        patch_t = self.source.config.patch_size_t
        if patch_t is not None and x0_BtZhw.shape[1] % patch_t:
            raise ValueError(
                f"stage {self.name!r}: {x0_BtZhw.shape[1]} latent frames are not a multiple of the "
                f"DiT's patch_size_t={patch_t} (CogVideoX 1.5: choose data.frames accordingly)"
            )
        noise_BtZhw, t_B = sample_v_prediction(
            x0_BtZhw, seed=seed, num_train_timesteps=self.num_train_timesteps, rows=rows
        )
        sched = self.scheduler
        noisy_BtZhw = sched.add_noise(x0_BtZhw, noise_BtZhw, t_B)
        dtype = cast(torch.dtype, module.dtype)  # diffusers ModelMixin.dtype
        pred_BtZhw = module(
            hidden_states=noisy_BtZhw.to(dtype),
            encoder_hidden_states=context_BLD.to(dtype),
            timestep=t_B,
            image_rotary_emb=self.rotary_embedding(x0_BtZhw),
            return_dict=False,
        )[0]
        x0_pred_BtZhw = sched.get_velocity(pred_BtZhw.float(), noisy_BtZhw, t_B)
        alphas_cumprod_B = sched.alphas_cumprod.to(x0_BtZhw.device, torch.float32)[t_B]
        weights_B1111 = (1 / (1 - alphas_cumprod_B)).view(-1, 1, 1, 1, 1)
        loss_B = (weights_B1111 * (x0_pred_BtZhw - x0_BtZhw) ** 2).reshape(x0_BtZhw.shape[0], -1).mean(dim=1)
        return {"loss": loss_B.mean()}
