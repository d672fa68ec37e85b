"""Qwen-Image text-to-image (``diffusers.QwenImagePipeline``): the family's hooks of the shared
inference graph (:mod:`mmpipe.models.pipeline_graph`) and its tiny random-weight preset.

Latents: packed ``(B, h/2 * w/2, 4C)`` tokens (2x2 patches of the VAE's single-frame
``(B, C, 1, h, w)`` latents), in the text embeddings' dtype as ``QwenImagePipeline`` keeps them;
``img_shapes`` (the RoPE grid) and the guidance-embedding tensor ride in the loop's state. The
text condition is Qwen2.5-VL's last hidden state after the pipeline's prompt template, with its
padding mask.

Tiny preset: the real component classes (``QwenImageTransformer2DModel``,
``AutoencoderKLQwenImage``, ``Qwen2_5_VLForConditionalGeneration``, ``Qwen2Tokenizer``,
``FlowMatchEulerDiscreteScheduler``) from small configs; the byte-level BPE tokenizer is trained
locally on the prompt template (nothing is downloaded) and everything is saved with
``save_pretrained``.

Legend: B batch, C latent channels, h/w latent height/width, L text tokens, D text width.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from torch import nn
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from mmpipe.models.pipeline_graph import Family, prompt_list

logger = logging.getLogger(__name__)


class QwenImageFamily(Family):
    """``QwenImagePipeline``: Qwen2.5-VL's hidden states of the templated prompt condition an
    MMDiT; true classifier-free guidance (``true_cfg_scale > 1`` with a ``negative_prompt``) with
    the pipeline's norm rescaling, and ``guidance_scale`` for guidance-distilled transformers
    (transcribed from ``__call__``; diffusers 0.42's transformer cannot run one yet).

    Latents ``(B, N, 4C)`` packed, in the text embeddings' dtype (see the module docstring). The
    text ports are ``prompt_embeds`` ``(B, L, D)`` and ``prompt_embeds_mask`` ``(B, L)``: all ones
    where ``encode_prompt`` returns no mask (no padding), which :meth:`predict` passes on as
    ``None`` again.
    """

    pipeline_cls = QwenImagePipeline
    output = "image"
    cfg_argument = "true_cfg_scale"
    condition_ports = ("prompt_embeds", "prompt_embeds_mask")

    def prepare_call(self, call: dict[str, Any]) -> dict[str, Any]:
        """Default sizes, the pipeline's ``check_inputs`` and its warnings, the guidance check of
        guidance-distilled transformers, and the sizes rounded down to multiples of
        ``2 * vae_scale_factor`` as ``prepare_latents`` and ``_unpack_latents`` round them."""
        p = self.pipe
        height = call["height"] or p.default_sample_size * p.vae_scale_factor
        width = call["width"] or p.default_sample_size * p.vae_scale_factor
        p.check_inputs(
            call["prompt"],
            height,
            width,
            negative_prompt=call["negative_prompt"],
            callback_on_step_end_tensor_inputs=call["callback_on_step_end_tensor_inputs"],
            max_sequence_length=call["max_sequence_length"],
        )
        prompt_list(call["prompt"])
        scale, has_negative = call["true_cfg_scale"], call["negative_prompt"] is not None
        if scale > 1 and not has_negative:
            logger.warning("true_cfg_scale=%s but no negative_prompt: classifier-free guidance is off", scale)
        elif scale <= 1 and has_negative:
            logger.warning(
                "negative_prompt is given but true_cfg_scale=%s <= 1: classifier-free guidance is off", scale
            )
        distilled = p.transformer.config.guidance_embeds
        if distilled and call["guidance_scale"] is None:
            raise ValueError("guidance_scale is required for guidance-distilled model.")
        if not distilled and call["guidance_scale"] is not None:
            logger.warning("guidance_scale=%s is ignored: the model is not guidance-distilled", call["guidance_scale"])
        multiple = p.vae_scale_factor * 2
        return call | {"height": int(height) // multiple * multiple, "width": int(width) // multiple * multiple}

    def guided(self, call: Mapping[str, Any]) -> bool:
        # QwenImagePipeline's do_true_cfg (negative embeddings are not a graph input)
        return call["true_cfg_scale"] > 1 and call["negative_prompt"] is not None

    def model_for(
        self, step: int, t: torch.Tensor, call: Mapping[str, Any], state: Mapping[str, Any]
    ) -> tuple[str, float]:
        # guidance_scale is the distilled guidance embedding; the two-branch scale is true_cfg_scale
        return "transformer", float(call["true_cfg_scale"])

    def encode(self, call: Mapping[str, Any], guided: bool) -> dict[str, torch.Tensor]:
        """``encode_prompt`` on the prompts, and on the negative prompts when ``guided``."""
        out: dict[str, torch.Tensor] = {}
        for prefix, prompt in [("", call["prompt"]), ("negative_", call["negative_prompt"])][: 2 if guided else 1]:
            embeds, mask = self.pipe.encode_prompt(
                prompt=prompt,
                device=self.execution_device,
                num_images_per_prompt=call["num_images_per_prompt"],
                max_sequence_length=call["max_sequence_length"],
            )
            if mask is None:  # encode_prompt's "no padding": a port carries a tensor
                mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
            out |= {f"{prefix}prompt_embeds": embeds, f"{prefix}prompt_embeds_mask": mask}
        return out

    def prepare_latents(
        self, call: Mapping[str, Any], cond: Mapping[str, torch.Tensor], generator: torch.Generator | None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The pipeline's ``prepare_latents`` (packed noise), ``img_shapes`` and the guidance
        tensor of guidance-distilled transformers."""
        p = self.pipe
        device = self.execution_device
        batch = len(prompt_list(call["prompt"]))
        latents = p.prepare_latents(
            batch * call["num_images_per_prompt"],
            p.transformer.config.in_channels // 4,
            call["height"],
            call["width"],
            cond["prompt_embeds"].dtype,
            device,
            generator,
            None,
        )
        # as __call__ builds it: one entry per prompt (not per image)
        img_shapes = [
            [(1, call["height"] // p.vae_scale_factor // 2, call["width"] // p.vae_scale_factor // 2)]
        ] * batch
        guidance = None
        if p.transformer.config.guidance_embeds:
            guidance = torch.full([1], call["guidance_scale"], device=device, dtype=torch.float32)
            guidance = guidance.expand(latents.shape[0])
        attention_kwargs = call["attention_kwargs"]
        return latents, {
            "img_shapes": img_shapes,
            "guidance": guidance,
            "attention_kwargs": attention_kwargs if attention_kwargs is not None else {},
        }

    def set_timesteps(
        self, scheduler: Any, call: Mapping[str, Any], latents: torch.Tensor, state: dict[str, Any]
    ) -> torch.Tensor:
        """``QwenImagePipeline``'s sigmas (``linspace(1, 1/n, n)`` unless given) shifted by ``mu``
        of the image sequence length."""
        steps = call["num_inference_steps"]
        sigmas: Any = np.linspace(1.0, 1 / steps, steps) if call["sigmas"] is None else call["sigmas"]
        mu = calculate_shift(
            latents.shape[1],
            scheduler.config.get("base_image_seq_len", 256),
            scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.5),
            scheduler.config.get("max_shift", 1.15),
        )
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.execution_device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        return timesteps

    def predict(
        self,
        model: nn.Module,
        latents: torch.Tensor,
        t: torch.Tensor,
        cond: Mapping[str, torch.Tensor],
        call: Mapping[str, Any],
        state: dict[str, Any],
    ) -> torch.Tensor:
        timestep = t.expand(latents.shape[0]).to(latents.dtype)
        mask = cond["prompt_embeds_mask"]
        return model(
            hidden_states=latents,
            timestep=timestep / 1000,
            guidance=state["guidance"],
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,
            encoder_hidden_states=cond["prompt_embeds"],
            img_shapes=state["img_shapes"],
            attention_kwargs=state["attention_kwargs"],
            return_dict=False,
        )[0]

    def guide(
        self,
        pred: torch.Tensor,
        pred_uncond: torch.Tensor,
        scale: float,
        call: Mapping[str, Any],
        state: dict[str, Any],
    ) -> torch.Tensor:
        """Classifier-free guidance rescaled to the conditional prediction's per-token norm."""
        comb_pred = pred_uncond + scale * (pred - pred_uncond)
        cond_norm = torch.norm(pred, dim=-1, keepdim=True)
        noise_norm = torch.norm(comb_pred, dim=-1, keepdim=True)
        return comb_pred * (cond_norm / noise_norm)

    def decode(
        self, latents: torch.Tensor, call: Mapping[str, Any], extras: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """Unpack, de-normalise with the VAE's latent statistics, decode the single frame:
        ``(B, 3, H, W)`` in [-1, 1]."""
        p = self.pipe
        vae = p.vae
        latents = p._unpack_latents(latents, call["height"], call["width"], p.vae_scale_factor).to(vae.dtype)
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        return vae.decode(latents / inv_std + mean, return_dict=False)[0][:, :, 0]


# ---- tiny preset --------------------------------------------------------------------------------

QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # pad=0, then the chat markers
TEXTS = ("a red circle moving left", "blurry static")  # default extra words of the tiny tokenizer


def prompt_template() -> tuple[str, int]:
    """``QwenImagePipeline``'s prompt template and the number of its leading tokens the pipeline
    drops (set in ``__init__``: read from a pipeline built without components)."""
    pipe: Any = QwenImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)
    return pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx


def build_qwen_tokenizer(texts: Sequence[str] = TEXTS) -> Qwen2Tokenizer:
    """A byte-level BPE ``Qwen2Tokenizer`` trained locally on the pipeline's prompt template and
    ``texts``: their words are single tokens (so the template's system prefix is the
    ``prompt_template_encode_start_idx`` tokens the pipeline drops, as with the real vocabulary),
    every other text falls back to bytes. Deterministic: the same texts give the same vocabulary."""
    template, _ = prompt_template()
    corpus = [template.replace("{}", text) for text in texts] or [template.replace("{}", "")]
    qwen_pre = Qwen2Tokenizer().backend_tokenizer  # the normalizer and pre-tokenizer to train under
    tok = Tokenizer(models.BPE())
    tok.normalizer = qwen_pre.normalizer
    tok.pre_tokenizer = qwen_pre.pre_tokenizer
    tok.add_special_tokens(list(QWEN_SPECIAL_TOKENS))
    trainer = trainers.BpeTrainer(
        vocab_size=1 << 16,  # never reached: merges stop once every word is one token
        special_tokens=list(QWEN_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    model = json.loads(tok.to_str())["model"]
    pad, *markers = QWEN_SPECIAL_TOKENS
    return Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=cast(Any, [tuple(m) for m in model["merges"]]),  # the BPE model takes pairs
        unk_token=pad,
        eos_token=pad,
        pad_token=pad,
        extra_special_tokens=markers,
    )


def build_tiny_qwenimage_pipeline(*, seed: int = 0, texts: Sequence[str] = TEXTS) -> QwenImagePipeline:
    """Random-weight ``QwenImagePipeline`` components from small configs (Qwen2.5-VL with 2 text
    layers of width 16, a 1-block vision tower); weights are a pure function of ``seed``. The VAE
    downsamples by 4 (images are multiples of 8 pixels)."""
    tokenizer = build_qwen_tokenizer(texts)
    pad, im_start, im_end = (tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS)
    z_dim = 4
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Qwen2_5_VLForConditionalGeneration(
            Qwen2_5_VLConfig(
                text_config={
                    "vocab_size": len(tokenizer),
                    "hidden_size": 16,
                    "intermediate_size": 32,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 2,
                    "num_key_value_heads": 2,
                    "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e6},
                    "bos_token_id": im_start,
                    "eos_token_id": im_end,
                    "pad_token_id": pad,
                },
                vision_config={
                    "depth": 1,
                    "hidden_size": 16,
                    "intermediate_size": 16,
                    "num_heads": 2,
                    "out_hidden_size": 16,
                },
            )
        )
        vae = AutoencoderKLQwenImage(
            base_dim=z_dim * 6,
            z_dim=z_dim,
            dim_mult=[1, 2, 4],
            num_res_blocks=1,
            temperal_downsample=[False, True],
            latents_mean=[0.1, -0.2, 0.3, 0.0],
            latents_std=[1.5, 0.8, 1.2, 1.0],
        )
        transformer = QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=z_dim * 4,
            out_channels=z_dim,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=16,
            axes_dims_rope=(8, 4, 4),
        )
    for module in (text_encoder, vae, transformer):
        cast(nn.Module, module).eval()  # as from_pretrained returns them
    # Qwen-Image's scheduler config: exponential time shift by mu, a terminal shift
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0,
        use_dynamic_shifting=True,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        base_shift=0.5,
        max_shift=0.9,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )
    return QwenImagePipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )


def save_tiny_qwenimage_pipeline(path: str | Path, *, seed: int = 0, texts: Sequence[str] = TEXTS) -> Path:
    """Build (:func:`build_tiny_qwenimage_pipeline`) and ``save_pretrained`` a tiny
    ``QwenImagePipeline`` into ``path``."""
    path = Path(path)
    pipe: Any = build_tiny_qwenimage_pipeline(seed=seed, texts=texts)
    pipe.save_pretrained(path)
    return path
