"""Tiny random-weight Wan-style pipelines built from the real architecture classes.

Nothing is downloaded: a word-level tokenizer is built locally with the ``tokenizers`` library,
and every module is a diffusers / transformers class constructed from a small config. The result
is saved with ``save_pretrained`` in the standard ``WanPipeline`` layout, so training, generation
and ``from_diffusers`` all load it exactly as they would load a real checkpoint directory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from torch import nn
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2Model, UMT5Config, UMT5EncoderModel

from mmpipe.config import ModelConfig
from mmpipe.pipelines import place_module

SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # T5 order: pad=0, eos=1, unk=2


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
        vae = AutoencoderKLWan(
            base_dim=spec.vae_base_dim,
            z_dim=16,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
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


VISION_IMAGE_SIZE = 32  # the tiny vision tower's square input; 16 patches of 8x8


def save_tiny_u2g_pipeline(spec: ModelConfig, texts: Sequence[str], path: str | Path, *, seed: int) -> Path:
    """An understand-then-generate pipeline: the Wan layout (vae/, transformer/, scheduler/,
    tokenizer/) plus vision/ (SigLIP), llm/ (Qwen2 + image projector) and connector/."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    from mmpipe.stages.multimodal import Connector, ImageTextLM

    path = Path(path)
    pipe: Any = build_tiny_wan_pipeline(spec, texts, seed=seed)
    pipe.save_pretrained(path)  # text_encoder/ is the LLM's base weights (unused by this graph)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        vision = SiglipVisionModel(
            SiglipVisionConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                image_size=VISION_IMAGE_SIZE,
                patch_size=8,
            )
        )
        llm = ImageTextLM(build_text_encoder(dataclasses.replace(spec, text_encoder="qwen2"), len(pipe.tokenizer)), 32)
        connector = Connector(spec.text_dim, spec.text_dim)
    vision.save_pretrained(path / "vision")
    llm.save(path / "llm")
    connector.save(path / "connector")
    return path


def save_tiny_wan_pipeline(spec: ModelConfig, texts: Sequence[str], path: str | Path, *, seed: int) -> Path:
    """Build and ``save_pretrained`` a tiny pipeline into ``path`` (the WanPipeline layout)."""
    path = Path(path)
    pipe: Any = build_tiny_wan_pipeline(spec, texts, seed=seed)
    pipe.save_pretrained(path)
    return path


def build_full_wan_pipeline(
    spec: ModelConfig, texts: Sequence[str], *, device: str | torch.device, seed: int = 0
) -> WanPipeline:
    """A ``WanPipeline`` of an architecture preset's full-size modules (``model=wan1_3b_t2v``) with
    random weights, built directly on ``device`` (nothing is downloaded): the text encoder and the
    DiT in bf16, the VAE in float32, as diffusers' Wan examples load them. For GPU benchmarks and
    tests; the tokenizer is the word tokenizer of ``texts`` (ids stay inside the real vocabulary)."""
    from transformers import AutoConfig

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
