"""FLUX.1 text-to-image (``diffusers.FluxPipeline``): the family's hooks of the shared inference
graph (:mod:`mmpipe.models.pipeline_graph`) and its tiny random-weight preset.

Latents: packed ``(B, h/2 * w/2, 4C)`` tokens (2x2 patches of the VAE's ``(B, C, h, w)`` latents),
in the T5 embeddings' dtype as ``FluxPipeline`` keeps them; ``img_ids`` ``(h/2 * w/2, 3)`` and the
guidance-embedding tensor (guidance-distilled checkpoints) ride in the loop's state.

Tiny preset: the real component classes (``FluxTransformer2DModel``, ``AutoencoderKL``,
``CLIPTextModel``, ``T5EncoderModel``, ``FlowMatchEulerDiscreteScheduler``) from small configs,
with tokenizers built locally (nothing is downloaded) and saved with ``save_pretrained``.

Legend: B batch, C latent channels, h/w latent height/width, L text tokens, D text width.
"""

from __future__ import annotations

import logging
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps
from diffusers.utils.torch_utils import get_module_execution_device
from tokenizers import pre_tokenizers
from torch import nn
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5Tokenizer

from mmpipe.models.pipeline_graph import Family, prompt_list

logger = logging.getLogger(__name__)


class FluxFamily(Family):
    """``FluxPipeline``: CLIP's pooled embedding and T5's token embeddings condition an MMDiT;
    ``guidance_scale`` feeds the guidance embedding of guidance-distilled checkpoints
    (``transformer.config.guidance_embeds``), and true classifier-free guidance runs a second
    branch when ``true_cfg_scale > 1`` and a ``negative_prompt`` is given.

    Latents ``(B, N, 4C)`` packed, in the T5 embeddings' dtype (see the module docstring).
    """

    pipeline_cls = FluxPipeline
    output = "image"
    cfg_argument = "true_cfg_scale"
    text_components = ("text_encoder", "text_encoder_2")
    condition_ports = ("prompt_embeds", "pooled_prompt_embeds", "text_ids")

    def prepare_call(self, call: dict[str, Any]) -> dict[str, Any]:
        """Default sizes (``default_sample_size * vae_scale_factor``), the pipeline's
        ``check_inputs``, and the sizes rounded down to multiples of ``2 * vae_scale_factor`` as
        ``prepare_latents`` and ``_unpack_latents`` round them."""
        p = self.pipe
        height = call["height"] or p.default_sample_size * p.vae_scale_factor
        width = call["width"] or p.default_sample_size * p.vae_scale_factor
        p.check_inputs(
            call["prompt"],
            call["prompt_2"],
            height,
            width,
            negative_prompt=call["negative_prompt"],
            negative_prompt_2=call["negative_prompt_2"],
            callback_on_step_end_tensor_inputs=call["callback_on_step_end_tensor_inputs"],
            max_sequence_length=call["max_sequence_length"],
        )
        prompt_list(call["prompt"])
        multiple = p.vae_scale_factor * 2
        return call | {"height": int(height) // multiple * multiple, "width": int(width) // multiple * multiple}

    def guided(self, call: Mapping[str, Any]) -> bool:
        # FluxPipeline's do_true_cfg (negative embeddings are not a graph input)
        return call["true_cfg_scale"] > 1 and call["negative_prompt"] is not None

    def model_for(
        self, step: int, t: torch.Tensor, call: Mapping[str, Any], state: Mapping[str, Any]
    ) -> tuple[str, float]:
        # guidance_scale is the distilled guidance embedding; the two-branch scale is true_cfg_scale
        return "transformer", float(call["true_cfg_scale"])

    def encode(self, call: Mapping[str, Any], guided: bool) -> dict[str, torch.Tensor]:
        """``encode_prompt`` on the prompts, and on the negative prompts when ``guided``."""
        kwargs = call["joint_attention_kwargs"]
        common = {
            "device": self.execution_device,
            "num_images_per_prompt": call["num_images_per_prompt"],
            "max_sequence_length": call["max_sequence_length"],
            "lora_scale": kwargs.get("scale", None) if kwargs is not None else None,
        }
        embeds, pooled, text_ids = self.pipe.encode_prompt(prompt=call["prompt"], prompt_2=call["prompt_2"], **common)
        out = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled, "text_ids": text_ids}
        if guided:
            neg = self.pipe.encode_prompt(prompt=call["negative_prompt"], prompt_2=call["negative_prompt_2"], **common)
            out |= {f"negative_{port}": value for port, value in zip(self.condition_ports, neg, strict=True)}
        return out

    def prepare_latents(
        self, call: Mapping[str, Any], cond: Mapping[str, torch.Tensor], generator: torch.Generator | None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The pipeline's ``prepare_latents`` (packed noise and ``img_ids``) and the guidance
        tensor of guidance-distilled transformers."""
        p = self.pipe
        device = self.execution_device
        batch = len(prompt_list(call["prompt"])) * call["num_images_per_prompt"]
        latents, img_ids = p.prepare_latents(
            batch,
            p.transformer.config.in_channels // 4,
            call["height"],
            call["width"],
            cond["prompt_embeds"].dtype,
            device,
            generator,
            None,
        )
        guidance = None
        if p.transformer.config.guidance_embeds:
            guidance = torch.full([1], call["guidance_scale"], device=device, dtype=torch.float32)
            guidance = guidance.expand(latents.shape[0])
        attention_kwargs = call["joint_attention_kwargs"]
        return latents, {
            "img_ids": img_ids,
            "guidance": guidance,
            "attention_kwargs": attention_kwargs if attention_kwargs is not None else {},
        }

    def set_timesteps(
        self, scheduler: Any, call: Mapping[str, Any], latents: torch.Tensor, state: dict[str, Any]
    ) -> torch.Tensor:
        """``FluxPipeline``'s sigmas (``linspace(1, 1/n, n)`` unless given) shifted by ``mu`` of the
        image sequence length."""
        steps = call["num_inference_steps"]
        sigmas: Any = np.linspace(1.0, 1 / steps, steps) if call["sigmas"] is None else call["sigmas"]
        if hasattr(scheduler.config, "use_flow_sigmas") and scheduler.config.use_flow_sigmas:
            sigmas = None
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
        return model(
            hidden_states=latents,
            timestep=timestep / 1000,
            guidance=state["guidance"],
            pooled_projections=cond["pooled_prompt_embeds"],
            encoder_hidden_states=cond["prompt_embeds"],
            txt_ids=cond["text_ids"],
            img_ids=state["img_ids"],
            joint_attention_kwargs=state["attention_kwargs"],
            return_dict=False,
        )[0]

    def decode(
        self, latents: torch.Tensor, call: Mapping[str, Any], extras: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """Unpack, undo the VAE's scaling and shift, decode: ``(B, 3, H, W)`` in [-1, 1]."""
        p = self.pipe
        vae = p.vae
        latents = p._unpack_latents(latents, call["height"], call["width"], p.vae_scale_factor)
        latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
        # the cast is a no-op where the pipeline runs; it lets bf16 latents meet a float32 VAE
        latents = latents.to(get_module_execution_device(vae), vae.dtype)
        return vae.decode(latents, return_dict=False)[0]


# ---- tiny preset --------------------------------------------------------------------------------

CLIP_SPECIAL_TOKENS = ("<|startoftext|>", "<|endoftext|>")  # bos=0, eos=pad=1
T5_SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # T5 order: pad=0, eos=1, unk=2
TEXT_LENGTH = 77  # CLIP's context: the pipeline pads CLIP prompts to tokenizer.model_max_length


def build_clip_tokenizer() -> CLIPTokenizer:
    """A byte-level CLIP tokenizer without merges: every byte (and its end-of-word form) is a token,
    so any text tokenizes, one token a byte; ``model_max_length`` is :data:`TEXT_LENGTH`."""
    vocab = {tok: i for i, tok in enumerate(CLIP_SPECIAL_TOKENS)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(char, len(vocab))
        vocab.setdefault(char + "</w>", len(vocab))
    bos, eos = CLIP_SPECIAL_TOKENS
    return CLIPTokenizer(
        vocab=vocab, merges=[], unk_token=eos, bos_token=bos, eos_token=eos, pad_token=eos, model_max_length=TEXT_LENGTH
    )


def build_t5_tokenizer() -> T5Tokenizer:
    """A character-level T5 (Unigram) tokenizer: the word boundary ``▁`` and every printable ASCII
    character, ``</s>`` appended; other characters are ``<unk>``."""
    chars = sorted(set(string.ascii_letters + string.digits + string.punctuation))
    vocab = [(tok, 0.0) for tok in T5_SPECIAL_TOKENS] + [("▁", -2.0)] + [(c, -5.0) for c in chars]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def build_tiny_flux_pipeline(*, seed: int = 0, guidance_embeds: bool = False) -> FluxPipeline:
    """Random-weight ``FluxPipeline`` components from small configs; weights are a pure function of
    ``seed``. ``guidance_embeds=True`` builds a guidance-distilled transformer (FLUX.1-dev style).
    The VAE downsamples by 2 (images are multiples of 4 pixels)."""
    tokenizer, tokenizer_2 = build_clip_tokenizer(), build_t5_tokenizer()
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(tokenizer),
                hidden_size=32,
                intermediate_size=37,
                projection_dim=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=TEXT_LENGTH,
                hidden_act="gelu",
                bos_token_id=bos,
                eos_token_id=eos,
                pad_token_id=eos,
            )
        )
        text_encoder_2 = T5EncoderModel(
            T5Config(
                vocab_size=len(tokenizer_2),
                d_model=32,
                d_kv=8,
                d_ff=37,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                feed_forward_proj="gated-gelu",
                pad_token_id=0,
                eos_token_id=1,
            )
        )
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            block_out_channels=(8, 16),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=4,
            sample_size=32,
            use_quant_conv=False,
            use_post_quant_conv=False,
            shift_factor=0.0609,
            scaling_factor=1.5035,
        )
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,  # 4 latent channels x 2x2 packing
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            guidance_embeds=guidance_embeds,
            axes_dims_rope=(4, 4, 8),
        )
    for module in (text_encoder, text_encoder_2, vae, transformer):
        cast(nn.Module, module).eval()  # as from_pretrained returns them
    # FLUX.1's scheduler config: the shift follows the image sequence length (mu)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        base_shift=0.5,
        max_shift=1.15,
    )
    return FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


def save_tiny_flux_pipeline(path: str | Path, *, seed: int = 0, guidance_embeds: bool = False) -> Path:
    """Build (:func:`build_tiny_flux_pipeline`) and ``save_pretrained`` a tiny ``FluxPipeline`` into
    ``path``."""
    path = Path(path)
    pipe: Any = build_tiny_flux_pipeline(seed=seed, guidance_embeds=guidance_embeds)
    pipe.save_pretrained(path)
    return path
