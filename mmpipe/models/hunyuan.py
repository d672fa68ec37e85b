"""HunyuanVideo text-to-video (``diffusers.HunyuanVideoPipeline``) as a family of the shared graph
(:mod:`mmpipe.models.pipeline_graph`), and its tiny random preset.

Text: a Llama-style LM (``text_encoder``) reads the prompt in the pipeline's ``prompt_template``
(its hidden states two layers before the last, the template's system part cropped) and CLIP
(``text_encoder_2``) gives a pooled vector; the DiT takes both, an attention mask over the Llama
tokens and an embedded guidance scale (``guidance_scale``, guidance-distilled). True classifier-free
guidance (a second, negative branch) runs only with ``true_cfg_scale > 1`` and a ``negative_prompt``.

Latents ``(B, C, t, h, w)`` float32 (``t = (T - 1) // 4 + 1``, ``h, w = H / 8, W / 8`` for the
released VAE), as the pipeline keeps them; the DiT runs in its dtype and the VAE decodes
``latents / scaling_factor``.

Training graph (:func:`build_hunyuan_training_graph`, from a ``HunyuanVideoPipeline`` directory)::

    input.{input_ids, attention_mask, clip_input_ids} -> text.{context, context_mask, pooled} -> dit
    input.video -> vae.video;  vae.latents -> dit.latents -> dit.loss

The text stage (:class:`~mmpipe.stages.HunyuanTextEncoderStage`) holds both encoders; the data
pipeline tokenizes captions with its ``tokenize`` (the prompt template, then both tokenizers, as the
pipeline does), so the graph's inputs are the token tensors.

Legend: B batch, C latent channels, t/h/w latent frames/height/width, T/H/W pixel frames/height/width,
L text tokens, D text width.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from diffusers import (
    AutoencoderKLHunyuanVideo,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideoPipeline,
    HunyuanVideoTransformer3DModel,
)
from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import (
    DEFAULT_PROMPT_TEMPLATE,
    XLA_AVAILABLE,
    retrieve_timesteps,
)
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from torch import nn
from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel, PreTrainedTokenizerFast

from mmpipe.graph import Graph, TensorSpec
from mmpipe.models.pipeline_graph import Family, prompt_list
from mmpipe.models.wan import TINY_TEXTS, flow_shift_of
from mmpipe.parallel.modules import SequenceState
from mmpipe.stages import HunyuanTextEncoderStage, HunyuanVAEEncodeStage, HunyuanVideoDiTFlowMatchingStage
from mmpipe.stages.dit import hunyuan_sequence_hooks


class HunyuanVideoFamily(Family):
    """``HunyuanVideoPipeline.__call__`` as the shared graph's hooks.

    Condition ports (each with its ``negative_`` twin under true CFG): ``prompt_embeds`` ``(B, L, D)``,
    ``pooled_prompt_embeds`` ``(B, D_clip)`` and ``prompt_attention_mask`` ``(B, L)``, all in the DiT's
    dtype as the pipeline casts them. State: the embedded ``guidance`` ``(B,)`` (``guidance_scale *
    1000``) and the DiT's dtype.
    """

    pipeline_cls = HunyuanVideoPipeline
    cfg_argument = "true_cfg_scale"  # guidance_scale is the distilled guidance embedding
    text_components = ("text_encoder", "text_encoder_2")
    condition_ports = ("prompt_embeds", "pooled_prompt_embeds", "prompt_attention_mask")

    @classmethod
    def sequence_parallel(cls, pipeline_config: Mapping[str, Any]) -> str | None:
        return None

    def apply_sequence_hooks(self, model: nn.Module, state: SequenceState) -> None:
        hunyuan_sequence_hooks(model, state)

    def prepare_call(self, call: dict[str, Any]) -> dict[str, Any]:
        # The pipeline rounds nothing: height / width not divisible by 16 are refused here, and the
        # latent frame count is (num_frames - 1) // 4 + 1 (prepare_latents' own formula).
        self.pipe.check_inputs(
            call["prompt"],
            call["prompt_2"],
            call["height"],
            call["width"],
            None,
            call["callback_on_step_end_tensor_inputs"],
            call["prompt_template"],
        )
        prompt_list(call["prompt"])
        return call

    def guided(self, call: Mapping[str, Any]) -> bool:
        # do_true_cfg (negative embeddings are not a graph argument, so only negative_prompt counts)
        return bool(call["true_cfg_scale"] > 1 and call["negative_prompt"] is not None)

    def model_for(
        self, step: int, t: torch.Tensor, call: Mapping[str, Any], state: Mapping[str, Any]
    ) -> tuple[str, float]:
        # guidance_scale is embedded (predict); the two branches are mixed with true_cfg_scale
        return "transformer", float(call["true_cfg_scale"])

    def encode(self, call: Mapping[str, Any], guided: bool) -> dict[str, torch.Tensor]:
        out = self._encode(call, call["prompt"], call["prompt_2"])
        if guided:
            neg = self._encode(call, call["negative_prompt"], call["negative_prompt_2"])
            out |= {f"negative_{k}": v for k, v in neg.items()}
        return out

    def _encode(self, call: Mapping[str, Any], prompt: Any, prompt_2: Any) -> dict[str, torch.Tensor]:
        embeds, pooled, mask = self.pipe.encode_prompt(
            prompt=prompt,
            prompt_2=prompt_2,
            prompt_template=call["prompt_template"],
            num_videos_per_prompt=call["num_videos_per_prompt"],
            device=self.execution_device,
            max_sequence_length=call["max_sequence_length"],
        )
        dtype = self.pipe.transformer.dtype
        return {
            "prompt_embeds": embeds.to(dtype),
            "pooled_prompt_embeds": pooled.to(dtype),
            "prompt_attention_mask": mask.to(dtype),
        }

    def prepare_latents(
        self, call: Mapping[str, Any], cond: Mapping[str, torch.Tensor], generator: torch.Generator | None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        p = self.pipe
        device = self.execution_device
        dtype = p.transformer.dtype
        latents = p.prepare_latents(
            len(prompt_list(call["prompt"])) * call["num_videos_per_prompt"],
            p.transformer.config.in_channels,
            call["height"],
            call["width"],
            call["num_frames"],
            torch.float32,
            device,
            generator,
            None,
        )
        guidance = torch.tensor([call["guidance_scale"]] * latents.shape[0], dtype=dtype, device=device) * 1000.0
        return latents, {"guidance": guidance, "dtype": dtype}

    def set_timesteps(
        self, scheduler: Any, call: Mapping[str, Any], latents: torch.Tensor, state: dict[str, Any]
    ) -> torch.Tensor:
        steps = call["num_inference_steps"]
        sigmas: Any = np.linspace(1.0, 0.0, steps + 1)[:-1] if call["sigmas"] is None else call["sigmas"]
        device = "cpu" if XLA_AVAILABLE else latents.device
        timesteps, _ = retrieve_timesteps(scheduler, steps, device, sigmas=sigmas)
        scheduler.set_begin_index(0)
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
        pred: torch.Tensor = model(
            hidden_states=latents.to(state["dtype"]),
            timestep=t.expand(latents.shape[0]).to(latents.dtype),
            encoder_hidden_states=cond["prompt_embeds"],
            encoder_attention_mask=cond["prompt_attention_mask"],
            pooled_projections=cond["pooled_prompt_embeds"],
            guidance=state["guidance"],
            attention_kwargs=call["attention_kwargs"],
            return_dict=False,
        )[0]
        return pred

    def decode(
        self, latents: torch.Tensor, call: Mapping[str, Any], extras: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        vae = self.pipe.vae
        video: torch.Tensor = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
        return video


# ---- training ----------------------------------------------------------------------------------------

HUNYUAN_TRAIN_EDGES = (
    ("input.input_ids", "text.input_ids"),
    ("input.attention_mask", "text.attention_mask"),
    ("input.clip_input_ids", "text.clip_input_ids"),
    ("input.video", "vae.video"),
    ("text.context", "dit.context"),
    ("text.context_mask", "dit.context_mask"),
    ("text.pooled", "dit.pooled"),
    ("vae.latents", "dit.latents"),
)


def build_hunyuan_training_graph(
    pipeline_dir: str | Path, *, text_len: int, prompt_template: Mapping[str, Any] = DEFAULT_PROMPT_TEMPLATE
) -> Graph:
    """The flow-matching training graph of a local ``HunyuanVideoPipeline`` directory: the Llama
    context of ``prompt_template`` (``text_len`` tokens after the crop), its mask and CLIP's pooled
    vector, the VAE's scaled latents and the DiT taking all three
    (``HunyuanVideoDiTFlowMatchingStage(text_inputs=True)``), with the scheduler's shift."""
    root = Path(pipeline_dir)
    shift = flow_shift_of(FlowMatchEulerDiscreteScheduler.load_config(root / "scheduler"))
    text = HunyuanTextEncoderStage.from_pipeline_dir("text", root, max_length=text_len, prompt_template=prompt_template)
    g = Graph("hunyuan_video_train")
    for port, spec in text.inputs.items():
        g.add_input(port, spec)
    g.add_input("video", TensorSpec(("B", 3, "T", "H", "W"), torch.float32))
    g.add_stage(text)
    g.add_stage(HunyuanVAEEncodeStage.from_pretrained("vae", root / "vae"))
    g.add_stage(
        HunyuanVideoDiTFlowMatchingStage.from_pretrained("dit", root / "transformer", shift=shift, text_inputs=True)
    )
    for src, dst in HUNYUAN_TRAIN_EDGES:
        g.connect(src, dst)
    g.validate()
    return g


# ---- tiny preset -----------------------------------------------------------------------------------

#: Llama 3's pre-tokenization (its tokenizer.json's split pattern): with it a word-level vocabulary
#: cuts the default prompt template's system part into 95 tokens, the template's ``crop_start``
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
LLAMA_SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<unk>")
LLAMA_TEMPLATE_TOKENS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
#: CLIP's pre-tokenization (after lower-casing; whitespace is split off first)
CLIP_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"
CLIP_SPECIAL_TOKENS = ("<|startoftext|>", "<|endoftext|>", "<unk>")


def build_llama_tokenizer(texts: Sequence[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer with Llama 3's pre-tokenization and special tokens that knows every
    piece of ``texts`` and of HunyuanVideo's default prompt template (others are ``<unk>``);
    prepends ``<|begin_of_text|>`` and pads with ``<|end_of_text|>`` on the right, like the
    released checkpoint's tokenizer."""
    split = pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated")
    vocab = {tok: i for i, tok in enumerate((*LLAMA_SPECIAL_TOKENS, *LLAMA_TEMPLATE_TOKENS))}
    marker = "(" + "|".join(re.escape(t) for t in LLAMA_TEMPLATE_TOKENS) + ")"
    # each word of texts with and without its leading space (" red" inside a prompt, "red" first)
    words = [v for text in texts for word in text.split() for v in (word, f" {word}")]
    for text in (*re.split(marker, str(DEFAULT_PROMPT_TEMPLATE["template"])), *words):
        if text not in LLAMA_TEMPLATE_TOKENS:
            for piece, _ in split.pre_tokenize_str(text):
                vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = split
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", vocab["<|begin_of_text|>"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|end_of_text|>",
        unk_token="<unk>",
        additional_special_tokens=list(LLAMA_TEMPLATE_TOKENS),
    )


def build_clip_tokenizer(texts: Sequence[str]) -> PreTrainedTokenizerFast:
    """A lower-casing word-level tokenizer with CLIP's pre-tokenization and special tokens that knows
    every word of ``texts`` (others are ``<unk>``): ``<|startoftext|> ... <|endoftext|>``, padded
    with ``<|endoftext|>`` (so CLIP pools at the first ``<|endoftext|>``)."""
    split = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(CLIP_SPLIT), behavior="isolated")]
    )
    vocab = {tok: i for i, tok in enumerate(CLIP_SPECIAL_TOKENS)}
    for text in texts:
        for piece, _ in split.pre_tokenize_str(text.lower()):
            vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])
    tok.pre_tokenizer = split
    tok.decoder = decoders.WordPiece(prefix="", cleanup=True)
    start, end = CLIP_SPECIAL_TOKENS[:2]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{start} $A {end}",
        pair=f"{start} $A {end} $B {end}",
        special_tokens=[(start, vocab[start]), (end, vocab[end])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=start, eos_token=end, pad_token=end, unk_token="<unk>", model_max_length=77
    )


def build_tiny_hunyuan_pipeline(*, seed: int = 0, texts: Sequence[str] = TINY_TEXTS) -> HunyuanVideoPipeline:
    """A ``HunyuanVideoPipeline`` of tiny random components of the real classes (nothing is
    downloaded: the tokenizers are built locally from ``texts``); weights are a pure function of
    ``seed``. Spatial compression 8, temporal 4 (as released); 3 Llama layers, so the pipeline's
    embeddings (two layers before the last) pass one layer."""
    tokenizer = build_llama_tokenizer(texts)
    tokenizer_2 = build_clip_tokenizer(texts)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = LlamaModel(
            LlamaConfig(
                vocab_size=len(tokenizer),
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=4,
                max_position_embeddings=512,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
        text_encoder_2 = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(tokenizer_2),
                hidden_size=8,
                intermediate_size=16,
                num_hidden_layers=2,
                num_attention_heads=2,
                max_position_embeddings=77,
                projection_dim=8,
                bos_token_id=tokenizer_2.bos_token_id,
                eos_token_id=tokenizer_2.eos_token_id,
                pad_token_id=tokenizer_2.pad_token_id,
            )
        )
        transformer = HunyuanVideoTransformer3DModel(
            in_channels=4,
            out_channels=4,
            num_attention_heads=2,
            attention_head_dim=10,
            num_layers=1,
            num_single_layers=1,
            num_refiner_layers=1,
            patch_size=1,
            patch_size_t=1,
            guidance_embeds=True,
            text_embed_dim=16,
            pooled_projection_dim=8,
            rope_axes_dim=(2, 4, 4),
        )
        vae = AutoencoderKLHunyuanVideo(
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            down_block_types=("HunyuanVideoDownBlock3D",) * 4,
            up_block_types=("HunyuanVideoUpBlock3D",) * 4,
            block_out_channels=(8, 8, 8, 8),
            layers_per_block=1,
            act_fn="silu",
            norm_num_groups=4,
            scaling_factor=0.476986,
            spatial_compression_ratio=8,
            temporal_compression_ratio=4,
            mid_block_add_attention=True,
        )
    for module in (text_encoder, text_encoder_2, transformer, vae):
        cast(nn.Module, module).eval()  # as from_pretrained returns them
    return HunyuanVideoPipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
    )


def save_tiny_hunyuan_pipeline(path: str | Path, *, seed: int = 0, texts: Sequence[str] = TINY_TEXTS) -> Path:
    """Build (:func:`build_tiny_hunyuan_pipeline`) and ``save_pretrained`` a tiny pipeline into
    ``path`` (the ``HunyuanVideoPipeline`` layout)."""
    path = Path(path)
    pipe: Any = build_tiny_hunyuan_pipeline(seed=seed, texts=texts)
    pipe.save_pretrained(path)
    return path
