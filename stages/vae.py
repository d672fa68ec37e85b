"""Wan VAE stages: video -> normalised latents (encode) and latents -> video (decode).

Latents are normalised exactly as the Wan pipelines do: ``(z - mean) / std`` per channel on encode
(``WanImageToVideoPipeline.prepare_latents``) and ``z * std + mean`` before decode
(``WanPipeline.__call__``). Wan 2.1 image-to-video training encodes each clip twice
(:class:`WanI2VVAEEncodeStage`): the clip, and the pipeline's first-frame condition.

HunyuanVideo latents are only scaled: ``z * scaling_factor`` on encode (the image-to-video and
framepack pipelines' ``prepare_latents``), ``z / scaling_factor`` before decode
(``HunyuanVideoPipeline.__call__``).

LTX-Video latents are normalised as ``LTXPipeline._normalize_latents`` does, with the VAE's own
``latents_mean`` / ``latents_std`` buffers: ``(z - mean) * scaling_factor / std``.

CogVideoX latents are scaled, ``z * scaling_factor``, and permuted to ``(B, t, Z, h, w)`` (frames
before channels), as diffusers' CogVideoX training example prepares them and ``CogVideoXPipeline``
keeps them.

Legend: B batch, C channels (3 pixels, Z latent), T/t frames (pixel/latent), H/h, W/w height/width.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from diffusers import (
    AutoencoderKLCogVideoX,
    AutoencoderKLHunyuanVideo,
    AutoencoderKLLTXVideo,
    AutoencoderKLWan,
    LTXPipeline,
)
from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm
from torch import nn

from mmpipe.graph import Capabilities, TensorSpec
from mmpipe.parallel.vae import split_wan_decode
from mmpipe.stages._source import ModuleSource, SourcedStage


class _WanVAEStage(SourcedStage):
    model_cls: ClassVar[Any] = AutoencoderKLWan  # (the Qwen-Image VAE, stages.image, shares the stages)
    capabilities = Capabilities(offload=True)

    def __init__(self, name: str, source: ModuleSource) -> None:
        super().__init__(name, source, frozen=True)
        self.z_dim: int = source.config.z_dim

    def _mean_std(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.source.config
        shape = (1, self.z_dim, 1, 1, 1)
        mean_1Z111 = torch.tensor(cfg.latents_mean).view(shape).to(like.device, like.dtype)
        # The pipelines store 1/std and divide by it; doing the same keeps results bitwise equal.
        inv_std_1Z111 = (1.0 / torch.tensor(cfg.latents_std)).view(shape).to(like.device, like.dtype)
        return mean_1Z111, inv_std_1Z111


def _rms_norm_forward(norm: Any, original: Any, x: torch.Tensor) -> torch.Tensor:  # norm: a WanRMS_norm
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return original(x)
    # F.normalize(x, dim) is x / max(||x||_2, 1e-12) along dim; the norm as a sum of squares
    dim = 1 if norm.channel_first else -1
    denom = x.square().sum(dim, keepdim=True).sqrt_().clamp_min_(1e-12)
    return x / denom * norm.scale * norm.gamma + norm.bias


def fast_cpu_norms(vae: nn.Module) -> None:
    """Make the Wan VAE's RMS norms (``WanRMS_norm``: ``F.normalize`` over the channels, then a scale)
    compute the channel norm as a sum of squares on float32 CPU tensors, in place (other devices and
    dtypes keep diffusers' forward; calling it again changes nothing). With torch 2.13 on CPU,
    ``linalg.vector_norm`` over the channel dim of a channels-first video tensor takes about 10x the
    time of the sum of squares (1.0 ms against 0.1 ms at 64 x 5 x 32 x 32, one thread), and was most
    of a frozen encode: a tiny-preset clip encodes 2.3x faster with this. Equal within float32
    rounding (about 1e-6 on the latents), not bitwise, so only training's frozen encode uses it;
    generate and serve decode with diffusers' own forward, whose frames they match bit for bit."""
    for m in vae.modules():
        wrapped = m.__dict__.get("forward")
        if not isinstance(m, WanRMS_norm) or getattr(wrapped, "func", None) is _rms_norm_forward:
            continue
        norm: nn.Module = m
        # an instance attribute, as mmpipe.serve.batching wraps forward: a partial, so that a
        # deep copy of the module rebinds it to the copy
        norm.forward = functools.partial(_rms_norm_forward, m, m.forward)


class WanVAEEncodeStage(_WanVAEStage):
    """``video (B, 3, T, H, W) in [-1, 1] -> latents (B, Z, t, h, w)``, the distribution's mode, normalised.
    The VAE's RMS norms run :func:`fast_cpu_norms`' form on CPU (training's frozen encode)."""

    kind = "vae_encode"

    def build(self) -> nn.Module:
        vae = super().build()
        fast_cpu_norms(vae)
        return vae

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        return {"video": TensorSpec(("B", 3, "T", "H", "W"), torch.float32)}

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        return {"latents": TensorSpec(("B", self.z_dim, "t", "h", "w"), torch.float32)}

    def forward(self, module: nn.Module, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        vae: Any = module  # diffusers' AutoencoderKLWan (encode/decode are not nn.Module API)
        video_B3THW = inputs["video"].to(vae.dtype)
        z_BZthw = vae.encode(video_B3THW).latent_dist.mode().float()
        mean, inv_std = self._mean_std(z_BZthw)
        return {"latents": (z_BZthw - mean) * inv_std}


class WanI2VVAEEncodeStage(WanVAEEncodeStage):
    """``video (B, 3, T, H, W) in [-1, 1] -> latents (B, Z, t, h, w), condition (B, S + Z, t, h, w)``:
    the clip's normalised latents (:class:`WanVAEEncodeStage`) and ``WanImageToVideoPipeline.
    prepare_latents``' condition for the clip's first frame: a mask of ``S`` channels (the VAE's
    temporal compression; 1 on the first latent frame, 0 after) then the normalised latents of
    ``[frame 0, T - 1 zero frames]``. ``last_frame`` (FLF2V): the condition of the first and the
    last frame, ``[frame 0, T - 2 zero frames, frame T - 1]``, the mask also 1 where the last pixel
    frame falls (the last channel of the last latent frame), as ``prepare_latents`` builds it with a
    ``last_image``.

    One stage for both: they need the same VAE, so it is loaded once and the clip crosses one edge.
    """

    def __init__(self, name: str, source: ModuleSource, *, last_frame: bool = False) -> None:
        super().__init__(name, source)
        # WanImageToVideoPipeline.vae_scale_factor_temporal
        self.scale_t: int = source.config.get("scale_factor_temporal", 4)
        self.last_frame = last_frame

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        return {
            **super().outputs,
            "condition": TensorSpec(("B", self.scale_t + self.z_dim, "t", "h", "w"), torch.float32),
        }

    def forward(self, module: nn.Module, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        vae: Any = module
        video_B3THW = inputs["video"]
        kept = [video_B3THW[:, :, :1], video_B3THW[:, :, -1:]] if self.last_frame else [video_B3THW[:, :, :1]]
        zeros = video_B3THW.shape[2] - len(kept)
        gap_B3THW = kept[0].new_zeros((*kept[0].shape[:2], zeros, *kept[0].shape[3:]))
        condition_B3THW = torch.cat([kept[0], gap_B3THW, *kept[1:]], dim=2)
        z_BZthw = vae.encode(condition_B3THW.to(vae.dtype)).latent_dist.mode().float()
        mean, inv_std = self._mean_std(z_BZthw)
        mask_BSthw = z_BZthw.new_zeros((z_BZthw.shape[0], self.scale_t, *z_BZthw.shape[2:]))
        # prepare_latents' mask: pixel frame 0 repeated S times, then the pixel frames grouped by S
        # into latent frames (S channels each): ones on the first latent frame, and with a last
        # frame on the last channel of the last latent frame (where pixel frame T - 1 falls)
        mask_BSthw[:, :, 0] = 1
        if self.last_frame:
            mask_BSthw[:, -1, -1] = 1
        condition_BCthw = torch.cat([mask_BSthw, (z_BZthw - mean) * inv_std], dim=1)
        return {**super().forward(module, inputs, **options), "condition": condition_BCthw}


class WanVAEDecodeStage(_WanVAEStage):
    """``latents (B, Z, t, h, w) -> video (B, 3, T, H, W)`` in [-1, 1] (before post-processing)."""

    kind = "vae_decode"

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        return {"latents": TensorSpec(("B", self.z_dim, "t", "h", "w"), torch.float32)}

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        return {"video": TensorSpec(("B", 3, "T", "H", "W"))}

    #: the ranks that decode each video together (None: this process alone), how they split it
    decode_group: dist.ProcessGroup | None = None
    decode_split: str = "rows"
    decode_halo: int | None = None

    def parallelize(self, group: dist.ProcessGroup | None, *, split: str = "rows", halo: int | None = None) -> None:
        """Decode over ``group``'s ranks (:func:`mmpipe.parallel.vae.split_wan_decode`): each a band
        of rows (exact), or a range of latent frames after ``halo`` frames of context."""
        self.decode_group, self.decode_split, self.decode_halo = group, split, halo

    def forward(self, module: nn.Module, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        vae: Any = module
        z_BZthw = inputs["latents"].to(vae.dtype)
        mean, inv_std = self._mean_std(z_BZthw)
        z_BZthw = z_BZthw / inv_std + mean
        video_B3THW = split_wan_decode(vae, z_BZthw, self.decode_group, split=self.decode_split, halo=self.decode_halo)
        return {"video": video_B3THW}


class _KLVideoEncodeStage(SourcedStage):
    """``video (B, 3, T, H, W) in [-1, 1] -> latents``: a diffusers ``AutoencoderKL*`` video VAE's
    distribution's mode (deterministic, so runs reproduce), turned into the family's latents by
    :meth:`latents_from`."""

    kind = "vae_encode"
    capabilities = Capabilities(offload=True)

    def __init__(self, name: str, source: ModuleSource) -> None:
        super().__init__(name, source, frozen=True)
        self.z_dim: int = source.config.latent_channels
        self.scaling_factor: float = source.config.scaling_factor

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        return {"video": TensorSpec(("B", 3, "T", "H", "W"), torch.float32)}

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        return {"latents": TensorSpec(("B", self.z_dim, "t", "h", "w"), torch.float32)}

    def forward(self, module: nn.Module, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        vae: Any = module
        z_BZthw = vae.encode(inputs["video"].to(vae.dtype)).latent_dist.mode().float()
        return {"latents": self.latents_from(vae, z_BZthw)}

    def latents_from(self, vae: Any, z_BZthw: torch.Tensor) -> torch.Tensor:
        """The distribution's mode scaled by ``scaling_factor``."""
        return z_BZthw * self.scaling_factor


class HunyuanVAEEncodeStage(_KLVideoEncodeStage):
    """``video (B, 3, T, H, W) in [-1, 1] -> latents (B, Z, t, h, w)``, the distribution's mode, scaled."""

    model_cls = AutoencoderKLHunyuanVideo


class LTXVAEEncodeStage(_KLVideoEncodeStage):
    """``video (B, 3, T, H, W) in [-1, 1] -> latents (B, Z, t, h, w)``, the distribution's mode,
    normalised with the VAE's latent statistics (``LTXPipeline._normalize_latents``)."""

    model_cls = AutoencoderKLLTXVideo

    def latents_from(self, vae: Any, z_BZthw: torch.Tensor) -> torch.Tensor:
        return LTXPipeline._normalize_latents(z_BZthw, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)


class CogVideoXVAEEncodeStage(_KLVideoEncodeStage):
    """``video (B, 3, T, H, W) in [-1, 1] -> latents (B, t, Z, h, w)``: ``AutoencoderKLCogVideoX``'s
    distribution's mode (diffusers' training example samples it; the mode keeps runs deterministic),
    times ``scaling_factor``, frames before channels (the layout ``CogVideoXTransformer3DModel`` takes)."""

    model_cls = AutoencoderKLCogVideoX

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        return {"latents": TensorSpec(("B", "t", self.z_dim, "h", "w"), torch.float32)}

    def latents_from(self, vae: Any, z_BZthw: torch.Tensor) -> torch.Tensor:
        return (z_BZthw * self.scaling_factor).permute(0, 2, 1, 3, 4).contiguous()
