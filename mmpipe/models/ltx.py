"""LTX-Video text-to-video (``diffusers.LTXPipeline``) as a family of the shared graph
(:mod:`mmpipe.models.pipeline_graph`), and its tiny random preset.

Text: T5 (``text_encoder``) hidden states and their attention mask, in the text encoder's dtype (the
pipeline feeds the DiT in that dtype). The scheduler's sigmas are shifted by the video's token count
(``calculate_shift``); the DiT takes the latent grid size and a rope interpolation scale
``(vae_temporal / frame_rate, vae_spatial, vae_spatial)``; guidance is the diffusers formula with
``guidance_rescale``. The decode de-normalises with the VAE's latent statistics and, for a VAE with
timestep conditioning (LTX-Video 0.9.1 and later), mixes in noise by ``decode_noise_scale`` and
decodes at ``decode_timestep``.

Latents packed ``(B, t/pt * h/p * w/p, C * pt * p * p)`` float32 (``t = (T - 1) // 8 + 1``,
``h, w = H / 32, W / 32`` for the released VAE; ``p``, ``pt`` the DiT's patch sizes), as the pipeline
keeps them; unpacked to ``(B, C, t, h, w)`` for the decode.

Training graph (:func:`build_ltx_training_graph`, from an ``LTXPipeline`` directory)::

    input.{input_ids, attention_mask} -> text.{context, context_mask} -> dit.{context, context_mask}
    input.video -> vae.video;  vae.latents -> dit.latents -> dit.loss

Legend: B batch, C latent channels, t/h/w latent frames/height/width, T/H/W pixel frames/height/width.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from diffusers import (
    AutoencoderKLLTXVideo,
    FlowMatchEulerDiscreteScheduler,
    LTXPipeline,
    LTXVideoTransformer3DModel,
)
from diffusers.pipelines.ltx.pipeline_ltx import (
    XLA_AVAILABLE,
    calculate_shift,
    rescale_noise_cfg,
    retrieve_timesteps,
)
from diffusers.utils.torch_utils import randn_tensor
from torch import nn
from transformers import AutoTokenizer, T5Config, T5EncoderModel

from mmpipe.graph import Graph, TensorSpec
from mmpipe.models.pipeline_graph import Family, prompt_list
from mmpipe.models.wan import TINY_TEXTS, build_word_tokenizer, flow_shift_of
from mmpipe.parallel.modules import SequenceState
from mmpipe.stages import LTXDiTFlowMatchingStage, LTXT5TextEncoderStage, LTXVAEEncodeStage
from mmpipe.stages.dit import ltx_sequence_hooks


class LTXFamily(Family):
    """``LTXPipeline.__call__`` as the shared graph's hooks.

    Condition ports (each with its ``negative_`` twin when ``guidance_scale > 1``): ``prompt_embeds``
    ``(B, L, D)`` and ``prompt_attention_mask`` ``(B, L)`` bool, as ``encode_prompt`` returns them.
    State: the latent grid ``(t, h, w)`` and the rope interpolation scale.

    ``LTXPipeline`` runs both guidance branches as one batch of ``2B``; the graph runs them as two
    calls of ``B`` (equal on CPU float32 within the parity tolerance). The decode's noise (drawn
    from the call's generator after the loop, which draws nothing from it) is drawn right after the
    initial latents and travels to the decode on the ``denoise -> decode`` edge (``decode_noise``).
    """

    pipeline_cls = LTXPipeline
    condition_ports = ("prompt_embeds", "prompt_attention_mask")
    decode_ports = ("decode_noise",)

    @classmethod
    def sequence_parallel(cls, pipeline_config: Mapping[str, Any]) -> str | None:
        return None

    def apply_sequence_hooks(self, model: nn.Module, state: SequenceState) -> None:
        ltx_sequence_hooks(model, state)

    def _pack(self, latents_BCthw: torch.Tensor) -> torch.Tensor:
        p = self.pipe
        return cast(
            torch.Tensor,
            p._pack_latents(latents_BCthw, p.transformer_spatial_patch_size, p.transformer_temporal_patch_size),
        )

    def _unpack(self, latents_BSD: torch.Tensor, size: tuple[int, int, int]) -> torch.Tensor:
        p = self.pipe
        return cast(
            torch.Tensor,
            p._unpack_latents(latents_BSD, *size, p.transformer_spatial_patch_size, p.transformer_temporal_patch_size),
        )

    def prepare_call(self, call: dict[str, Any]) -> dict[str, Any]:
        # The pipeline rounds nothing: height / width not divisible by 32 are refused here, and the
        # latent grid is (num_frames - 1) // 8 + 1, H / 32, W / 32 (latent_size).
        self.pipe.check_inputs(
            prompt=call["prompt"],
            height=call["height"],
            width=call["width"],
            callback_on_step_end_tensor_inputs=call["callback_on_step_end_tensor_inputs"],
        )
        prompt_list(call["prompt"])
        return call

    def latent_size(self, call: Mapping[str, Any]) -> tuple[int, int, int]:
        """The latent grid ``(t, h, w)`` of ``call``'s video, as ``__call__`` computes it."""
        p = self.pipe
        frames = (call["num_frames"] - 1) // p.vae_temporal_compression_ratio + 1
        return (
            frames,
            call["height"] // p.vae_spatial_compression_ratio,
            call["width"] // p.vae_spatial_compression_ratio,
        )

    def guided(self, call: Mapping[str, Any]) -> bool:
        return bool(call["guidance_scale"] > 1.0)  # LTXPipeline.do_classifier_free_guidance

    def encode(self, call: Mapping[str, Any], guided: bool) -> dict[str, torch.Tensor]:
        embeds, mask, neg, neg_mask = self.pipe.encode_prompt(
            prompt=call["prompt"],
            negative_prompt=call["negative_prompt"],
            do_classifier_free_guidance=guided,
            num_videos_per_prompt=call["num_videos_per_prompt"],
            max_sequence_length=call["max_sequence_length"],
            device=self.execution_device,
        )
        out = {"prompt_embeds": embeds, "prompt_attention_mask": mask}
        if guided:
            out |= {"negative_prompt_embeds": neg, "negative_prompt_attention_mask": neg_mask}
        return out

    def prepare_latents(
        self, call: Mapping[str, Any], cond: Mapping[str, torch.Tensor], generator: torch.Generator | None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        p = self.pipe
        device = self.execution_device
        batch = len(prompt_list(call["prompt"])) * call["num_videos_per_prompt"]
        latents = p.prepare_latents(
            batch,
            p.transformer.config.in_channels,
            call["height"],
            call["width"],
            call["num_frames"],
            torch.float32,
            device,
            generator,
            None,
        )
        size = self.latent_size(call)
        dtype = cond["prompt_embeds"].dtype
        noise = None
        if call["output_type"] != "latent" and p.vae.config.timestep_conditioning:
            # the pipeline's next draw from the generator: the decode's noise (unpacked latents' shape)
            shape = p._unpack_latents(
                latents, *size, p.transformer_spatial_patch_size, p.transformer_temporal_patch_size
            ).shape
            noise = randn_tensor(shape, generator=generator, device=device, dtype=dtype)
        spatial = p.vae_spatial_compression_ratio
        rope = (p.vae_temporal_compression_ratio / call["frame_rate"], spatial, spatial)
        # The loop keeps them unpacked (B, C, t, h, w), so a sequence-parallel rank takes whole latent
        # frames as every family's does; packing is a permutation, and the scheduler's step is
        # elementwise, so the values are the pipeline's bit for bit (finish packs them back).
        state = {"latent_size": size, "rope_interpolation_scale": rope, "decode_noise": noise}
        return self._unpack(latents, size), state

    def set_timesteps(
        self, scheduler: Any, call: Mapping[str, Any], latents: torch.Tensor, state: dict[str, Any]
    ) -> torch.Tensor:
        frames, height, width = state["latent_size"]
        steps = call["num_inference_steps"]
        sigmas: Any = np.linspace(1.0, 1 / steps, steps)
        mu = calculate_shift(
            frames * height * width,
            scheduler.config.get("base_image_seq_len", 256),
            scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.5),
            scheduler.config.get("max_shift", 1.15),
        )
        device = "cpu" if XLA_AVAILABLE else latents.device
        timesteps, _ = retrieve_timesteps(scheduler, steps, device, call["timesteps"], sigmas=sigmas, mu=mu)
        return cast(torch.Tensor, timesteps)

    def predict(
        self,
        model: nn.Module,
        latents: torch.Tensor,
        t: torch.Tensor,
        cond: Mapping[str, torch.Tensor],
        call: Mapping[str, Any],
        state: dict[str, Any],
    ) -> torch.Tensor:
        # the whole clip's grid: a sequence-parallel rank's latents hold some of its frames, and the
        # rotary tables the module computes for the grid are cut to them (ltx_sequence_hooks)
        frames, height, width = state["latent_size"]
        embeds = cond["prompt_embeds"]
        # two calls where the pipeline makes one ("cond_uncond"): one cache context per branch
        pred: torch.Tensor = model(
            hidden_states=self._pack(latents).to(embeds.dtype),
            encoder_hidden_states=embeds,
            timestep=t.expand(latents.shape[0]),
            encoder_attention_mask=cond["prompt_attention_mask"],
            num_frames=frames,
            height=height,
            width=width,
            rope_interpolation_scale=state["rope_interpolation_scale"],
            attention_kwargs=call["attention_kwargs"],
            return_dict=False,
        )[0]
        return self._unpack(pred.float(), (latents.shape[2], height, width))

    def guide(
        self,
        pred: torch.Tensor,
        pred_uncond: torch.Tensor,
        scale: float,
        call: Mapping[str, Any],
        state: dict[str, Any],
    ) -> torch.Tensor:
        guided = pred_uncond + scale * (pred - pred_uncond)
        if call["guidance_rescale"] > 0:  # its standard deviations reduce the packed tensors, as the pipeline's
            size = state["latent_size"]
            packed = rescale_noise_cfg(self._pack(guided), self._pack(pred), guidance_rescale=call["guidance_rescale"])
            guided = self._unpack(packed, size)
        return guided

    def finish(self, latents: torch.Tensor, call: Mapping[str, Any], state: dict[str, Any]) -> torch.Tensor:
        """The latents packed, as ``__call__`` returns them (``output_type="latent"``) and decodes them."""
        return self._pack(latents)

    def decode(
        self, latents: torch.Tensor, call: Mapping[str, Any], extras: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        p = self.pipe
        vae = p.vae
        latents = p._unpack_latents(
            latents, *self.latent_size(call), p.transformer_spatial_patch_size, p.transformer_temporal_patch_size
        )
        latents = p._denormalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        latents = latents.to(p.text_encoder.dtype)  # the prompt embeddings' dtype, the pipeline's
        timestep = None
        if vae.config.timestep_conditioning:
            if "decode_noise" not in extras:
                raise ValueError("LTXFamily.decode: no decode noise was drawn (output_type='latent' needs no decode)")
            batch = len(prompt_list(call["prompt"]))
            decode_timestep = call["decode_timestep"]
            if not isinstance(decode_timestep, list):
                decode_timestep = [decode_timestep] * batch
            noise_scale = call["decode_noise_scale"]
            if noise_scale is None:
                noise_scale = decode_timestep
            elif not isinstance(noise_scale, list):
                noise_scale = [noise_scale] * batch
            timestep = torch.tensor(decode_timestep, device=latents.device, dtype=latents.dtype)
            scale = torch.tensor(noise_scale, device=latents.device, dtype=latents.dtype)[:, None, None, None, None]
            latents = (1 - scale) * latents + scale * extras["decode_noise"].to(latents.device)
        video: torch.Tensor = vae.decode(latents.to(vae.dtype), timestep, return_dict=False)[0]
        return video


# ---- training ----------------------------------------------------------------------------------------

LTX_TRAIN_EDGES = (
    ("input.input_ids", "text.input_ids"),
    ("input.attention_mask", "text.attention_mask"),
    ("input.video", "vae.video"),
    ("text.context", "dit.context"),
    ("text.context_mask", "dit.context_mask"),
    ("vae.latents", "dit.latents"),
)


def ltx_vae_compression(vae_config: Mapping[str, Any]) -> tuple[int, int]:
    """``(temporal, spatial)`` compression of an ``AutoencoderKLLTXVideo`` config, as its constructor
    computes them (``vae_temporal_compression_ratio``, ``vae_spatial_compression_ratio``)."""
    scaling = sum(vae_config.get("spatio_temporal_scaling", (True, True, True, False)))
    spatial = vae_config.get("spatial_compression_ratio") or vae_config.get("patch_size", 4) * 2**scaling
    temporal = vae_config.get("temporal_compression_ratio") or vae_config.get("patch_size_t", 1) * 2**scaling
    return int(temporal), int(spatial)


def build_ltx_training_graph(pipeline_dir: str | Path, *, text_len: int, frame_rate: float = 25.0) -> Graph:
    """The flow-matching training graph of a local ``LTXPipeline`` directory: T5 (its context and
    mask, :class:`~mmpipe.stages.LTXT5TextEncoderStage`), the VAE's normalised latents and the DiT
    (:class:`~mmpipe.stages.LTXDiTFlowMatchingStage`) with the rope scale of ``frame_rate``
    (``LTXPipeline.__call__``'s default 25) and the scheduler's shift: with ``use_dynamic_shifting``
    (the released checkpoints) the sampler's resolution-dependent one."""
    root = Path(pipeline_dir)
    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
    sched = FlowMatchEulerDiscreteScheduler.load_config(root / "scheduler")
    vae_config = AutoencoderKLLTXVideo.load_config(root / "vae")
    dynamic = None
    if sched.get("use_dynamic_shifting"):  # the defaults are LTXPipeline.__call__'s
        dynamic = (
            int(sched.get("base_image_seq_len", 256)),
            int(sched.get("max_image_seq_len", 4096)),
            float(sched.get("base_shift", 0.5)),
            float(sched.get("max_shift", 1.15)),
        )
    g = Graph("ltx_train")
    g.add_input("input_ids", TensorSpec(("B", text_len), torch.int64))
    g.add_input("attention_mask", TensorSpec(("B", text_len), torch.int64))
    g.add_input("video", TensorSpec(("B", 3, "T", "H", "W"), torch.float32))
    g.add_stage(LTXT5TextEncoderStage.from_pretrained("text", root / "text_encoder", tokenizer, max_length=text_len))
    g.add_stage(LTXVAEEncodeStage.from_pretrained("vae", root / "vae"))
    g.add_stage(
        LTXDiTFlowMatchingStage.from_pretrained(
            "dit",
            root / "transformer",
            vae_compression=ltx_vae_compression(vae_config),
            frame_rate=frame_rate,
            shift=flow_shift_of(sched),
            dynamic_shift=dynamic,
        )
    )
    for src, dst in LTX_TRAIN_EDGES:
        g.connect(src, dst)
    g.validate()
    return g


# ---- tiny preset -----------------------------------------------------------------------------------


def build_tiny_ltx_pipeline(
    *, seed: int = 0, texts: Sequence[str] = TINY_TEXTS, timestep_conditioning: bool = True
) -> LTXPipeline:
    """An ``LTXPipeline`` of tiny random components of the real classes (nothing is downloaded: the
    T5 word tokenizer is built locally from ``texts``); weights, and the VAE's latent statistics,
    are a pure function of ``seed``. Spatial and temporal compression 4; with
    ``timestep_conditioning`` (LTX-Video 0.9.1's decoder) the decode takes ``decode_timestep`` and
    ``decode_noise_scale``."""
    tokenizer = build_word_tokenizer(texts)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = T5EncoderModel(
            T5Config(
                vocab_size=len(tokenizer),
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        )
        transformer = LTXVideoTransformer3DModel(
            in_channels=8,
            out_channels=8,
            patch_size=1,
            patch_size_t=1,
            num_attention_heads=4,
            attention_head_dim=8,
            cross_attention_dim=32,
            num_layers=1,
            caption_channels=32,
        )
        vae: Any = AutoencoderKLLTXVideo(
            in_channels=3,
            out_channels=3,
            latent_channels=8,
            block_out_channels=(8, 8, 8, 8),
            decoder_block_out_channels=(8, 8, 8, 8),
            layers_per_block=(1, 1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1, 1),
            spatio_temporal_scaling=(True, True, False, False),
            decoder_spatio_temporal_scaling=(True, True, False, False),
            decoder_inject_noise=(False, False, False, False, False),
            upsample_residual=(False, False, False, False),
            upsample_factor=(1, 1, 1, 1),
            timestep_conditioning=timestep_conditioning,
            patch_size=1,
            patch_size_t=1,
            encoder_causal=True,
            decoder_causal=False,
        )
        with torch.no_grad():  # non-trivial latent statistics, so the de-normalisation shows
            vae.latents_mean.copy_(0.2 * torch.randn(vae.latents_mean.shape))
            vae.latents_std.copy_(0.75 + 0.5 * torch.rand(vae.latents_std.shape))
    for module in (text_encoder, transformer, vae):
        cast(nn.Module, module).eval()  # as from_pretrained returns them
    return LTXPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )


def save_tiny_ltx_pipeline(
    path: str | Path, *, seed: int = 0, texts: Sequence[str] = TINY_TEXTS, timestep_conditioning: bool = True
) -> Path:
    """Build (:func:`build_tiny_ltx_pipeline`) and ``save_pretrained`` a tiny pipeline into ``path``
    (the ``LTXPipeline`` layout)."""
    path = Path(path)
    pipe: Any = build_tiny_ltx_pipeline(seed=seed, texts=texts, timestep_conditioning=timestep_conditioning)
    pipe.save_pretrained(path)
    return path
