"""CogVideoX text-to-video (``diffusers.CogVideoXPipeline``): the family's hooks of the shared
inference graph (:mod:`mmpipe.models.pipeline_graph`) and its tiny random-weight preset.

Latents ``(B, t, C, h, w)``: frames before channels, as ``CogVideoXPipeline`` keeps them, in the T5
embeddings' dtype; a v-prediction DDIM or DPM-solver scheduler (``CogVideoXDDIMScheduler``,
``CogVideoXDPMScheduler``) steps them. CogVideoX 1.5 transformers (``patch_size_t``) denoise ``t`` padded
up to a multiple of ``patch_size_t``, and the decode drops the extra frames from the front; the 3-D rotary
embeddings (``use_rotary_positional_embeddings``), the DPM solver's previous prediction and the
scheduler's keyword arguments ride in the loop's state.

Tiny preset: the real component classes (``CogVideoXTransformer3DModel``,
``AutoencoderKLCogVideoX``, ``T5EncoderModel``, a CogVideoX scheduler) from small configs, with a
word-level tokenizer built locally (nothing is downloaded), saved with ``save_pretrained``.

Training graph (:func:`build_cogvideox_training_graph`, from a ``CogVideoXPipeline`` directory)::

    input.{input_ids, attention_mask} -> text.context -> dit.context
    input.video -> vae.video;  vae.latents (B, t, C, h, w) -> dit.latents -> dit.loss

Legend: B batch, C latent channels, t/h/w latent frames/height/width, T/H/W pixel frames/height/width.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, cast

import torch
from diffusers import (
    AutoencoderKLCogVideoX,
    CogVideoXDDIMScheduler,
    CogVideoXDPMScheduler,
    CogVideoXPipeline,
    CogVideoXTransformer3DModel,
)
from diffusers.pipelines.cogvideo.pipeline_cogvideox import retrieve_timesteps
from torch import nn
from transformers import AutoTokenizer, T5Config, T5EncoderModel

from mmpipe.data import caption_vocabulary
from mmpipe.graph import Graph, TensorSpec
from mmpipe.models.pipeline_graph import Family, prompt_list
from mmpipe.models.wan import build_word_tokenizer
from mmpipe.stages import CogVideoXDiTStage, CogVideoXT5TextEncoderStage, CogVideoXVAEEncodeStage

logger = logging.getLogger(__name__)


class CogVideoXFamily(Family):
    """``CogVideoXPipeline``: T5 embeddings condition a 3-D full-attention transformer predicting
    ``v``; ``use_dynamic_cfg`` raises the guidance scale along a cosine of the timestep, and the DPM
    solver steps with the previous step's prediction (both transcribed from ``__call__``).

    Latents ``(B, t, C, h, w)`` in the T5 embeddings' dtype (see the module docstring).
    """

    pipeline_cls = CogVideoXPipeline

    def prepare_call(self, call: dict[str, Any]) -> dict[str, Any]:
        """Default sizes (the transformer's ``sample_*`` sizes) and the pipeline's ``check_inputs``;
        ``num_videos_per_prompt`` is 1, as ``__call__`` sets it whatever is given."""
        p = self.pipe
        cfg = p.transformer.config
        height = call["height"] or cfg.sample_height * p.vae_scale_factor_spatial
        width = call["width"] or cfg.sample_width * p.vae_scale_factor_spatial
        frames = call["num_frames"] or cfg.sample_frames
        p.check_inputs(
            call["prompt"], height, width, call["negative_prompt"], call["callback_on_step_end_tensor_inputs"]
        )
        prompt_list(call["prompt"])
        if call["num_videos_per_prompt"] != 1:
            logger.warning(
                "CogVideoXPipeline generates one video per prompt; ignoring num_videos_per_prompt=%s",
                call["num_videos_per_prompt"],
            )
        return call | {"height": height, "width": width, "num_frames": frames, "num_videos_per_prompt": 1}

    def padding_frames(self, call: Mapping[str, Any]) -> int:
        """The latent frames ``__call__`` draws beyond the call's (CogVideoX 1.5: up to a multiple
        of the transformer's ``patch_size_t``) and drops from the front before decoding."""
        p = self.pipe
        latent_frames = (call["num_frames"] - 1) // p.vae_scale_factor_temporal + 1
        patch_t = p.transformer.config.patch_size_t
        if patch_t is None or latent_frames % patch_t == 0:
            return 0
        return int(patch_t - latent_frames % patch_t)

    def guided(self, call: Mapping[str, Any]) -> bool:
        return float(call["guidance_scale"]) > 1.0  # CogVideoXPipeline's do_classifier_free_guidance

    def encode(self, call: Mapping[str, Any], guided: bool) -> dict[str, torch.Tensor]:
        """``encode_prompt`` on the prompts (and the negative prompts, ``""`` by default, when ``guided``)."""
        pos, neg = self.pipe.encode_prompt(
            call["prompt"],
            call["negative_prompt"],
            guided,
            num_videos_per_prompt=1,
            max_sequence_length=call["max_sequence_length"],
            device=self.execution_device,
        )
        return {"prompt_embeds": pos} | ({"negative_prompt_embeds": neg} if neg is not None else {})

    def prepare_latents(
        self, call: Mapping[str, Any], cond: Mapping[str, torch.Tensor], generator: torch.Generator | None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The pipeline's ``prepare_latents`` (with CogVideoX 1.5's padding frames), its rotary
        embeddings and its scheduler keywords (``eta``, and the generator the DPM solver's noise is
        drawn from after the initial latents, as in ``__call__``)."""
        p = self.pipe
        device = self.execution_device
        dtype = cond["prompt_embeds"].dtype
        frames = call["num_frames"] + self.padding_frames(call) * p.vae_scale_factor_temporal
        latents = p.prepare_latents(
            len(prompt_list(call["prompt"])),
            p.transformer.config.in_channels,
            frames,
            call["height"],
            call["width"],
            dtype,
            device,
            generator,
            None,
        )
        rotary = None
        if p.transformer.config.use_rotary_positional_embeddings:
            rotary = p._prepare_rotary_positional_embeddings(call["height"], call["width"], latents.size(1), device)
        return latents, {
            "dtype": dtype,
            "image_rotary_emb": rotary,
            "step_kwargs": p.prepare_extra_step_kwargs(generator, call["eta"]),
            "old_pred_original_sample": None,  # the DPM solver's previous x0 prediction
        }

    def set_timesteps(
        self, scheduler: Any, call: Mapping[str, Any], latents: torch.Tensor, state: dict[str, Any]
    ) -> torch.Tensor:
        """``retrieve_timesteps`` (custom ``timesteps`` too); the schedule's length is the step
        count ``use_dynamic_cfg`` reads."""
        timesteps, steps = retrieve_timesteps(
            scheduler, call["num_inference_steps"], self.execution_device, call["timesteps"]
        )
        state |= {"scheduler": scheduler, "timesteps": timesteps, "num_inference_steps": steps}
        return cast(torch.Tensor, timesteps)

    def model_for(
        self, step: int, t: torch.Tensor, call: Mapping[str, Any], state: Mapping[str, Any]
    ) -> tuple[str, float]:
        """The transformer; with ``use_dynamic_cfg`` the scale of ``__call__``'s cosine formula
        (on the raw timestep, as the pipeline computes it)."""
        scale = float(call["guidance_scale"])
        if call["use_dynamic_cfg"]:
            n = state["num_inference_steps"]
            scale = 1 + scale * ((1 - math.cos(math.pi * ((n - t.item()) / n) ** 5.0)) / 2)
        return "transformer", scale

    def predict(
        self,
        model: nn.Module,
        latents: torch.Tensor,
        t: torch.Tensor,
        cond: Mapping[str, torch.Tensor],
        call: Mapping[str, Any],
        state: dict[str, Any],
    ) -> torch.Tensor:
        """One branch of ``__call__``'s batched transformer call, as float32."""
        model_input = state["scheduler"].scale_model_input(latents, t)
        pred = model(
            hidden_states=model_input,
            encoder_hidden_states=cond["prompt_embeds"],
            timestep=t.expand(model_input.shape[0]),
            image_rotary_emb=state["image_rotary_emb"],
            attention_kwargs=call["attention_kwargs"],
            return_dict=False,
        )[0]
        return cast(torch.Tensor, pred.float())

    def step(
        self, scheduler: Any, pred: torch.Tensor, t: torch.Tensor, latents: torch.Tensor, state: dict[str, Any]
    ) -> torch.Tensor:
        """DDIM's step, or the DPM solver's with the previous timestep and x0 prediction; the
        latents back in the embeddings' dtype."""
        kwargs = state["step_kwargs"]
        if isinstance(scheduler, CogVideoXDPMScheduler):  # as __call__ tells them apart
            i = state["step"]
            solver: Any = scheduler
            latents, state["old_pred_original_sample"] = solver.step(
                pred,
                state["old_pred_original_sample"],
                t,
                state["timesteps"][i - 1] if i > 0 else None,
                latents,
                **kwargs,
                return_dict=False,
            )
        else:
            latents = scheduler.step(pred, t, latents, **kwargs, return_dict=False)[0]
        return latents.to(state["dtype"])

    def decode(
        self, latents: torch.Tensor, call: Mapping[str, Any], extras: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """Drop CogVideoX 1.5's padding frames, then the pipeline's ``decode_latents``: ``(B, 3, T,
        H, W)`` in [-1, 1]."""
        p = self.pipe
        latents = latents[:, self.padding_frames(call) :]
        # the cast is a no-op where the pipeline runs; it lets bf16 latents meet a float32 VAE
        return cast(torch.Tensor, p.decode_latents(latents.to(p.vae.dtype)))


# ---- training ----------------------------------------------------------------------------------

COGVIDEOX_TRAIN_EDGES = (
    ("input.input_ids", "text.input_ids"),
    ("input.attention_mask", "text.attention_mask"),
    ("input.video", "vae.video"),
    ("text.context", "dit.context"),
    ("vae.latents", "dit.latents"),
)

#: the released checkpoints' scheduler configs, but for ``snr_shift_scale`` (CogVideoX-2b 3.0,
#: -5b and 1.5 1.0): v-prediction, zero-SNR betas, trailing timesteps
COGVIDEOX_SCHEDULER_CONFIG: dict[str, Any] = {
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "clip_sample": False,
    "prediction_type": "v_prediction",
    "rescale_betas_zero_snr": True,
    "set_alpha_to_one": True,
    "steps_offset": 0,
    "timestep_spacing": "trailing",
}

#: the schedulers a CogVideoX pipeline directory may name (both share ``alphas_cumprod``'s recipe)
COGVIDEOX_SCHEDULERS: dict[str, Any] = {
    "CogVideoXDDIMScheduler": CogVideoXDDIMScheduler,
    "CogVideoXDPMScheduler": CogVideoXDPMScheduler,
}


def check_cogvideox_text_len(text_len: int, dit_config: Mapping[str, Any]) -> None:
    """A ``ValueError`` unless ``text_len`` (``model.text_len``) is the transformer's
    ``max_text_seq_length``, the length prompts are padded to."""
    max_text = int(dit_config.get("max_text_seq_length", 226))
    if text_len != max_text:
        raise ValueError(
            f"model.text_len={text_len}: a CogVideoXPipeline's prompts are padded to the transformer's "
            f"max_text_seq_length={max_text}; set model.text_len={max_text}"
        )


def cogvideox_vae_spatial_scale(vae_config: Mapping[str, Any]) -> int:
    """The spatial compression of an ``AutoencoderKLCogVideoX`` config, as ``CogVideoXPipeline``
    computes its ``vae_scale_factor_spatial``."""
    return int(2 ** (len(vae_config.get("block_out_channels", (128, 256, 256, 512))) - 1))


def build_cogvideox_training_graph(pipeline_dir: str | Path, *, text_len: int) -> Graph:
    """The v-prediction training graph of a local ``CogVideoXPipeline`` directory: T5 on the
    pipeline's tokens (:class:`~mmpipe.stages.CogVideoXT5TextEncoderStage`), the VAE's scaled latents
    (:class:`~mmpipe.stages.CogVideoXVAEEncodeStage`) and the DiT trained on the directory's scheduler
    (:class:`~mmpipe.stages.CogVideoXDiTStage`).

    ``text_len`` (``model.text_len``) must be the transformer's ``max_text_seq_length`` (226 for the
    released checkpoints): the pipeline pads prompts to it, the DiT's sin-cos positions cover exactly
    that many text tokens, and generating from the trained run pads to ``model.text_len``."""
    root = Path(pipeline_dir)
    check_cogvideox_text_len(text_len, CogVideoXTransformer3DModel.load_config(root / "transformer"))
    sched_name = CogVideoXDDIMScheduler.load_config(root / "scheduler").get("_class_name")
    if sched_name not in COGVIDEOX_SCHEDULERS:
        raise ValueError(
            f"model.path={str(root)!r}: scheduler {sched_name!r} is not a CogVideoX scheduler "
            f"(choose from {sorted(COGVIDEOX_SCHEDULERS)})"
        )
    scheduler = COGVIDEOX_SCHEDULERS[sched_name].from_pretrained(root / "scheduler")
    vae_spatial = cogvideox_vae_spatial_scale(AutoencoderKLCogVideoX.load_config(root / "vae"))
    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
    g = Graph("cogvideox_train")
    g.add_input("input_ids", TensorSpec(("B", text_len), torch.int64))
    g.add_input("attention_mask", TensorSpec(("B", text_len), torch.int64))
    g.add_input("video", TensorSpec(("B", 3, "T", "H", "W"), torch.float32))
    g.add_stage(
        CogVideoXT5TextEncoderStage.from_pretrained("text", root / "text_encoder", tokenizer, max_length=text_len)
    )
    g.add_stage(CogVideoXVAEEncodeStage.from_pretrained("vae", root / "vae"))
    g.add_stage(
        CogVideoXDiTStage.from_pretrained(
            "dit", root / "transformer", scheduler=scheduler, vae_scale_factor_spatial=vae_spatial
        )
    )
    for src, dst in COGVIDEOX_TRAIN_EDGES:
        g.connect(src, dst)
    g.validate()
    return g


# ---- tiny preset --------------------------------------------------------------------------------

#: the tiny preset's variants: CogVideoX-2b (DDIM, sin-cos positions), -5b (DPM, rotary) and 1.5
#: (DPM, rotary, two latent frames a patch)
TinyVariant = Literal["2b", "5b", "1.5"]


def build_tiny_cogvideox_pipeline(
    *, seed: int = 0, variant: TinyVariant = "2b", texts: Sequence[str] | None = None
) -> CogVideoXPipeline:
    """Random-weight ``CogVideoXPipeline`` components from small configs; weights are a pure
    function of ``seed``. ``variant`` picks the scheduler and the positional embeddings of a real
    checkpoint (:data:`TinyVariant`); the tokenizer knows the words of ``texts`` (the moving-shapes
    captions by default). Videos are multiples of 16 pixels; the default size is 16 x 32, 9 frames."""
    if variant not in ("2b", "5b", "1.5"):
        raise ValueError(f"variant must be '2b', '5b' or '1.5', got {variant!r}")
    texts = [*caption_vocabulary(), "blurry static"] if texts is None else texts
    tokenizer = build_word_tokenizer(texts)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = T5EncoderModel(
            T5Config(
                vocab_size=len(tokenizer),
                d_model=32,
                d_kv=8,
                d_ff=37,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                pad_token_id=0,
                eos_token_id=1,
            )
        )
        vae = AutoencoderKLCogVideoX(
            block_out_channels=(8, 8, 8, 8),
            latent_channels=4,
            layers_per_block=1,
            norm_num_groups=2,
            temporal_compression_ratio=4,
        )
        transformer = CogVideoXTransformer3DModel(
            num_attention_heads=2,
            attention_head_dim=16,  # the 3-D rotary embedding splits it 4 / 6 / 6
            in_channels=4,
            out_channels=4,
            time_embed_dim=16,
            text_embed_dim=32,
            num_layers=2,
            sample_width=4,  # latent sizes: 16 x 32 pixels, 9 frames by default
            sample_height=2,
            sample_frames=9,
            patch_size=2,
            patch_size_t=2 if variant == "1.5" else None,
            temporal_compression_ratio=4,
            max_text_seq_length=226,  # CogVideoXPipeline's max_sequence_length
            use_rotary_positional_embeddings=variant != "2b",
        )
    for module in (text_encoder, vae, transformer):
        cast(nn.Module, module).eval()  # as from_pretrained returns them
    scheduler: Any = (
        CogVideoXDDIMScheduler(snr_shift_scale=3.0, **COGVIDEOX_SCHEDULER_CONFIG)
        if variant == "2b"
        else CogVideoXDPMScheduler(snr_shift_scale=1.0, **COGVIDEOX_SCHEDULER_CONFIG)
    )
    return CogVideoXPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler
    )


def save_tiny_cogvideox_pipeline(
    path: str | Path, *, seed: int = 0, variant: TinyVariant = "2b", texts: Sequence[str] | None = None
) -> Path:
    """Build (:func:`build_tiny_cogvideox_pipeline`) and ``save_pretrained`` a tiny
    ``CogVideoXPipeline`` into ``path``."""
    path = Path(path)
    pipe: Any = build_tiny_cogvideox_pipeline(seed=seed, variant=variant, texts=texts)
    pipe.save_pretrained(path)
    return path
