"""Understand-then-generate (``model.kind=u2g``): a vision tower and a multimodal LLM read an image
and an instruction, a connector maps the LLM's states into the DiT's context, and the Wan VAE and
DiT generate. The training graph, the tiny random-weight preset, and the inference graph of a
trained run (:class:`U2GGraph`: image + instruction -> video)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch
import torch.nn.functional as F
from diffusers import UniPCMultistepScheduler
from transformers import SiglipVisionConfig, SiglipVisionModel

from mmpipe.config import ModelConfig
from mmpipe.graph import Graph, TensorSpec
from mmpipe.models.pipeline_graph import prompt_list
from mmpipe.models.wan import T2VGraph, build_text_encoder, build_tiny_wan_pipeline, flow_shift_of
from mmpipe.stages import (
    DenoiseStage,
    WanDiTFlowMatchingStage,
    WanVAEDecodeStage,
    WanVAEEncodeStage,
)
from mmpipe.stages.multimodal import (
    Connector,
    ConnectorStage,
    ImageTextLM,
    InstructionContextStage,
    MultimodalLLMStage,
    VisionEncoderStage,
)


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


def vision_pixels(image_B3HW: torch.Tensor) -> torch.Tensor:
    """An image (a clip's first frame, in [-1, 1]) at the vision tower's resolution: what the
    training collator feeds ``pixel_values`` and what :class:`U2GGraph` feeds it at generation."""
    size = (VISION_IMAGE_SIZE, VISION_IMAGE_SIZE)
    return F.interpolate(image_B3HW.float(), size=size, mode="bilinear", antialias=True)


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


class U2GGraph(T2VGraph):
    """A trained understand-then-generate run as an inference graph: ``image`` (the still the vision
    tower reads) and ``prompt`` (the instruction) -> video. Stages: ``vision`` -> ``instruct`` (the
    run's LLM and connector, :class:`~mmpipe.stages.multimodal.InstructionContextStage`) ->
    ``denoise`` (the DiT and the pipeline's scheduler, classifier-free guidance against the same image
    with the negative instruction) -> ``decode`` (the Wan VAE); sizes, noise and decode as
    :class:`~mmpipe.models.wan.T2VGraph`'s."""

    def __init__(
        self,
        vision: VisionEncoderStage,
        instruct: InstructionContextStage,
        denoise: DenoiseStage,
        decode: WanVAEDecodeStage,
    ) -> None:
        # T2VGraph's wiring after its own prompt-reading stage: the vision tower feeds the LLM first
        Graph.__init__(self, "u2g_inference")
        self.vision, self.instruct = vision, instruct
        size = vision.image_size
        self.add_input("pixel_values", TensorSpec(("B", 3, size, size), torch.float32))
        for stage in (vision, instruct):
            self.add_stage(stage)
        self.connect("input.pixel_values", "vision.pixel_values")
        self.connect("vision.image_tokens", "instruct.image_tokens")
        self._denoise_and_decode(denoise, decode, prompts_to=instruct.name)

    def tokenize(self, prompts: Sequence[str], max_sequence_length: int | None) -> dict[str, Any]:
        """The instructions' tokens, for the LLM (padded to the run's ``text_len``)."""
        return self.instruct.tokenize(prompts, max_sequence_length)

    def generate(  # type: ignore[override]  # an image and an instruction, not WanPipeline's call
        self,
        image: torch.Tensor | PIL.Image.Image,
        prompt: str | Sequence[str],
        *,
        negative_prompt: str | Sequence[str] | None = None,
        height: int,
        width: int,
        num_frames: int,
        num_inference_steps: int = 20,
        guidance_scale: float = 3.0,
        seed: int | None = None,
        output_type: str = "np",
        progress: bool = True,
    ) -> Any:
        """Videos ``(B, T, H, W, 3)`` in [0, 1] (``output_type="np"``; ``"latent"``: the denoised
        latents) of what ``prompt`` tells to do with ``image`` (a PIL image, or a ``(3, H, W)`` /
        ``(B, 3, H, W)`` tensor in [-1, 1]; one image per prompt, or one for all), from the noise of
        ``torch.Generator().manual_seed(seed)``."""
        prompts = prompt_list(prompt)
        if output_type not in ("np", "latent"):
            raise ValueError(f"output_type must be 'np' or 'latent', got {output_type!r}")
        if isinstance(image, PIL.Image.Image):
            pixels_HWC = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32))
            image = pixels_HWC.permute(2, 0, 1) / 127.5 - 1.0
        if not isinstance(image, torch.Tensor) or image.dim() not in (3, 4) or image.shape[-3] != 3:
            got = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
            raise ValueError(f"image must be a (3, H, W) or (B, 3, H, W) tensor in [-1, 1], got {got}")
        images_B3HW = image.unsqueeze(0) if image.dim() == 3 else image
        if images_B3HW.shape[0] == 1:
            images_B3HW = images_B3HW.expand(len(prompts), -1, -1, -1)
        if images_B3HW.shape[0] != len(prompts):
            raise ValueError(f"{images_B3HW.shape[0]} images for {len(prompts)} prompts")
        height, width, num_frames = self._fit_size(height, width, num_frames)
        inputs = self.prompt_inputs(prompts, negative_prompt, guidance_scale)
        inputs["pixel_values"] = vision_pixels(images_B3HW)
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        shape = self.latent_shape(len(prompts), num_frames, height, width)
        inputs["noise"] = torch.randn(shape, generator=generator, dtype=torch.float32, device="cpu")
        options = {
            "denoise": {
                "num_inference_steps": num_inference_steps,
                "guidance_scale": float(guidance_scale),
                "progress": progress,
            }
        }
        latent = output_type == "latent"
        with torch.no_grad():
            out = self.run(inputs, options, until="denoise" if latent else None)
        if latent:
            return out["denoise"]["latents"]
        return self.video_processor.postprocess_video(out["decode"]["video"], output_type="np")


def load_u2g_graph(pipeline_dir: str | Path, *, text_len: int) -> U2GGraph:
    """The inference graph of an understand-then-generate pipeline directory (the tiny preset's
    layout, see :func:`save_tiny_u2g_pipeline`), on CPU, its modules as saved; a trained run's
    weights are loaded into it by :func:`~mmpipe.runtime.trained.load_trained_graph`."""
    root = Path(pipeline_dir)
    scheduler = UniPCMultistepScheduler.from_pretrained(root / "scheduler")
    vision = VisionEncoderStage.from_pretrained("vision", root / "vision")
    instruct = InstructionContextStage.from_dir(
        "instruct",
        root,
        vision_width=vision.source.config.hidden_size,
        num_image_tokens=vision.num_tokens,
        text_len=text_len,
    )
    denoise = DenoiseStage.from_pretrained("denoise", root / "transformer", scheduler)
    return U2GGraph(vision, instruct, denoise, WanVAEDecodeStage.from_pretrained("decode", root / "vae"))
