"""Wan 2.1 text-to-video: the family's graphs, its ``from_diffusers`` adapter and its tiny presets.

Inference graph (``T2VGraph``, from a ``WanPipeline`` directory or object)::

    input.{input_ids, attention_mask, negative_*} -> text -> denoise.{context, negative_context}
    input.noise -> denoise.latents;  denoise.latents -> decode.latents -> decode.video

Training graph::

    input.{input_ids, attention_mask} -> text.context -> dit.context
    input.video -> vae.video;  vae.latents -> dit.latents -> dit.loss

Tiny presets: random-weight pipelines built from the real architecture classes (nothing is
downloaded: a word-level tokenizer is built locally with the ``tokenizers`` library, every module
is a diffusers / transformers class constructed from a small config) and saved with
``save_pretrained`` in the standard ``WanPipeline`` layout, so training, generation and
``from_diffusers`` load them exactly as they would load a real checkpoint directory.

Legend: B batch, Z latent channels, t/h/w latent frames/height/width, T/H/W pixel frames/height/width.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
import torch.distributed as dist
from diffusers import AutoencoderKLWan, DiffusionPipeline, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from diffusers.video_processor import VideoProcessor
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from torch import nn
from transformers import (
    AutoConfig,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2Model,
    UMT5Config,
    UMT5EncoderModel,
)

from mmpipe.config import ModelConfig
from mmpipe.data.shapes import caption_vocabulary
from mmpipe.graph import Graph, TensorSpec
from mmpipe.models.pipeline_graph import (
    NOT_IMPLEMENTED,
    Family,
    bind_call,
    call_generator,
    check_component,
    prompt_list,
    read_model_index,
)
from mmpipe.models.shapes_vae import load_shapes_vae
from mmpipe.parallel.modules import SequenceState
from mmpipe.parallel.vae import split_wan_decode
from mmpipe.stages import (
    CausalLMTextEncoderStage,
    DenoiseStage,
    T5TextEncoderStage,
    TextEncoderStage,
    WanDiTFlowMatchingStage,
    WanVAEDecodeStage,
    WanVAEEncodeStage,
)
from mmpipe.stages.dit import wan_sequence_hooks
from mmpipe.stages.sampler import guidance_on
from mmpipe.stages.text import prompt_specs

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # T5 order: pad=0, eos=1, unk=2


#: the words the tiny families' tokenizers know by default (LTX, HunyuanVideo): every caption word,
#: and a few negative-prompt words
TINY_TEXTS = (*caption_vocabulary(), "blurry static low quality worst")


def build_word_tokenizer(texts: Sequence[str]) -> PreTrainedTokenizerFast:
    """A lower-casing word tokenizer knowing every word of ``texts``; appends ``</s>`` like T5's."""
    splitter = pre_tokenizers.Whitespace()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    words = {w for text in texts for w, _ in splitter.pre_tokenize_str(text.lower())}
    for w in sorted(words):
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = splitter
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def build_text_encoder(spec: ModelConfig, vocab_size: int) -> torch.nn.Module:
    """UMT5 encoder (Wan's text encoder family) or a Qwen2 base model used as a text encoder."""
    if spec.text_encoder == "umt5":
        heads = max(1, spec.text_dim // 8)
        return UMT5EncoderModel(
            UMT5Config(
                vocab_size=vocab_size,
                d_model=spec.text_dim,
                d_kv=spec.text_dim // heads,
                d_ff=2 * spec.text_dim,
                num_layers=2,
                num_heads=heads,
                relative_attention_num_buckets=8,
                pad_token_id=0,
                eos_token_id=1,
            )
        )
    heads = max(1, spec.text_dim // 8)
    return Qwen2Model(
        Qwen2Config(
            vocab_size=vocab_size,
            hidden_size=spec.text_dim,
            intermediate_size=2 * spec.text_dim,
            num_hidden_layers=2,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            max_position_embeddings=512,
            pad_token_id=0,
        )
    )


def build_tiny_wan_pipeline(spec: ModelConfig, texts: Sequence[str], *, seed: int) -> WanPipeline:
    """Random-weight components of a Wan-style pipeline; weights are a pure function of ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokenizer = build_word_tokenizer(texts)
        text_encoder = build_text_encoder(spec, vocab_size=len(tokenizer))
        vae = (
            load_shapes_vae()
            if spec.vae_weights == "shapes"
            else AutoencoderKLWan(
                base_dim=spec.vae_base_dim,
                z_dim=16,
                dim_mult=[1, 1, 1, 1],
                num_res_blocks=1,
                temperal_downsample=[False, True, True],
            )
        )
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=spec.dit_heads,
            attention_head_dim=spec.dit_head_dim,
            in_channels=16,
            out_channels=16,
            text_dim=spec.text_dim,
            freq_dim=64,
            ffn_dim=4 * spec.dit_heads * spec.dit_head_dim,
            num_layers=spec.dit_layers,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=64,
        )
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=spec.flow_shift
    )
    for module in (text_encoder, vae, transformer):
        cast(nn.Module, module).eval()  # as from_pretrained returns them: no dropout in the text encoder
    return WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer
    )


def save_tiny_wan_pipeline(spec: ModelConfig, texts: Sequence[str], path: str | Path, *, seed: int) -> Path:
    """Build and ``save_pretrained`` a tiny pipeline into ``path`` (the WanPipeline layout); with
    ``spec.boundary_ratio``, Wan 2.2's two experts (the second DiT's weights from ``seed + 1``)."""
    path = Path(path)
    pipe: Any = build_tiny_wan_pipeline(spec, texts, seed=seed)
    if spec.boundary_ratio is not None:
        second: Any = build_tiny_wan_pipeline(spec, texts, seed=seed + 1)
        pipe.register_modules(transformer_2=second.transformer)
        pipe.register_to_config(boundary_ratio=spec.boundary_ratio)
    pipe.save_pretrained(path)
    return path


def build_full_wan_pipeline(
    spec: ModelConfig, texts: Sequence[str], *, device: str | torch.device, seed: int = 0
) -> WanPipeline:
    """A ``WanPipeline`` of an architecture preset's full-size modules (``model=wan1_3b_t2v``) with
    random weights, built directly on ``device`` (nothing is downloaded): the text encoder and the
    DiT in bf16, the VAE in float32, as diffusers' Wan examples load them. For GPU benchmarks and
    tests; the tokenizer is the word tokenizer of ``texts`` (ids stay inside the real vocabulary)."""

    arch = dict(spec.arch or {})
    missing = [k for k in ("text", "vae", "dit") if not arch.get(k)]
    if missing or spec.kind != "t2v":
        raise ValueError(f"model {spec.name!r}: a full-size Wan pipeline needs a t2v arch preset; missing {missing}")
    text_kw = dict(arch["text"])
    text_cfg: Any = AutoConfig.for_model(text_kw.pop("model_type"), **text_kw)
    vae_kw = {k: v for k, v in arch["vae"].items() if k != "class"}
    dit_kw = {k: v for k, v in arch["dit"].items() if k != "class"}
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        tokenizer = build_word_tokenizer(texts)
        text_encoder = place_module(UMT5EncoderModel(text_cfg).eval(), device, torch.bfloat16)
        vae = AutoencoderKLWan.from_config(vae_kw).eval()
        # bf16 but for what from_pretrained(torch_dtype=bf16) keeps in float32 (norms, modulation tables)
        transformer = place_module(WanTransformer3DModel.from_config(dit_kw).eval(), device, torch.bfloat16)
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=spec.flow_shift
    )
    return WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer
    )


SUPPORTED_PIPELINES = ("WanPipeline",)


def is_wan21_t2v(meta: Any) -> bool:
    """Whether a ``WanPipeline``'s ``model_index.json`` (or pipeline config) is Wan 2.1 text-to-video,
    the graph training and serving run: one expert, no ``boundary_ratio``, no ``expand_timesteps``."""
    if meta.get("_class_name", "WanPipeline") != "WanPipeline":
        return False
    second = meta.get("transformer_2")
    two_experts = isinstance(second, list | tuple) and any(second)
    return not two_experts and meta.get("boundary_ratio") is None and not meta.get("expand_timesteps")


class Wan22Family(Family):
    """``WanPipeline`` with Wan 2.2's features: two experts (``transformer`` for the high-noise
    steps, ``transformer_2`` once the timestep falls below ``boundary_ratio * num_train_timesteps``,
    each with its guidance scale) and TI2V's per-token timesteps (``expand_timesteps``).

    Latents ``(B, Z, t, h, w)`` float32, as ``WanPipeline`` keeps them; the DiT runs in its dtype.
    """

    pipeline_cls: ClassVar[type] = WanPipeline  # WanI2VFamily: WanImageToVideoPipeline
    denoise_components = ("transformer", "transformer_2")
    parallel_decode = True

    def prepare_call(self, call: dict[str, Any]) -> dict[str, Any]:
        p = self.pipe
        p.check_inputs(
            call["prompt"],
            call["negative_prompt"],
            call["height"],
            call["width"],
            guidance_scale_2=call["guidance_scale_2"],
        )
        return self._fit_call(call)

    def _fit_call(self, call: dict[str, Any]) -> dict[str, Any]:
        """The frame count and sizes rounded as Wan's pipelines round them (with their warnings), and
        ``guidance_scale_2`` defaulting to ``guidance_scale`` on two-expert pipelines."""
        p = self.pipe
        prompt_list(call["prompt"])
        height, width, frames = call["height"], call["width"], call["num_frames"]
        scale_t = p.vae_scale_factor_temporal
        if frames % scale_t != 1:
            logger.warning("num_frames - 1 must be divisible by %d; rounding %d", scale_t, frames)
            frames = frames // scale_t * scale_t + 1
        frames = max(frames, 1)
        patch = self._expert().config.patch_size
        mh, mw = p.vae_scale_factor_spatial * patch[1], p.vae_scale_factor_spatial * patch[2]
        if (height % mh, width % mw) != (0, 0):
            logger.warning("height/width must be multiples of (%d, %d); rounding (%d, %d)", mh, mw, height, width)
            height, width = height // mh * mh, width // mw * mw
        scale_2 = call["guidance_scale_2"]
        if p.config.boundary_ratio is not None and scale_2 is None:
            scale_2 = call["guidance_scale"]
        return call | {"height": height, "width": width, "num_frames": frames, "guidance_scale_2": scale_2}

    def _expert(self) -> Any:
        return self.pipe.transformer if self.pipe.transformer is not None else self.pipe.transformer_2

    @classmethod
    def sequence_parallel(cls, pipeline_config: Mapping[str, Any]) -> str | None:
        if pipeline_config.get("expand_timesteps"):
            return "Wan 2.2 TI2V's per-token timesteps (expand_timesteps) are not split over sequence-parallel ranks"
        return None

    def apply_sequence_hooks(self, model: nn.Module, state: SequenceState) -> None:
        wan_sequence_hooks(model, state)

    def guided(self, call: Mapping[str, Any]) -> bool:
        return float(call["guidance_scale"]) > 1.0  # WanPipeline.do_classifier_free_guidance

    def encode(self, call: Mapping[str, Any], guided: bool) -> dict[str, torch.Tensor]:
        pos, neg = self.pipe.encode_prompt(
            prompt=call["prompt"],
            negative_prompt=call["negative_prompt"],
            do_classifier_free_guidance=guided,
            num_videos_per_prompt=call["num_videos_per_prompt"],
            max_sequence_length=call["max_sequence_length"],
            device=self.execution_device,
        )
        dtype = self._expert().dtype
        out = {"prompt_embeds": pos.to(dtype)}
        if neg is not None:
            out["negative_prompt_embeds"] = neg.to(dtype)
        return out

    def prepare_latents(
        self, call: Mapping[str, Any], cond: Mapping[str, torch.Tensor], generator: torch.Generator | None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        expert = self._expert()
        batch = len(prompt_list(call["prompt"])) * call["num_videos_per_prompt"]
        latents = self.pipe.prepare_latents(
            batch,
            expert.config.in_channels,
            call["height"],
            call["width"],
            call["num_frames"],
            torch.float32,
            self.execution_device,
            generator,
            None,
        )
        mask = torch.ones(latents.shape, dtype=torch.float32, device=latents.device)
        return latents, {"mask": mask, "dtype": expert.dtype}

    def set_timesteps(
        self, scheduler: Any, call: Mapping[str, Any], latents: torch.Tensor, state: dict[str, Any]
    ) -> torch.Tensor:
        scheduler.set_timesteps(call["num_inference_steps"], device=latents.device)
        scheduler.set_begin_index(0)
        ratio = self.pipe.config.boundary_ratio
        state["boundary"] = ratio * scheduler.config.num_train_timesteps if ratio is not None else None
        return scheduler.timesteps

    def model_for(
        self, step: int, t: torch.Tensor, call: Mapping[str, Any], state: Mapping[str, Any]
    ) -> tuple[str, float]:
        if state["boundary"] is None or t >= state["boundary"]:
            return "transformer", float(call["guidance_scale"])
        return "transformer_2", float(call["guidance_scale_2"])

    def predict(
        self,
        model: nn.Module,
        latents: torch.Tensor,
        t: torch.Tensor,
        cond: Mapping[str, torch.Tensor],
        call: Mapping[str, Any],
        state: dict[str, Any],
    ) -> torch.Tensor:
        if self.pipe.config.expand_timesteps:  # one timestep per (2x2-patched) latent token
            timestep = (state["mask"][0][0][:, ::2, ::2] * t).flatten().unsqueeze(0).expand(latents.shape[0], -1)
        else:
            timestep = t.expand(latents.shape[0])
        return model(
            hidden_states=latents.to(state["dtype"]),
            timestep=timestep,
            encoder_hidden_states=cond["prompt_embeds"],
            attention_kwargs=call["attention_kwargs"],
            return_dict=False,
        )[0]

    def decode(
        self, latents: torch.Tensor, call: Mapping[str, Any], extras: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        return wan_vae_decode(
            self.pipe.vae, latents, group=self.decode_group, split=self.decode_split, halo=self.decode_halo
        )


def wan_vae_decode(
    vae: Any,
    latents: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    split: str = "rows",
    halo: int | None = None,
) -> torch.Tensor:
    """``WanPipeline``'s decode: de-normalise with the VAE's latent statistics, then decode (split
    over ``group``'s ranks: :func:`mmpipe.parallel.vae.split_wan_decode`)."""
    z = vae.config.z_dim
    latents = latents.to(vae.dtype)
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
    return split_wan_decode(vae, latents / inv_std + mean, group, split=split, halo=halo)


def build_text_stage(
    name: str, module_or_path: nn.Module | str | Path, tokenizer: Any, *, max_length: int, clean: bool = True
) -> TextEncoderStage:
    """A T5-family encoder (config with ``d_model``) or a causal LM used as a text encoder."""

    kw: dict[str, Any] = {"max_length": max_length, "clean": prompt_clean if clean else None}
    if isinstance(module_or_path, nn.Module):
        cls = _text_stage_class(module_or_path.config)
        return cls.from_module(name, module_or_path, tokenizer, **kw)
    cls = _text_stage_class(AutoConfig.from_pretrained(module_or_path))
    return cls.from_pretrained(name, module_or_path, tokenizer, **kw)


def _text_stage_class(config: Any) -> type[TextEncoderStage]:
    return T5TextEncoderStage if hasattr(config, "d_model") else CausalLMTextEncoderStage


class T2VGraph(Graph):
    """A text-to-video inference graph with a ``generate`` that mirrors ``WanPipeline.__call__``."""

    def __init__(self, text: TextEncoderStage, denoise: DenoiseStage, decode: WanVAEDecodeStage) -> None:
        super().__init__("t2v_inference")
        self.text = text
        self.add_stage(text)
        self._denoise_and_decode(denoise, decode, prompts_to=text.name)

    def _denoise_and_decode(self, denoise: DenoiseStage, decode: WanVAEDecodeStage, *, prompts_to: str) -> None:
        """The graph inputs the prompts' tokens (to stage ``prompts_to``, which outputs the
        contexts) and the noise, the denoiser and the decoder, wired; then validated."""
        self.denoise, self.decode = denoise, decode
        vae_cfg = decode.source.config
        self.scale_t: int = int(vae_cfg.scale_factor_temporal)
        self.scale_s: int = int(vae_cfg.scale_factor_spatial)
        self.video_processor = VideoProcessor(vae_scale_factor=self.scale_s)
        for port, spec in prompt_specs().items():
            self.add_input(port, spec)
            self.connect(f"input.{port}", f"{prompts_to}.{port}")
        z = denoise.source.config.in_channels
        self.add_input("noise", TensorSpec(("B", z, "t", "h", "w"), torch.float32))
        for stage in (denoise, decode):
            self.add_stage(stage)
        self.connect("input.noise", "denoise.latents")
        self.connect(f"{prompts_to}.context", "denoise.context")
        self.connect(f"{prompts_to}.negative_context", "denoise.negative_context")
        self.connect("denoise.latents", "decode.latents")
        self.validate()

    def _fit_size(self, height: int, width: int, num_frames: int) -> tuple[int, int, int]:
        """Validate / round sizes exactly as ``WanPipeline.__call__`` does."""
        if height % 16 != 0 or width % 16 != 0:
            raise ValueError(f"height and width must be divisible by 16, got height={height} width={width}")
        if num_frames < 1:
            raise ValueError(f"num_frames must be >= 1, got {num_frames}")
        if num_frames % self.scale_t != 1:
            fixed = max(num_frames // self.scale_t * self.scale_t + 1, 1)
            logger.warning("num_frames - 1 must be divisible by %d; rounding %d -> %d", self.scale_t, num_frames, fixed)
            num_frames = fixed
        patch = self.denoise.source.config.patch_size
        mh, mw = self.scale_s * patch[1], self.scale_s * patch[2]
        fh, fw = height // mh * mh, width // mw * mw
        if (fh, fw) != (height, width):
            logger.warning("height/width must be multiples of (%d, %d); using (%d, %d)", mh, mw, fh, fw)
        return fh, fw, num_frames

    def tokenize(self, prompts: Sequence[str], max_sequence_length: int | None) -> dict[str, Any]:
        """The tokens of ``prompts`` for the stage that reads them (the text encoder's tokenizer)."""
        return self.text.tokenize(prompts, max_sequence_length)

    def prompt_inputs(
        self,
        prompts: Sequence[str],
        negative_prompt: str | Sequence[str] | None,
        guidance_scale: float,
        *,
        max_sequence_length: int | None = None,
    ) -> dict[str, Any]:
        """The text stage's inputs: the prompts' tokens, and the negative prompts' (``""`` by
        default) when guidance is on (see :func:`~mmpipe.stages.sampler.guidance_on`), padded to
        ``max_sequence_length`` (the stage's ``max_length`` by default)."""
        inputs: dict[str, Any] = self.tokenize(prompts, max_sequence_length)
        if guidance_on(guidance_scale):
            neg = negative_prompt or ""
            negs = [neg] * len(prompts) if isinstance(neg, str) else list(neg)
            if len(negs) != len(prompts):
                raise ValueError(f"negative_prompt has {len(negs)} entries but prompt has {len(prompts)}")
            neg_tok = self.tokenize(negs, max_sequence_length)
            inputs |= {"negative_input_ids": neg_tok["input_ids"], "negative_attention_mask": neg_tok["attention_mask"]}
        return inputs

    def latent_shape(self, batch: int, num_frames: int, height: int, width: int) -> tuple[int, int, int, int, int]:
        """``(B, Z, t, h, w)`` of the latents of ``batch`` videos of this size (a fitted one)."""
        z = self.denoise.source.config.in_channels
        return batch, z, (num_frames - 1) // self.scale_t + 1, height // self.scale_s, width // self.scale_s

    def generate(self, *args: Any, seed: int | None = None, progress: bool = True, **kwargs: Any) -> Any:
        """``WanPipeline.__call__(*args, **kwargs)``'s ``frames`` (``output_type="np"``: ``(B, T, H,
        W, 3)`` in [0, 1]) computed by the graph's stages, with the noise of
        ``generator=torch.Generator().manual_seed(seed)`` unless a ``generator`` is given.

        Prompts are padded to the graph's ``max_sequence_length`` (``from_diffusers``'s) unless the
        call gives its own. Wan 2.2's ``guidance_scale_2`` and ``attention_kwargs`` belong to
        :class:`Wan22Family`'s graph; an argument ``__call__`` does not take is a ``TypeError``.
        """
        call = bind_call(WanPipeline, args, kwargs, not_implemented=NOT_IMPLEMENTED | {"attention_kwargs"})
        if call["guidance_scale_2"] is not None:
            raise ValueError("guidance_scale_2 is only supported when the pipeline's boundary_ratio is not None")
        prompts = prompt_list(call["prompt"])
        negative_prompt = call["negative_prompt"]  # a list's length is checked by prompt_inputs
        if negative_prompt is not None and not isinstance(negative_prompt, str):
            negative_prompt = list(negative_prompt)
        repeat = int(call["num_videos_per_prompt"])
        if repeat < 1:
            raise ValueError(f"num_videos_per_prompt must be >= 1, got {repeat}")
        # WanPipeline repeats each prompt's embeddings num_videos_per_prompt times, in place
        prompts = [p for p in prompts for _ in range(repeat)]
        if isinstance(negative_prompt, list):
            negative_prompt = [p for p in negative_prompt for _ in range(repeat)]
        height, width, num_frames = self._fit_size(call["height"], call["width"], call["num_frames"])
        length = call["max_sequence_length"] if "max_sequence_length" in kwargs else None
        guidance_scale = float(call["guidance_scale"])
        inputs = self.prompt_inputs(prompts, negative_prompt, guidance_scale, max_sequence_length=length)
        shape = self.latent_shape(len(prompts), num_frames, height, width)
        generator = call_generator(call, seed)
        # Stage.__call__ moves the (CPU-drawn) noise to the denoiser's device.
        inputs["noise"] = torch.randn(shape, generator=generator, dtype=torch.float32, device="cpu")
        options = {
            "denoise": {
                "num_inference_steps": call["num_inference_steps"],
                "guidance_scale": guidance_scale,
                "progress": progress,
            }
        }
        latent = call["output_type"] == "latent"  # as WanPipeline: no decode
        with torch.no_grad():
            latents_or_video = self.run(inputs, options, until="denoise" if latent else None)
        if latent:
            return latents_or_video["denoise"]["latents"]
        return self.video_processor.postprocess_video(
            latents_or_video["decode"]["video"], output_type=call["output_type"]
        )


def from_diffusers(
    path_or_pipeline: str | Path | DiffusionPipeline,
    *,
    max_sequence_length: int = 512,
    device: str | torch.device | None = None,
) -> T2VGraph:
    """Turn a diffusers ``WanPipeline`` (a local directory or an object) into an inference graph.

    The graph's stages wrap the pipeline's own modules (no copy); ``max_sequence_length`` is the
    text length the pipeline pads prompts to (``WanPipeline.__call__``'s default is 512). With a
    ``device``, a directory loads in that device's precision (:func:`component_dtypes`) and the
    modules are placed there with :func:`place_graph`; without one they stay as loaded.
    """
    dtypes = component_dtypes(device) if device is not None else {}
    pipe = _load_pipeline(path_or_pipeline, dtypes)
    cfg = pipe.config
    if getattr(pipe, "transformer_2", None) is not None or cfg.get("boundary_ratio") is not None:
        raise ValueError("two-expert Wan 2.2 pipelines (transformer_2 / boundary_ratio) are not supported yet")
    if cfg.get("expand_timesteps"):
        raise ValueError("WanPipeline with expand_timesteps=True (Wan 2.2 TI2V) is not supported yet")
    text = build_text_stage("text", pipe.text_encoder, pipe.tokenizer, max_length=max_sequence_length)
    denoise = DenoiseStage.from_module("denoise", pipe.transformer, pipe.scheduler)
    decode = WanVAEDecodeStage.from_module("decode", pipe.vae)
    graph = T2VGraph(text, denoise, decode)
    return place_graph(graph, device) if device is not None else graph


def component_dtypes(device: str | torch.device) -> dict[str, torch.dtype]:
    """The dtype of each ``WanPipeline`` component on ``device``, as diffusers' Wan examples load
    them (``torch_dtype``): on CUDA the text encoder and the DiT in bf16, the VAE in float32 (as the
    Wan model cards load it); on CPU none, so modules stay as loaded (float32)."""
    if torch.device(device).type == "cuda":
        return {"text_encoder": torch.bfloat16, "transformer": torch.bfloat16, "vae": torch.float32}
    return {}


def place_graph(graph: T2VGraph, device: str | torch.device) -> T2VGraph:
    """Move ``graph``'s modules to ``device`` in place, in the dtypes of :func:`component_dtypes`
    (the modules a diffusers ``from_pretrained(torch_dtype=...)`` would give, fp32-kept ones
    included); on CPU dtypes are left alone, so CPU outputs stay bitwise what they were."""
    dtypes = component_dtypes(device)
    stages = {"text_encoder": graph.text, "transformer": graph.denoise, "vae": graph.decode}
    for component, stage in stages.items():
        place_module(stage.module, device, dtypes.get(component))
    return graph


def place_module(module: nn.Module, device: str | torch.device, dtype: torch.dtype | None = None) -> nn.Module:
    """Move ``module`` to ``device`` in place and cast its floating tensors to ``dtype`` (``None``:
    keep), except those the library keeps in float32 when loading in ``dtype`` (diffusers'
    ``_keep_in_fp32_modules``: the Wan DiT's norms, time embedder, modulation tables and rotary)."""
    keep = _kept_in_fp32(module, dtype) if dtype is not None else set()
    tensors = itertools.chain(module.named_parameters(), module.named_buffers())
    with torch.no_grad():
        for name, t in tensors:
            to = t.dtype
            if dtype is not None and t.is_floating_point():
                # matched on name parts, as diffusers' loader does ("blocks.0.norm2.weight")
                to = torch.float32 if keep.intersection(name.split(".")) else dtype
            # .data, as nn.Module.to does it: parameters stay the same objects (optimizers, hooks)
            t.data = t.data.to(device=device, dtype=to)
    return module


def _kept_in_fp32(module: nn.Module, dtype: torch.dtype) -> set[str]:
    """The module names ``from_pretrained(torch_dtype=dtype)`` keeps in float32: diffusers always
    keeps ``_keep_in_fp32_modules``; transformers keeps ``_keep_in_fp32_modules_strict`` for any
    half dtype and ``_keep_in_fp32_modules`` for float16 only (T5's ``wo`` is bf16 in bf16)."""
    if dtype == torch.float32:
        return set()
    if isinstance(module, PreTrainedModel):
        names = set(getattr(module, "_keep_in_fp32_modules_strict", None) or ())
        if dtype == torch.float16:
            names |= set(getattr(module, "_keep_in_fp32_modules", None) or ())
        return names
    return set(getattr(module, "_keep_in_fp32_modules", None) or ())


WAN_COMPONENTS = ("text_encoder", "tokenizer", "transformer", "vae", "scheduler")  # what from_diffusers reads


def check_pipeline_dir(
    path: str | Path, *, key: str = "pipeline", supported: Mapping[str, Sequence[str]] | None = None
) -> Path:
    """``path`` as a local ``WanPipeline`` directory that :func:`from_diffusers` can load, checked
    from its ``model_index.json``, component folders and safetensors headers without loading any
    weights (so a training, serving or generation run refuses a bad directory before a worker
    starts); raises ``ValueError`` naming ``key``, the directory and what is wrong. ``supported``:
    the pipeline classes accepted instead, each with the components it must have (training's:
    :data:`mmpipe.models.TRAINING_PIPELINES`)."""

    root = Path(path)
    where = f"{key}={str(root)!r}"
    meta = read_model_index(root, where)
    supported = supported if supported is not None else {"WanPipeline": WAN_COMPONENTS}
    name = meta.get("_class_name")
    if name not in supported:
        raise ValueError(
            f"{where}: model_index.json's _class_name={name!r} is not supported; supported: {list(supported)}"
        )
    two_expert = isinstance(meta.get("transformer_2"), list) and any(meta["transformer_2"])
    if two_expert != (meta.get("boundary_ratio") is not None):
        raise ValueError(f"{where}: a two-expert Wan 2.2 pipeline needs both transformer_2 and boundary_ratio")
    if meta.get("expand_timesteps") and name == "WanPipeline":
        raise ValueError(
            f"{where}: WanPipeline with expand_timesteps=True (Wan 2.2 TI2V) is not trained from a WanPipeline "
            "directory (training takes its WanImageToVideoPipeline layout: image-to-video); mmpipe.from_diffusers, "
            "mmpipe generate pipeline=DIR and mmpipe serve pipeline=DIR run it"
        )
    for component in (*supported[str(name)], *(("transformer_2",) if two_expert else ())):
        entry = meta.get(component)
        if not (isinstance(entry, list) and len(entry) == 2 and all(entry)):
            raise ValueError(f"{where}: model_index.json names no {component} (got {entry!r})")
        check_component(root, component, where)
    return root


def _load_pipeline(path_or_pipeline: str | Path | DiffusionPipeline, dtypes: dict[str, torch.dtype]) -> Any:
    """A ``WanPipeline`` object (typed ``Any``: diffusers registers components dynamically); a
    directory loads its components in ``dtypes`` (none given: as saved, the CPU path)."""
    if isinstance(path_or_pipeline, DiffusionPipeline):
        pipe = path_or_pipeline
    elif dtypes:  # loaded in half precision directly: no float32 copy of a large text encoder
        pipe = DiffusionPipeline.from_pretrained(
            check_pipeline_dir(path_or_pipeline), dtype={**dtypes, "default": torch.float32}
        )
    else:
        pipe = DiffusionPipeline.from_pretrained(check_pipeline_dir(path_or_pipeline))
    name = type(pipe).__name__
    if not isinstance(pipe, WanPipeline):
        raise ValueError(f"from_diffusers: {name} is not supported; supported pipelines: {list(SUPPORTED_PIPELINES)}")
    return pipe


def flow_shift_of(scheduler_config: Any) -> float:
    """The timestep shift a flow-matching scheduler applies (UniPC ``flow_shift``, Euler ``shift``)."""
    for key in ("flow_shift", "shift"):
        value = scheduler_config.get(key)
        if value is not None:
            return float(value)
    return 1.0


T2V_TRAIN_STAGES = ("text", "vae", "dit")  # the stage names of build_t2v_training_graph
T2V_TWO_EXPERT_STAGES = (*T2V_TRAIN_STAGES, "dit_2")  # Wan 2.2: the low-noise expert as its own stage


def t2v_training_stages(model: ModelConfig) -> tuple[str, ...]:
    """The stage names of ``model``'s training graph: ``dit_2`` too for a two-expert Wan 2.2."""
    if model.boundary_ratio is not None:
        return T2V_TWO_EXPERT_STAGES
    if model.path is not None and (Path(model.path) / "model_index.json").is_file():
        meta = json.loads((Path(model.path) / "model_index.json").read_text())
        if two_experts(meta):
            return T2V_TWO_EXPERT_STAGES
    return T2V_TRAIN_STAGES


def two_experts(meta: Mapping[str, Any]) -> bool:
    """Whether ``model_index.json`` (``meta``) names Wan 2.2's second expert and its boundary."""
    second = meta.get("transformer_2")
    return isinstance(second, list | tuple) and any(second) and meta.get("boundary_ratio") is not None


T2V_TRAIN_EDGES = (
    ("input.input_ids", "text.input_ids"),
    ("input.attention_mask", "text.attention_mask"),
    ("input.video", "vae.video"),
    ("text.context", "dit.context"),
    ("vae.latents", "dit.latents"),
)


def build_t2v_training_graph(pipeline_dir: str | Path, *, text_len: int) -> Graph:
    """The flow-matching training graph of a local WanPipeline-layout directory."""

    root = Path(pipeline_dir)
    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
    shift = flow_shift_of(UniPCMultistepScheduler.load_config(root / "scheduler"))
    g = Graph("t2v_train")
    g.add_input("input_ids", TensorSpec(("B", text_len), torch.int64))
    g.add_input("attention_mask", TensorSpec(("B", text_len), torch.int64))
    g.add_input("video", TensorSpec(("B", 3, "T", "H", "W"), torch.float32))
    g.add_stage(build_text_stage("text", root / "text_encoder", tokenizer, max_length=text_len))
    g.add_stage(WanVAEEncodeStage.from_pretrained("vae", root / "vae"))
    meta = json.loads((root / "model_index.json").read_text())
    if two_experts(meta):  # Wan 2.2: each expert trains on the noise range the sampler gives it
        boundary = float(meta["boundary_ratio"])
        g.add_stage(
            WanDiTFlowMatchingStage.from_pretrained(
                "dit", root / "transformer", shift=shift, sigma_range=(boundary, 1.0)
            )
        )
        g.add_stage(
            WanDiTFlowMatchingStage.from_pretrained(
                "dit_2", root / "transformer_2", shift=shift, sigma_range=(0.0, boundary)
            )
        )
    else:
        g.add_stage(WanDiTFlowMatchingStage.from_pretrained("dit", root / "transformer", shift=shift))
    for src, dst in T2V_TRAIN_EDGES:
        g.connect(src, dst)
    if "dit_2" in g.stages:
        g.connect("text.context", "dit_2.context")
        g.connect("vae.latents", "dit_2.latents")
    g.validate()
    return g
