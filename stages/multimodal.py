"""Stages of an understand-then-generate pipeline: a frozen vision tower, a trainable LLM reading
image and text tokens, and a trainable connector from the LLM's hidden states to the DiT's context;
and the frozen CLIP image encoder of image-to-video pipelines (:class:`CLIPImageEncoderStage`, Wan
2.1 I2V's ``image_encoder``), with its ``image_processor``'s steps on tensors (:class:`ImageProcessing`).

The vision tower is an unmodified transformers ``SiglipVisionModel``; the LLM stage is a
transformers base model (``Qwen2Model``, ``LlamaModel``) fed ``inputs_embeds`` that prepend the
projected image tokens to the text embeddings. Each lives in its own sub-directory of the
pipeline directory (``vision/``, ``llm/lm``, ``llm/projector.safetensors``, ``connector/``).

Legend: B batch, N image tokens, L text tokens, V vision width, H LLM width, D DiT context width
(CLIP's width for the CLIP stage), T/H/W video frames/height/width (the ``H`` of pixels).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self, cast

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModel,
    AutoTokenizer,
    CLIPVisionModel,
    SiglipVisionModel,
)
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from mmpipe.graph import Capabilities, TensorSpec
from mmpipe.parallel.attention import select_backend
from mmpipe.parallel.modules import SequenceState, use_sequence_parallel_attention
from mmpipe.parallel.sequence import SequenceMesh, check_heads
from mmpipe.stages._source import ModuleSource, SourcedStage
from mmpipe.stages.text import context_specs, prompt_specs, tokenize


class VisionEncoderStage(SourcedStage):
    """``pixel_values (B, 3, S, S) -> image_tokens (B, N, V)``: the vision tower's last hidden states."""

    kind = "vision_encoder"
    model_cls = SiglipVisionModel
    capabilities = Capabilities(offload=True)

    def __init__(self, name: str, source: ModuleSource) -> None:
        super().__init__(name, source, frozen=True)
        cfg = source.config
        self.image_size: int = cfg.image_size
        self.num_tokens = (cfg.image_size // cfg.patch_size) ** 2

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        return {"pixel_values": TensorSpec(("B", 3, self.image_size, self.image_size), torch.float32)}

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        return {"image_tokens": TensorSpec(("B", self.num_tokens, self.source.config.hidden_size))}

    def forward(self, module: nn.Module, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        return {"image_tokens": module(pixel_values=inputs["pixel_values"]).last_hidden_state}


class ImageTextLM(nn.Module):
    """A base LM plus a linear projector of image tokens into its embedding space."""

    def __init__(self, lm: nn.Module, vision_width: int) -> None:
        super().__init__()
        self.lm = lm
        config: Any = lm.config
        self.projector = nn.Linear(vision_width, config.hidden_size)

    def save(self, path: Path) -> None:
        """``path/lm`` (``save_pretrained``) and ``path/projector.safetensors``."""
        lm: Any = self.lm
        lm.save_pretrained(path / "lm")
        save_file(self.projector.state_dict(), str(path / "projector.safetensors"))

    @classmethod
    def load(cls, path: Path, vision_width: int) -> ImageTextLM:
        """Inverse of :meth:`save`."""
        model = cls(AutoModel.from_pretrained(path / "lm"), vision_width)
        model.projector.load_state_dict(load_file(str(path / "projector.safetensors")))
        return model

    def forward(
        self,
        image_tokens_BNV: torch.Tensor,
        input_ids_BL: torch.Tensor,
        attention_mask_BL: torch.Tensor,
        sequence: SequenceState | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden, mask)`` of the image + text sequence; with ``sequence``, of this rank's tokens
        only (see :class:`MultimodalLLMStage`). One ``forward`` so that FSDP2's hooks wrap all of it."""
        image_BNH = self.projector(image_tokens_BNV)
        lm: Any = self.lm
        text_BLH = lm.get_input_embeddings()(input_ids_BL)
        ones_BN = torch.ones(image_BNH.shape[:2], dtype=torch.int64, device=image_BNH.device)
        mask_BS = torch.cat([ones_BN, attention_mask_BL], dim=1)
        embeds_BSH = torch.cat([image_BNH, text_BLH], dim=1)
        if sequence is None:
            hidden_BSH = lm(inputs_embeds=embeds_BSH, attention_mask=mask_BS).last_hidden_state
            return hidden_BSH.masked_fill(~mask_BS.bool().unsqueeze(-1), 0), mask_BS
        if bool((mask_BS[:, 1:] > mask_BS[:, :-1]).any()):
            raise ValueError("sequence parallelism needs right-padded text (padding last)")
        length = embeds_BSH.shape[1]
        pos_S = sequence.mesh.layout.positions(length, sequence.mesh.index, device=embeds_BSH.device)
        with sequence.tokens(length):
            hidden_BsH = lm(
                inputs_embeds=embeds_BSH[:, pos_S],
                position_ids=pos_S.unsqueeze(0).expand(embeds_BSH.shape[0], -1),
                mmpipe_sequence=sequence,
            ).last_hidden_state
        return hidden_BsH.masked_fill(~mask_BS[:, pos_S].bool().unsqueeze(-1), 0), mask_BS


class MultimodalLLMStage(SourcedStage):
    """``image_tokens, input_ids, attention_mask -> hidden (B, N + L, H), mask``, trainable; hidden
    states at padded positions are zero.

    Sequence parallel (causal: a zig-zag split of the image + text sequence), every rank embeds the
    whole (short) input, keeps its tokens with their true positions, runs the LM on them with
    ring / Ulysses attention and outputs its tokens' hidden states: the ``hidden`` port is split,
    so consumers receive each rank's part directly. Padding must be at the end (right padding), where
    causal attention never lets a real token see it; the padding mask is then not needed.
    """

    kind = "llm"
    capabilities = Capabilities(sequence_parallel=True, fsdp=True, offload=True)
    sequence_outputs = {"hidden": 1}
    sequence_causal = True

    def __init__(
        self, name: str, source: ModuleSource, *, num_image_tokens: int, text_len: int, vision_width: int
    ) -> None:
        super().__init__(name, source, frozen=False)
        self.num_image_tokens, self.text_len, self.vision_width = num_image_tokens, text_len, vision_width
        self._sequence: SequenceState | None = None

    def check_sequence_parallel(self, ulysses: int, ring: int) -> None:
        super().check_sequence_parallel(ulysses, ring)
        cfg = self.source.config
        check_heads(cfg.num_attention_heads, ulysses, what=f"stage {self.name!r}")
        if getattr(cfg, "use_sliding_window", False) and ulysses * ring > 1:
            raise ValueError(f"stage {self.name!r}: sliding-window attention cannot run sequence parallel")

    def parallelize_sequence(self, module: nn.Module, mesh: SequenceMesh, *, attention: str = "torch") -> None:
        assert isinstance(module, ImageTextLM)
        use_sequence_parallel_attention(module.lm)
        self._sequence = SequenceState(mesh, select_backend(attention))

    def sequence_length(self, inputs: Mapping[str, Any]) -> int:
        return inputs["image_tokens"].shape[1] + inputs["input_ids"].shape[1]

    def build_from_config(self) -> ImageTextLM:
        """A randomly initialised module of this stage's architecture (the cost model builds it on meta)."""
        return ImageTextLM(AutoModel.from_config(self.source.config), self.vision_width)

    @classmethod
    def from_dir(
        cls, name: str, path: Path, *, vision_width: int, num_image_tokens: int, text_len: int
    ) -> MultimodalLLMStage:
        """Load lazily from ``path`` (see :meth:`ImageTextLM.save`)."""
        source = ModuleSource(AutoConfig.from_pretrained(path / "lm"), lambda: ImageTextLM.load(path, vision_width))
        return cls(name, source, num_image_tokens=num_image_tokens, text_len=text_len, vision_width=vision_width)

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        ids = TensorSpec(("B", self.text_len), torch.int64)
        return {"image_tokens": TensorSpec(("B", self.num_image_tokens, "V")), "input_ids": ids, "attention_mask": ids}

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        seq = self.num_image_tokens + self.text_len
        return {
            "hidden": TensorSpec(("B", seq, self.source.config.hidden_size)),
            "mask": TensorSpec(("B", seq), torch.int64),
        }

    def forward(self, module: nn.Module, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        hidden, mask = module(inputs["image_tokens"], inputs["input_ids"], inputs["attention_mask"], self._sequence)
        return {"hidden": hidden, "mask": mask}


class Connector(nn.Module):
    """A two-layer MLP from LLM hidden states to DiT context (saved as ``config.json`` + safetensors)."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.in_dim, self.out_dim = in_dim, out_dim
        self.mlp = nn.Sequential(nn.Linear(in_dim, out_dim), nn.GELU(approximate="tanh"), nn.Linear(out_dim, out_dim))

    def forward(self, hidden_BSH: torch.Tensor) -> torch.Tensor:
        """``(B, S, H) -> (B, S, D)``."""
        return self.mlp(hidden_BSH)

    def save(self, path: Path) -> None:
        """Write ``path/config.json`` and ``path/connector.safetensors``."""
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps({"in_dim": self.in_dim, "out_dim": self.out_dim}))
        save_file(self.state_dict(), str(path / "connector.safetensors"))

    @classmethod
    def load(cls, path: Path) -> Connector:
        """Inverse of :meth:`save`."""
        cfg = json.loads((path / "config.json").read_text())
        model = cls(cfg["in_dim"], cfg["out_dim"])
        model.load_state_dict(load_file(str(path / "connector.safetensors")))
        return model


@dataclasses.dataclass(frozen=True)
class ConnectorConfig:
    """The connector's widths: LLM hidden size in, DiT context width out."""

    in_dim: int
    out_dim: int


class ConnectorStage(SourcedStage):
    """``hidden (B, S, H), mask -> context (B, S, D)`` with padded positions zeroed, trainable."""

    kind = "connector"
    capabilities = Capabilities(fsdp=True)

    def __init__(self, name: str, source: ModuleSource, *, seq_len: int) -> None:
        super().__init__(name, source, frozen=False)
        self.seq_len = seq_len

    @classmethod
    def from_dir(cls, name: str, path: Path, *, seq_len: int) -> ConnectorStage:
        """Load lazily from ``path`` (see :meth:`Connector.save`)."""
        cfg = json.loads((path / "config.json").read_text())
        return cls(name, ModuleSource(ConnectorConfig(**cfg), lambda: Connector.load(path)), seq_len=seq_len)

    def build_from_config(self) -> Connector:
        """A randomly initialised connector of this stage's widths."""
        return Connector(self.source.config.in_dim, self.source.config.out_dim)

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        cfg = self.source.config
        return {
            "hidden": TensorSpec(("B", self.seq_len, cfg.in_dim)),
            "mask": TensorSpec(("B", self.seq_len), torch.int64),
        }

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        return {"context": TensorSpec(("B", self.seq_len, self.source.config.out_dim))}

    def forward(self, module: nn.Module, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        return {"context": masked_context(module(inputs["hidden"]), inputs["mask"])}


def masked_context(context_BSD: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
    """``context`` with the padded positions zeroed (the DiT's cross-attention has no mask)."""
    return torch.where(mask_BS.bool().unsqueeze(-1), context_BSD, context_BSD.new_zeros(()))


class InstructionContextStage(SourcedStage):
    """``image_tokens, input_ids, attention_mask[, negative_*] -> context[, negative_context]``: the
    trained LLM and connector of an understand-then-generate run, frozen, for generation. The module
    is ``{"llm": ImageTextLM, "connector": Connector}`` (the training stages' own modules, whose
    weights a checkpoint's ``llm`` and ``connector`` hold); the negative context (classifier-free
    guidance) reads the same image with the negative instruction, as training's dropped captions do.
    """

    kind = "instruction_context"

    def __init__(self, name: str, source: ModuleSource, tokenizer: Any, *, text_len: int, num_image_tokens: int):
        super().__init__(name, source, frozen=True)
        self.tokenizer, self.text_len, self.num_image_tokens = tokenizer, text_len, num_image_tokens

    @classmethod
    def from_dir(cls, name: str, root: Path, *, vision_width: int, num_image_tokens: int, text_len: int) -> Self:
        """Load lazily from an understand-then-generate pipeline directory's ``llm/``, ``connector/``
        and ``tokenizer/``."""

        def load() -> nn.Module:
            return nn.ModuleDict(
                {"llm": ImageTextLM.load(root / "llm", vision_width), "connector": Connector.load(root / "connector")}
            )

        source = ModuleSource(AutoConfig.from_pretrained(root / "llm" / "lm"), load)
        tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
        return cls(name, source, tokenizer, text_len=text_len, num_image_tokens=num_image_tokens)

    def tokenize(self, prompts: Sequence[str], max_length: int | None = None) -> dict[str, torch.Tensor]:
        """The instructions' tokens, padded to the run's ``text_len`` as training pads them."""
        return tokenize(self.tokenizer, prompts, max_length=max_length or self.text_len, clean=None)

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        return {"image_tokens": TensorSpec(("B", self.num_image_tokens, "V"))} | prompt_specs()

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        return context_specs("D")

    def forward(self, module: nn.Module, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        parts = cast(nn.ModuleDict, module)

        def encode(ids_BL: torch.Tensor, mask_BL: torch.Tensor) -> torch.Tensor:
            hidden_BSH, mask_BS = parts["llm"](inputs["image_tokens"], ids_BL, mask_BL)
            return masked_context(parts["connector"](hidden_BSH), mask_BS)

        out = {"context": encode(inputs["input_ids"], inputs["attention_mask"])}
        if "negative_input_ids" in inputs:
            out["negative_context"] = encode(inputs["negative_input_ids"], inputs["negative_attention_mask"])
        return out


# ---- CLIP image encoder (image-to-video) ------------------------------------------------------------

_PIL_PRECISION_BITS = 22  # Pillow's Resample.c at 8 bits a channel: 32 - 8 - 2


def _pil_filter(resample: int) -> tuple[float, Callable[[float], float]]:
    """Pillow's resampling filter ``(support, kernel)`` of a ``PIL.Image.Resampling`` value."""

    def bilinear(x: float) -> float:
        x = abs(x)
        return 1.0 - x if x < 1.0 else 0.0

    def bicubic(x: float) -> float:  # Pillow's a = -0.5
        x = abs(x)
        if x < 1.0:
            return (1.5 * x - 2.5) * x * x + 1
        if x < 2.0:
            return (((x - 5) * x + 8) * x - 4) * -0.5
        return 0.0

    match resample:
        case 2:
            return 1.0, bilinear
        case 3:
            return 2.0, bicubic
    raise ValueError(f"resample={resample}: the tensor image steps do Pillow's bilinear (2) and bicubic (3) only")


def pil_resample_weights(in_size: int, out_size: int, resample: int) -> torch.Tensor:
    """Pillow's fixed-point weights ``(out_size, in_size)`` of one resampling pass over an 8-bit
    image (``precompute_coeffs`` then ``normalize_coeffs_8bpc`` in Pillow's ``Resample.c``, the
    same double-precision operations in the same order)."""
    support, kernel = _pil_filter(resample)
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support *= filterscale
    inv = 1.0 / filterscale
    weights = torch.zeros((out_size, in_size), dtype=torch.float64)
    for xx in range(out_size):
        center = (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size) - xmin
        w = [kernel((x + xmin - center + 0.5) * inv) for x in range(xmax)]
        total = 0.0
        for v in w:
            total += v
        for x, v in enumerate(w):
            v = v / total if total != 0.0 else v
            weights[xx, xmin + x] = int(v * (1 << _PIL_PRECISION_BITS) + (0.5 if v >= 0 else -0.5))
    return weights


def pil_resize(image_BCHW: torch.Tensor, size: tuple[int, int], resample: int) -> torch.Tensor:
    """``image`` (an 8-bit image's integer values, in a float dtype) resized to ``size`` ``(height,
    width)`` exactly as Pillow's ``Image.resize`` resizes the 8-bit image (no ``reducing_gap``): a
    horizontal then a vertical pass with fixed-point weights, each rounded back to 8 bits. The sums
    are of integers below 2^53, so float64 computes them exactly in any order."""
    height, width = image_BCHW.shape[-2:]
    x = image_BCHW.double()
    if width != size[1]:
        x = _pil_pass(x, pil_resample_weights(width, size[1], resample))
    if height != size[0]:
        x = _pil_pass(x.transpose(-1, -2), pil_resample_weights(height, size[0], resample)).transpose(-1, -2)
    return x.to(image_BCHW.dtype)


def _pil_pass(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One pass along the last dim: Pillow's ``ss = (1 << 21) + sum(in * k)``, ``clip8(ss >> 22)``."""
    ss = x @ weights.to(x.device).T + (1 << (_PIL_PRECISION_BITS - 1))
    return torch.floor(ss / (1 << _PIL_PRECISION_BITS)).clamp(0, 255)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageProcessing:
    """A CLIP image processor's steps as data, applied to tensors by :meth:`__call__` exactly as
    ``transformers``' Pillow backend (``CLIPImageProcessorPil``, what ``CLIPImageProcessor`` loads
    without torchvision) applies them to an 8-bit image: Pillow's resize, a centre crop, the float64
    rescale cast to float32 and the float32 normalisation. (The torchvision backend resizes with
    torchvision's own antialiased bicubic, which differs from Pillow's by rounding.)"""

    resize: int | tuple[int, int] | None  # the shorter side (the aspect kept), or (height, width)
    resample: int  # a PIL.Image.Resampling value
    crop: tuple[int, int] | None  # (height, width)
    rescale: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @classmethod
    def from_processor(cls, processor: Any) -> ImageProcessing:
        """The steps a loaded ``CLIPImageProcessor`` is configured to take."""
        size, crop = processor.size, processor.crop_size
        resize: int | tuple[int, int] | None = None
        if processor.do_resize:
            resize = size.shortest_edge if size.shortest_edge else (size.height, size.width)
        return cls(
            resize=resize,
            resample=int(processor.resample),
            crop=(crop.height, crop.width) if processor.do_center_crop else None,
            rescale=float(processor.rescale_factor) if processor.do_rescale else None,
            mean=tuple(processor.image_mean) if processor.do_normalize else None,
            std=tuple(processor.image_std) if processor.do_normalize else None,
        )

    @classmethod
    def clip(cls, image_size: int) -> ImageProcessing:
        """The steps of a ``CLIPImageProcessor`` with OpenAI CLIP's settings for ``image_size``
        pixels: bicubic resize of the shorter side, centre crop, rescale by 1/255, CLIP's mean and std
        (what Wan 2.1 I2V's ``image_processor`` holds, at 224)."""
        return cls(
            resize=image_size,
            resample=3,  # PIL.Image.Resampling.BICUBIC
            crop=(image_size, image_size),
            rescale=1 / 255,
            mean=tuple(OPENAI_CLIP_MEAN),
            std=tuple(OPENAI_CLIP_STD),
        )

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """``(height, width)`` after the resize (``get_resize_output_image_size``'s rounding)."""
        if self.resize is None:
            return height, width
        if isinstance(self.resize, tuple):
            return self.resize
        short, long = sorted((height, width))
        new_long = int(self.resize * long / short)
        return (new_long, self.resize) if width <= height else (self.resize, new_long)

    def __call__(self, image_B3HW: torch.Tensor) -> torch.Tensor:
        """``image`` (an 8-bit image's integer values, any float dtype) -> ``pixel_values`` float32."""
        x = image_B3HW.float()
        size = self.output_size(*x.shape[-2:])
        if size != tuple(x.shape[-2:]):  # Image.resize to its own size is a copy
            x = pil_resize(x, size, self.resample)
        if self.crop is not None:
            (height, width), (crop_h, crop_w) = x.shape[-2:], self.crop
            top, left = (height - crop_h) // 2, (width - crop_w) // 2
            if top < 0 or left < 0:
                raise ValueError(f"a {height}x{width} image is smaller than the {crop_h}x{crop_w} crop")
            x = x[..., top : top + crop_h, left : left + crop_w]
        if self.rescale is not None:
            x = (x.double() * self.rescale).float()
        if self.mean is not None and self.std is not None:
            mean_3, std_3 = (torch.tensor(v, dtype=torch.float32, device=x.device) for v in (self.mean, self.std))
            x = (x - mean_3.view(-1, 1, 1)) / std_3.view(-1, 1, 1)
        return x


class CLIPImageEncoderStage(SourcedStage):
    """``video (B, 3, T, H, W) in [-1, 1] -> image_embeds (B, N, D)``: ``WanImageToVideoPipeline.
    encode_image`` of each clip's first frame, frozen; with ``last_frame`` (FLF2V) of its first and
    last frames, ``(B, 2N, D)``: the first frame's tokens then the last's.

    The frame becomes the 8-bit image the pipeline would be given (diffusers' ``pt_to_numpy`` then
    ``numpy_to_pil``: ``round(clamp(x / 2 + 0.5, 0, 1) * 255)``), goes through the
    ``image_processor``'s steps (:class:`ImageProcessing`) and the CLIP vision tower; the embeddings
    are its penultimate hidden states (``hidden_states[-2]``), as the pipeline takes them.
    """

    kind = "image_encoder"
    model_cls = CLIPVisionModel
    capabilities = Capabilities(offload=True)

    def __init__(
        self, name: str, source: ModuleSource, *, processing: ImageProcessing, last_frame: bool = False
    ) -> None:
        super().__init__(name, source, frozen=True)
        self.processing = processing
        self.last_frame = last_frame
        cfg = source.config
        self.num_tokens = (cfg.image_size // cfg.patch_size) ** 2 + 1  # the patches and the class token

    @classmethod
    def from_pipeline_dir(cls, name: str, root: Path, *, last_frame: bool = False) -> CLIPImageEncoderStage:
        """The pipeline directory's ``image_encoder`` (loaded lazily) and ``image_processor``."""
        processor = AutoImageProcessor.from_pretrained(root / "image_processor")  # the class the pipeline loads
        processing = ImageProcessing.from_processor(processor)
        return cls.from_pretrained(name, root / "image_encoder", processing=processing, last_frame=last_frame)

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        return {"video": TensorSpec(("B", 3, "T", "H", "W"), torch.float32)}

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        tokens = self.num_tokens * (2 if self.last_frame else 1)
        return {"image_embeds": TensorSpec(("B", tokens, self.source.config.hidden_size))}

    def forward(self, module: nn.Module, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        video_B3THW = inputs["video"]
        frames = [video_B3THW[:, :, 0], video_B3THW[:, :, -1]] if self.last_frame else [video_B3THW[:, :, 0]]
        image_F3HW = ((torch.cat(frames).float() / 2 + 0.5).clamp(0, 1) * 255).round()  # firsts, then lasts
        pixels_F3SS = self.processing(image_F3HW)
        dtype = next(module.parameters()).dtype
        hidden_FND = module(pixel_values=pixels_F3SS.to(dtype), output_hidden_states=True).hidden_states[-2]
        # each clip's frames side by side on the token axis: (B, len(frames) * N, D)
        return {"image_embeds": torch.cat(hidden_FND.chunk(len(frames)), dim=1)}
