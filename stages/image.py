"""The image families' request as stages on configs (FLUX.1, Qwen-Image): what the serving planner
(``mmpipe plan mode=serve``) costs on the meta device for their architecture-only presets
(``configs/model/flux1_dev.yaml``, ``qwen_image.yaml``; graphs in :mod:`mmpipe.models.arch`).

mmpipe does not train image families, and generates with them through the pipeline's own modules
(:mod:`mmpipe.models.flux`, :mod:`mmpipe.models.qwenimage`); these adapters only give the planner
the computation of one request, with the stage names of the video presets' graphs::

    input.{input_ids, clip_input_ids | attention_mask} -> text.{context, pooled | context_mask} -> dit
    input.{image | video} -> vae.latents -> dit.latents -> dit.velocity

``text`` runs the text encoders as the pipeline's ``encode_prompt`` does; ``vae`` encodes (the
planner measures the decode of its latents apart, as for the video presets); ``dit`` is one
transformer call of the denoising loop (one guidance branch) on the latents packed into 2x2
patches. Neither DiT takes sequence parallelism: the engine refuses it for both families
(``Family.sequence_parallel``), so the planner offers them CFG, replicas and batching only.

Legend: B batch, C latent channels, h/w latent height/width, N image tokens (h/2 x w/2), L text
tokens, D text width, P pooled width, S the prompt template's tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from diffusers import AutoencoderKL, AutoencoderKLQwenImage, FluxTransformer2DModel, QwenImageTransformer2DModel
from torch import nn
from transformers import CLIPTextModel, Qwen2_5_VLForConditionalGeneration, T5EncoderModel

from mmpipe.graph import Capabilities, TensorSpec
from mmpipe.stages._source import ModuleSource, SourcedStage
from mmpipe.stages.vae import WanVAEEncodeStage

#: ``QwenImagePipeline.prompt_template_encode_start_idx``: the tokens of the prompt template's
#: system part, dropped from the text encoder's hidden states
QWEN_IMAGE_TEMPLATE_TOKENS = 34
#: the guidance embedding's scale a guidance-distilled FLUX.1 is called with (``FluxPipeline``'s
#: default ``guidance_scale``; the FLOPs do not depend on it)
FLUX_GUIDANCE = 3.5


def pack_latents(latents_BChw: torch.Tensor) -> torch.Tensor:
    """``(B, C, h, w) -> (B, h/2 * w/2, 4C)``: 2x2 patches as tokens, as ``FluxPipeline._pack_latents``
    and ``QwenImagePipeline._pack_latents`` pack them (not imported: the pipelines' modules log a
    torchvision warning at import)."""
    b, c, h, w = latents_BChw.shape
    x = latents_BChw.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


class FluxTextEncoderStage(SourcedStage):
    """``input_ids (B, L), clip_input_ids (B, 77) -> context (B, L, D), pooled (B, P)``:
    ``FluxPipeline.encode_prompt``: T5's last hidden states of the padded prompt, run without a mask
    (``_get_t5_prompt_embeds``), and CLIP's ``pooler_output`` (``_get_clip_prompt_embeds``). The
    module is a ``ModuleDict`` of ``t5`` and ``clip``."""

    kind = "text_encoder"
    model_cls = nn.ModuleDict

    def __init__(self, name: str, source: ModuleSource, *, max_length: int, clip_length: int = 77) -> None:
        super().__init__(name, source, frozen=True)
        if max_length <= 0:
            raise ValueError(f"stage {name!r}: max_length must be positive, got {max_length}")
        self.max_length, self.clip_length = max_length, clip_length
        self.hidden_size: int = source.config["t5"].d_model
        self.pooled_size: int = source.config["clip"].hidden_size

    def build_from_config(self) -> nn.Module:
        """Both encoders from their configs (the cost model builds them on the meta device)."""
        cfg = self.source.config
        return nn.ModuleDict({"t5": T5EncoderModel(cfg["t5"]), "clip": CLIPTextModel(cfg["clip"])})

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        return {
            "input_ids": TensorSpec(("B", "L"), torch.int64),
            "clip_input_ids": TensorSpec(("B", self.clip_length), torch.int64),
        }

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        return {
            "context": TensorSpec(("B", "L", self.hidden_size)),
            "pooled": TensorSpec(("B", self.pooled_size)),
        }

    def forward(self, module: nn.Module, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        encoders: Any = module  # nn.ModuleDict
        context_BLD = encoders["t5"](inputs["input_ids"], output_hidden_states=False)[0]
        pooled_BP = encoders["clip"](inputs["clip_input_ids"], output_hidden_states=False).pooler_output
        return {"context": context_BLD, "pooled": pooled_BP}


class FluxVAEEncodeStage(SourcedStage):
    """``image (B, 3, H, W) in [-1, 1] -> latents (B, C, h, w)``: ``AutoencoderKL``'s distribution's
    mode, shifted and scaled as FLUX.1's pipelines encode an image: ``(z - shift_factor) * scaling_factor``."""

    kind = "vae_encode"
    model_cls = AutoencoderKL
    capabilities = Capabilities(offload=True)

    def __init__(self, name: str, source: ModuleSource) -> None:
        super().__init__(name, source, frozen=True)
        self.z_dim: int = source.config.latent_channels

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        return {"image": TensorSpec(("B", 3, "H", "W"), torch.float32)}

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        return {"latents": TensorSpec(("B", self.z_dim, "h", "w"), torch.float32)}

    def forward(self, module: nn.Module, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        vae: Any = module  # diffusers' AutoencoderKL (encode is not nn.Module API)
        cfg = self.source.config
        z_BChw = vae.encode(inputs["image"].to(vae.dtype)).latent_dist.mode().float()
        return {"latents": (z_BChw - cfg.shift_factor) * cfg.scaling_factor}


class FluxDiTStage(SourcedStage):
    """``latents (B, C, h, w), context (B, L, D), pooled (B, P) -> velocity (B, N, 4C)``: one call of
    ``FluxTransformer2DModel`` as ``FluxPipeline``'s loop makes it: the latents packed
    (:func:`pack_latents`) with their ``img_ids``, zero ``txt_ids``, the timestep / 1000 and, for a
    guidance-distilled transformer (``guidance_embeds``), the guidance embedding's scale."""

    kind = "dit"
    model_cls = FluxTransformer2DModel
    capabilities = Capabilities(sequence_parallel=False, offload=True)  # no sequence-parallel hooks (see above)

    def __init__(self, name: str, source: ModuleSource) -> None:
        super().__init__(name, source, frozen=True)

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        cfg = self.source.config
        return {
            "latents": TensorSpec(("B", cfg.in_channels // 4, "h", "w"), torch.float32),
            "context": TensorSpec(("B", "L", cfg.joint_attention_dim)),
            "pooled": TensorSpec(("B", cfg.pooled_projection_dim)),
        }

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        cfg = self.source.config
        return {"velocity": TensorSpec(("B", "N", cfg.out_channels or cfg.in_channels))}

    def forward(self, module: nn.Module, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        latents_BChw = inputs["latents"]
        b, _, h, w = latents_BChw.shape
        dtype = cast(torch.dtype, module.dtype)  # diffusers ModelMixin.dtype
        device = latents_BChw.device
        context_BLD = inputs["context"].to(dtype)
        # FluxPipeline._prepare_latent_image_ids: (row, column) of each packed token; text ids are zero
        rows_N, cols_N = torch.meshgrid(torch.arange(h // 2), torch.arange(w // 2), indexing="ij")
        img_ids_N3 = torch.stack([torch.zeros_like(rows_N), rows_N, cols_N], dim=-1).reshape(-1, 3)
        guidance_B = None
        if self.source.config.guidance_embeds:
            guidance_B = torch.full((b,), FLUX_GUIDANCE, device=device, dtype=torch.float32)
        velocity_BNC = module(
            hidden_states=pack_latents(latents_BChw).to(dtype),
            timestep=torch.ones(b, device=device, dtype=dtype),  # the first step's t / 1000
            guidance=guidance_B,
            pooled_projections=inputs["pooled"].to(dtype),
            encoder_hidden_states=context_BLD,
            txt_ids=torch.zeros(context_BLD.shape[1], 3, device=device, dtype=dtype),
            img_ids=img_ids_N3.to(device, dtype),
            return_dict=False,
        )[0]
        return {"velocity": velocity_BNC}


class QwenImageTextEncoderStage(SourcedStage):
    """``input_ids, attention_mask (B, S + L) -> context (B, L, D), context_mask (B, L)``:
    ``QwenImagePipeline._get_qwen_prompt_embeds``: Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``,
    called as the pipeline calls it, LM head included) on the prompt in the pipeline's template; its
    last hidden states without the template's first ``S`` tokens, and the mask cropped alike."""

    kind = "text_encoder"
    model_cls = Qwen2_5_VLForConditionalGeneration

    def __init__(
        self, name: str, source: ModuleSource, *, max_length: int, template_tokens: int = QWEN_IMAGE_TEMPLATE_TOKENS
    ) -> None:
        super().__init__(name, source, frozen=True)
        if max_length <= 0:
            raise ValueError(f"stage {name!r}: max_length must be positive, got {max_length}")
        self.max_length, self.template_tokens = max_length, template_tokens
        self.hidden_size: int = source.config.text_config.hidden_size

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        ids = TensorSpec(("B", self.template_tokens + self.max_length), torch.int64)
        return {"input_ids": ids, "attention_mask": ids}

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        return {
            "context": TensorSpec(("B", self.max_length, self.hidden_size)),
            "context_mask": TensorSpec(("B", self.max_length), torch.int64),
        }

    def forward(self, module: nn.Module, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        mask_BSL = inputs["attention_mask"]
        out = module(input_ids=inputs["input_ids"], attention_mask=mask_BSL, output_hidden_states=True)
        drop = self.template_tokens
        return {"context": out.hidden_states[-1][:, drop:], "context_mask": mask_BSL[:, drop:]}


class QwenImageVAEEncodeStage(WanVAEEncodeStage):
    """``video (B, 3, 1, H, W) in [-1, 1] -> latents (B, C, 1, h, w)``: ``AutoencoderKLQwenImage``
    (the Wan VAE's architecture, one frame) normalised with its ``latents_mean`` / ``latents_std``."""

    model_cls = AutoencoderKLQwenImage


class QwenImageDiTStage(SourcedStage):
    """``latents (B, C, 1, h, w), context (B, L, D), context_mask (B, L) -> velocity (B, N, 4C)``:
    one call of ``QwenImageTransformer2DModel`` as ``QwenImagePipeline``'s loop makes it: the
    latents packed (:func:`pack_latents`), their ``img_shapes``, the timestep / 1000, the text mask
    (``None`` when nothing is padded, as :class:`~mmpipe.models.qwenimage.QwenImageFamily` passes it)."""

    kind = "dit"
    model_cls = QwenImageTransformer2DModel
    capabilities = Capabilities(sequence_parallel=False, offload=True)  # no sequence-parallel hooks (see above)

    def __init__(self, name: str, source: ModuleSource) -> None:
        super().__init__(name, source, frozen=True)

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        cfg = self.source.config
        return {
            "latents": TensorSpec(("B", cfg.in_channels // 4, 1, "h", "w"), torch.float32),
            "context": TensorSpec(("B", "L", cfg.joint_attention_dim)),
            "context_mask": TensorSpec(("B", "L"), torch.int64),
        }

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        cfg = self.source.config
        return {"velocity": TensorSpec(("B", "N", 4 * (cfg.out_channels or cfg.in_channels // 4)))}

    def forward(self, module: nn.Module, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        latents_BC1hw, mask_BL = inputs["latents"], inputs["context_mask"]
        b, _, _, h, w = latents_BC1hw.shape
        dtype = cast(torch.dtype, module.dtype)  # diffusers ModelMixin.dtype
        guidance_B = None
        if self.source.config.guidance_embeds:
            guidance_B = torch.ones(b, device=latents_BC1hw.device, dtype=torch.float32)
        velocity_BNC = module(
            hidden_states=pack_latents(latents_BC1hw[:, :, 0]).to(dtype),
            timestep=torch.ones(b, device=latents_BC1hw.device, dtype=dtype),  # the first step's t / 1000
            guidance=guidance_B,
            encoder_hidden_states_mask=None if bool(mask_BL.all()) else mask_BL,
            encoder_hidden_states=inputs["context"].to(dtype),
            img_shapes=[[(1, h // 2, w // 2)]] * b,
            return_dict=False,
        )[0]
        return {"velocity": velocity_BNC}
