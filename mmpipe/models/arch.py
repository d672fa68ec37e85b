"""Architecture-only training graphs of full-size presets (``configs/model/wan14b_t2v.yaml``,
``hunyuan_t2v``, ``u2g_full``, ...): each stage's module exists as a config only (``model.arch``);
the cost model instantiates it on the meta device, and asking one for weights is a clear error.
The stages and ports are those of the trainable graphs of :mod:`mmpipe.models.wan`,
:mod:`mmpipe.models.wan_i2v` (a preset with ``model.arch.image``, Wan 2.1 I2V's image encoder),
:mod:`mmpipe.models.ltx`, :mod:`mmpipe.models.cogvideox` and :mod:`mmpipe.models.u2g`.

The image families' presets (``model.kind=t2i``: FLUX.1, Qwen-Image) are not trained: their graph
is one request's stages (:mod:`mmpipe.stages.image`), which the serving planner costs."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLCogVideoX,
    AutoencoderKLHunyuanVideo,
    AutoencoderKLLTXVideo,
    AutoencoderKLQwenImage,
    AutoencoderKLWan,
    CogVideoXDPMScheduler,
    CogVideoXTransformer3DModel,
    FluxTransformer2DModel,
    HunyuanVideoTransformer3DModel,
    LTXVideoTransformer3DModel,
    QwenImageTransformer2DModel,
    WanTransformer3DModel,
)
from torch import nn
from transformers import AutoConfig

from mmpipe.config import ModelConfig
from mmpipe.graph import Graph, TensorSpec
from mmpipe.models.cogvideox import (
    COGVIDEOX_SCHEDULER_CONFIG,
    COGVIDEOX_TRAIN_EDGES,
    check_cogvideox_text_len,
    cogvideox_vae_spatial_scale,
)
from mmpipe.models.ltx import LTX_TRAIN_EDGES, ltx_vae_compression
from mmpipe.models.u2g import U2G_TRAIN_EDGES
from mmpipe.models.wan import T2V_TRAIN_EDGES, build_word_tokenizer
from mmpipe.stages import (
    CLIPImageEncoderStage,
    CogVideoXDiTStage,
    CogVideoXT5TextEncoderStage,
    CogVideoXVAEEncodeStage,
    WanDiTFlowMatchingStage,
    WanI2VDiTFlowMatchingStage,
    WanI2VVAEEncodeStage,
    WanVAEEncodeStage,
)
from mmpipe.stages._source import ModuleSource
from mmpipe.stages.dit import HunyuanVideoDiTFlowMatchingStage, LTXDiTFlowMatchingStage
from mmpipe.stages.image import (
    FluxDiTStage,
    FluxTextEncoderStage,
    FluxVAEEncodeStage,
    QwenImageDiTStage,
    QwenImageTextEncoderStage,
    QwenImageVAEEncodeStage,
)
from mmpipe.stages.multimodal import (
    ConnectorConfig,
    ConnectorStage,
    ImageProcessing,
    MultimodalLLMStage,
    VisionEncoderStage,
)
from mmpipe.stages.text import CausalLMTextEncoderStage, LTXT5TextEncoderStage, T5TextEncoderStage
from mmpipe.stages.vae import HunyuanVAEEncodeStage, LTXVAEEncodeStage

_DIFFUSERS = {
    ("vae", "wan"): AutoencoderKLWan,
    ("vae", "hunyuan"): AutoencoderKLHunyuanVideo,
    ("vae", "ltx"): AutoencoderKLLTXVideo,
    ("vae", "cogvideox"): AutoencoderKLCogVideoX,
    ("dit", "wan"): WanTransformer3DModel,
    ("dit", "hunyuan"): HunyuanVideoTransformer3DModel,
    ("dit", "ltx"): LTXVideoTransformer3DModel,
    ("dit", "cogvideox"): CogVideoXTransformer3DModel,
    ("vae", "flux"): AutoencoderKL,
    ("vae", "qwenimage"): AutoencoderKLQwenImage,
    ("dit", "flux"): FluxTransformer2DModel,
    ("dit", "qwenimage"): QwenImageTransformer2DModel,
}

#: DiTs that take one VAE's latents only (their family's), and the name of that family
_PAIRED = (
    (AutoencoderKLLTXVideo, LTXVideoTransformer3DModel, "LTX"),
    (AutoencoderKLCogVideoX, CogVideoXTransformer3DModel, "CogVideoX"),
    (AutoencoderKL, FluxTransformer2DModel, "FLUX.1"),
    (AutoencoderKLQwenImage, QwenImageTransformer2DModel, "Qwen-Image"),
)

#: the image families' DiTs (``model.kind=t2i`` presets, and only those)
_IMAGE_DITS = (FluxTransformer2DModel, QwenImageTransformer2DModel)


def build_arch_graph(model: ModelConfig) -> Graph:
    """The training graph of a full-size architecture preset (modules exist as configs only)."""

    arch = dict(model.arch or {})
    need = ["vae", "dit"] + (["vision", "llm", "connector"] if model.kind == "u2g" else ["text"])
    missing = [k for k in need if not arch.get(k)]
    if missing:
        raise ValueError(f"model {model.name!r}: model.arch needs {need}; missing {missing}")

    def source(role: str) -> ModuleSource:
        return ModuleSource(_config(role, arch[role], model.name), _no_weights(model.name, role))

    vae_cls = _family("vae", arch["vae"], model.name)
    dit_cls = _family("dit", arch["dit"], model.name)
    for paired_vae, paired_dit, family in _PAIRED:
        if (vae_cls is paired_vae) != (dit_cls is paired_dit):
            raise ValueError(
                f"model {model.name!r}: the {family} DiT and the {family} VAE go together; got "
                f"model.arch.vae.class={arch['vae'].get('class', 'wan')!r}, "
                f"model.arch.dit.class={arch['dit'].get('class', 'wan')!r}"
            )
    if (dit_cls in _IMAGE_DITS) != (model.kind == "t2i"):
        raise ValueError(
            f"model {model.name!r}: model.kind={model.kind!r} with model.arch.dit.class="
            f"{arch['dit'].get('class', 'wan')!r}; the image DiTs (flux, qwenimage) make model.kind=t2i presets, "
            "and only they do"
        )
    if dit_cls is FluxTransformer2DModel:
        return _flux_arch_graph(model, source)
    if dit_cls is QwenImageTransformer2DModel:
        return _qwenimage_arch_graph(model, source)
    if dit_cls is LTXVideoTransformer3DModel:
        return _ltx_arch_graph(model, source)
    if dit_cls is CogVideoXTransformer3DModel:
        return _cogvideox_arch_graph(model, source)
    if arch.get("image"):
        return _wan_i2v_arch_graph(model, source, dit_cls)
    vae = (HunyuanVAEEncodeStage if vae_cls is AutoencoderKLHunyuanVideo else WanVAEEncodeStage)("vae", source("vae"))
    dit_stage = (
        HunyuanVideoDiTFlowMatchingStage if dit_cls is HunyuanVideoTransformer3DModel else WanDiTFlowMatchingStage
    )
    dit = dit_stage("dit", source("dit"), shift=model.flow_shift)
    experts = [dit]
    if model.boundary_ratio is not None:  # Wan 2.2: two experts of one config, each on its noise range
        if dit_stage is not WanDiTFlowMatchingStage or model.kind != "t2v":
            raise ValueError(f"model {model.name!r}: model.boundary_ratio needs a Wan t2v DiT")
        b = model.boundary_ratio
        dit = dit_stage("dit", source("dit"), shift=model.flow_shift, sigma_range=(b, 1.0))
        experts = [dit, dit_stage("dit_2", source("dit"), shift=model.flow_shift, sigma_range=(0.0, b))]
    g = Graph(f"{model.name}_train")
    g.add_input("input_ids", TensorSpec(("B", model.text_len), torch.int64))
    g.add_input("attention_mask", TensorSpec(("B", model.text_len), torch.int64))
    g.add_input("video", TensorSpec(("B", 3, "T", "H", "W"), torch.float32))
    tokenizer = build_word_tokenizer(["a"])
    if model.kind == "t2v":
        text_src = source("text")
        text_cls = T5TextEncoderStage if hasattr(text_src.config, "d_model") else CausalLMTextEncoderStage
        g.add_stage(text_cls("text", text_src, tokenizer, max_length=model.text_len))
        edges: tuple[tuple[str, str], ...] = T2V_TRAIN_EDGES
    else:
        vision = VisionEncoderStage("vision", source("vision"))
        llm_src = source("llm")
        llm = MultimodalLLMStage(
            "llm",
            llm_src,
            num_image_tokens=vision.num_tokens,
            text_len=model.text_len,
            vision_width=vision.source.config.hidden_size,
        )
        conn_cfg = ConnectorConfig(**arch["connector"])
        connector = ConnectorStage(
            "connector",
            ModuleSource(conn_cfg, _no_weights(model.name, "connector")),
            seq_len=vision.num_tokens + model.text_len,
        )
        g.add_input("pixel_values", TensorSpec(("B", 3, vision.image_size, vision.image_size), torch.float32))
        for stage in (vision, llm, connector):
            g.add_stage(stage)
        edges = U2G_TRAIN_EDGES
    g.add_stage(vae)
    for expert in experts:
        g.add_stage(expert)
    for src, dst in edges:  # the same wiring as the trainable graphs of mmpipe.models.wan and mmpipe.models.u2g
        g.connect(src, dst)
    if len(experts) == 2:
        g.connect("text.context", "dit_2.context")
        g.connect("vae.latents", "dit_2.latents")
    g.validate()
    return g


def _ltx_arch_graph(model: ModelConfig, source: Callable[[str], ModuleSource]) -> Graph:
    """LTX-Video's training graph (:func:`~mmpipe.models.ltx.build_ltx_training_graph`'s stages and
    edges) on configs only; the shift is the preset's constant ``flow_shift``."""
    if model.kind != "t2v" or model.boundary_ratio is not None:
        raise ValueError(f"model {model.name!r}: an LTX preset is one-DiT text-to-video")
    vae_src = source("vae")
    g = Graph(f"{model.name}_train")
    g.add_input("input_ids", TensorSpec(("B", model.text_len), torch.int64))
    g.add_input("attention_mask", TensorSpec(("B", model.text_len), torch.int64))
    g.add_input("video", TensorSpec(("B", 3, "T", "H", "W"), torch.float32))
    tokenizer = build_word_tokenizer(["a"])
    g.add_stage(LTXT5TextEncoderStage("text", source("text"), tokenizer, max_length=model.text_len))
    g.add_stage(LTXVAEEncodeStage("vae", vae_src))
    compression = ltx_vae_compression(dict(vae_src.config))
    g.add_stage(LTXDiTFlowMatchingStage("dit", source("dit"), vae_compression=compression, shift=model.flow_shift))
    for src, dst in LTX_TRAIN_EDGES:
        g.connect(src, dst)
    g.validate()
    return g


def _cogvideox_arch_graph(model: ModelConfig, source: Callable[[str], ModuleSource]) -> Graph:
    """CogVideoX's training graph (:func:`~mmpipe.models.cogvideox.build_cogvideox_training_graph`'s
    stages and edges) on configs only, trained on CogVideoX-5B's scheduler (``model.flow_shift`` is
    not used: CogVideoX is a v-prediction DDPM)."""
    if model.kind != "t2v" or model.boundary_ratio is not None:
        raise ValueError(f"model {model.name!r}: a CogVideoX preset is one-DiT text-to-video")
    vae_src, dit_src = source("vae"), source("dit")
    check_cogvideox_text_len(model.text_len, dit_src.config)
    # CogVideoX-5B's scheduler_config.json has snr_shift_scale 1.0 (2B's: 3.0); the costs the
    # planner counts do not depend on it, only the trained noise levels do.
    scheduler = CogVideoXDPMScheduler(snr_shift_scale=1.0, **COGVIDEOX_SCHEDULER_CONFIG)
    g = Graph(f"{model.name}_train")
    g.add_input("input_ids", TensorSpec(("B", model.text_len), torch.int64))
    g.add_input("attention_mask", TensorSpec(("B", model.text_len), torch.int64))
    g.add_input("video", TensorSpec(("B", 3, "T", "H", "W"), torch.float32))
    tokenizer = build_word_tokenizer(["a"])
    g.add_stage(CogVideoXT5TextEncoderStage("text", source("text"), tokenizer, max_length=model.text_len))
    g.add_stage(CogVideoXVAEEncodeStage("vae", vae_src))
    spatial = cogvideox_vae_spatial_scale(vae_src.config)
    g.add_stage(CogVideoXDiTStage("dit", dit_src, scheduler=scheduler, vae_scale_factor_spatial=spatial))
    for src, dst in COGVIDEOX_TRAIN_EDGES:
        g.connect(src, dst)
    g.validate()
    return g


def _wan_i2v_arch_graph(model: ModelConfig, source: Callable[[str], ModuleSource], dit_cls: Any) -> Graph:
    """Wan 2.1 image-to-video's training graph (:func:`~mmpipe.models.wan_i2v.build_wan_i2v_training_graph`'s
    stages and edges) on configs only: ``model.arch.image`` is the CLIP image encoder (stage ``clip``,
    through OpenAI CLIP's image processing at its ``image_size``). ``model.kind`` is ``t2v``, as a
    local ``WanImageToVideoPipeline`` directory trains."""
    # Imported here: diffusers' WanImageToVideoPipeline module logs a warning at import without
    # torchvision, and importing mmpipe.models (every CLI start) must print nothing.
    from mmpipe.models.wan_i2v import check_i2v_text_len, connect_i2v_training_graph

    if dit_cls is not WanTransformer3DModel or model.kind != "t2v" or model.boundary_ratio is not None:
        raise ValueError(
            f"model {model.name!r}: model.arch.image (an image encoder) makes a Wan 2.1 I2V preset: one Wan DiT, "
            "model.kind=t2v, no boundary_ratio"
        )
    check_i2v_text_len(model.text_len)
    image_src = source("image")
    g = Graph(f"{model.name}_train")
    g.add_input("input_ids", TensorSpec(("B", model.text_len), torch.int64))
    g.add_input("attention_mask", TensorSpec(("B", model.text_len), torch.int64))
    g.add_input("video", TensorSpec(("B", 3, "T", "H", "W"), torch.float32))
    tokenizer = build_word_tokenizer(["a"])
    g.add_stage(T5TextEncoderStage("text", source("text"), tokenizer, max_length=model.text_len))
    processing = ImageProcessing.clip(image_src.config.image_size)
    g.add_stage(CLIPImageEncoderStage("clip", image_src, processing=processing))
    g.add_stage(WanI2VVAEEncodeStage("vae", source("vae")))
    g.add_stage(WanI2VDiTFlowMatchingStage("dit", source("dit"), shift=model.flow_shift))
    connect_i2v_training_graph(g, ["dit"])
    g.validate()
    return g


def _flux_arch_graph(model: ModelConfig, source: Callable[[str], ModuleSource]) -> Graph:
    """One FLUX.1 request on configs only (:mod:`mmpipe.stages.image`): T5 (``model.arch.text``,
    ``model.text_len`` tokens) and CLIP-L (``model.arch.text_2``, its pooled vector) in stage
    ``text``, the VAE's encode of a ``model.video`` image, one DiT call."""
    if not (model.arch or {}).get("text_2"):
        raise ValueError(
            f"model {model.name!r}: a FLUX.1 preset needs model.arch.text_2 (the CLIP text encoder of the "
            "pooled vector) beside model.arch.text (T5)"
        )
    t5, clip = source("text"), source("text_2")
    text_src = ModuleSource({"t5": t5.config, "clip": clip.config}, _no_weights(model.name, "text"))
    text = FluxTextEncoderStage("text", text_src, max_length=model.text_len)
    g = Graph(f"{model.name}_request")
    g.add_input("input_ids", TensorSpec(("B", model.text_len), torch.int64))
    g.add_input("clip_input_ids", TensorSpec(("B", text.clip_length), torch.int64))
    g.add_input("image", TensorSpec(("B", 3, "H", "W"), torch.float32))
    g.add_stage(text)
    g.add_stage(FluxVAEEncodeStage("vae", source("vae")))
    g.add_stage(FluxDiTStage("dit", source("dit")))
    for src, dst in (
        ("input.input_ids", "text.input_ids"),
        ("input.clip_input_ids", "text.clip_input_ids"),
        ("input.image", "vae.image"),
        ("text.context", "dit.context"),
        ("text.pooled", "dit.pooled"),
        ("vae.latents", "dit.latents"),
    ):
        g.connect(src, dst)
    g.validate()
    return g


def _qwenimage_arch_graph(model: ModelConfig, source: Callable[[str], ModuleSource]) -> Graph:
    """One Qwen-Image request on configs only (:mod:`mmpipe.stages.image`): Qwen2.5-VL on the
    prompt template and ``model.text_len`` prompt tokens, the VAE's encode of a one-frame
    ``model.video``, one DiT call."""
    text = QwenImageTextEncoderStage("text", source("text"), max_length=model.text_len)
    ids = text.inputs["input_ids"]
    g = Graph(f"{model.name}_request")
    g.add_input("input_ids", ids)
    g.add_input("attention_mask", ids)
    g.add_input("video", TensorSpec(("B", 3, 1, "H", "W"), torch.float32))
    g.add_stage(text)
    g.add_stage(QwenImageVAEEncodeStage("vae", source("vae")))
    g.add_stage(QwenImageDiTStage("dit", source("dit")))
    for src, dst in (
        ("input.input_ids", "text.input_ids"),
        ("input.attention_mask", "text.attention_mask"),
        ("input.video", "vae.video"),
        ("text.context", "dit.context"),
        ("text.context_mask", "dit.context_mask"),
        ("vae.latents", "dit.latents"),
    ):
        g.connect(src, dst)
    g.validate()
    return g


def _family(role: str, kw: Mapping[str, Any], preset: str) -> Any:
    family = kw.get("class", "wan")
    cls = _DIFFUSERS.get((role, family))
    if cls is None:
        known = sorted(f for r, f in _DIFFUSERS if r == role)
        raise ValueError(f"model {preset!r}: model.arch.{role}.class={family!r} is unknown; expected one of {known}")
    return cls


def _config(role: str, kw: Mapping[str, Any], preset: str) -> Any:
    """The full module config: transformers ``PretrainedConfig``, or a diffusers model's ``config``."""
    kw = dict(kw)
    if role in ("vae", "dit"):
        cls = _family(role, kw, preset)
        kw.pop("class", None)
        try:
            with torch.device("meta"):
                return cls.from_config(kw).config
        except (TypeError, ValueError) as e:
            raise ValueError(f"model {preset!r}: model.arch.{role} is not a valid {cls.__name__} config: {e}") from e
    if "model_type" not in kw:
        raise ValueError(f"model {preset!r}: model.arch.{role} needs a transformers model_type")
    try:
        return AutoConfig.for_model(kw.pop("model_type"), **kw)
    except (KeyError, ValueError) as e:
        raise ValueError(f"model {preset!r}: model.arch.{role}: {e}") from e


def _no_weights(preset: str, role: str) -> Callable[[], nn.Module]:
    def load() -> nn.Module:
        raise ValueError(
            f"model {preset!r} is an architecture-only preset: stage {role!r} has no weights "
            "(use it with `mmpipe plan`, or train a local pipeline with model.path=DIR)"
        )

    return load
