"""Understand-then-generate (``model.kind=u2g``): a vision tower and a multimodal LLM read an image
and an instruction, a connector maps the LLM's states into the DiT's context, and the Wan VAE and
DiT generate. The training graph and the tiny random-weight preset."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from diffusers import UniPCMultistepScheduler
from transformers import SiglipVisionConfig, SiglipVisionModel

from mmpipe.config import ModelConfig
from mmpipe.graph import Graph, TensorSpec
from mmpipe.models.wan import build_text_encoder, build_tiny_wan_pipeline, flow_shift_of
from mmpipe.stages import (
    WanDiTFlowMatchingStage,
    WanVAEEncodeStage,
)
from mmpipe.stages.multimodal import Connector, ConnectorStage, ImageTextLM, MultimodalLLMStage, VisionEncoderStage


def build_u2g_training_graph(pipeline_dir: str | Path, *, text_len: int) -> Graph:
    """Understand-then-generate: frozen vision tower -> trainable LLM (image + text tokens) ->
    trainable connector -> trainable DiT (flow matching), with the frozen Wan VAE encoding the
    target video. Gradients cross two stage boundaries (dit -> connector -> llm)."""

    root = Path(pipeline_dir)
    shift = flow_shift_of(UniPCMultistepScheduler.load_config(root / "scheduler"))
    vision = VisionEncoderStage.from_pretrained("vision", root / "vision")
    llm = MultimodalLLMStage.from_dir(
        "llm",
        root / "llm",
        vision_width=vision.source.config.hidden_size,
        num_image_tokens=vision.num_tokens,
        text_len=text_len,
    )
    g = Graph("u2g_train")
    g.add_input("pixel_values", TensorSpec(("B", 3, vision.image_size, vision.image_size), torch.float32))
    g.add_input("input_ids", TensorSpec(("B", text_len), torch.int64))
    g.add_input("attention_mask", TensorSpec(("B", text_len), torch.int64))
    g.add_input("video", TensorSpec(("B", 3, "T", "H", "W"), torch.float32))
    for stage in (
        vision,
        llm,
        ConnectorStage.from_dir("connector", root / "connector", seq_len=vision.num_tokens + text_len),
        WanVAEEncodeStage.from_pretrained("vae", root / "vae"),
        WanDiTFlowMatchingStage.from_pretrained("dit", root / "transformer", shift=shift),
    ):
        g.add_stage(stage)
    for src, dst in U2G_TRAIN_EDGES:
        g.connect(src, dst)
    g.validate()
    return g


VISION_IMAGE_SIZE = 32  # the tiny vision tower's square input; 16 patches of 8x8


def save_tiny_u2g_pipeline(spec: ModelConfig, texts: Sequence[str], path: str | Path, *, seed: int) -> Path:
    """An understand-then-generate pipeline: the Wan layout (vae/, transformer/, scheduler/,
    tokenizer/) plus vision/ (SigLIP), llm/ (Qwen2 + image projector) and connector/."""

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


U2G_TRAIN_STAGES = ("vision", "llm", "connector", "vae", "dit")  # those of build_u2g_training_graph


U2G_TRAIN_EDGES = (
    ("input.pixel_values", "vision.pixel_values"),
    ("vision.image_tokens", "llm.image_tokens"),
    ("input.input_ids", "llm.input_ids"),
    ("input.attention_mask", "llm.attention_mask"),
    ("llm.hidden", "connector.hidden"),
    ("llm.mask", "connector.mask"),
    ("connector.context", "dit.context"),
    ("input.video", "vae.video"),
    ("vae.latents", "dit.latents"),
)
