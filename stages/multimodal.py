"""Stages of an understand-then-generate pipeline: a frozen vision tower, a trainable LLM reading
image and text tokens, and a trainable connector from the LLM's hidden states to the DiT's context.

The vision tower is an unmodified transformers ``SiglipVisionModel``; the LLM stage is a
transformers base model (``Qwen2Model``, ``LlamaModel``) fed ``inputs_embeds`` that prepend the
projected image tokens to the text embeddings. Each lives in its own sub-directory of the
pipeline directory (``vision/``, ``llm/lm``, ``llm/projector.safetensors``, ``connector/``).

Legend: B batch, N image tokens, L text tokens, V vision width, H LLM width, D DiT context width.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModel, SiglipVisionModel

from mmpipe.graph import Capabilities, TensorSpec
from mmpipe.parallel.attention import select_backend
from mmpipe.parallel.modules import SequenceState, use_sequence_parallel_attention
from mmpipe.parallel.sequence import SequenceMesh, check_heads
from mmpipe.stages._source import ModuleSource, SourcedStage


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
        context_BSD = module(inputs["hidden"])
        keep = inputs["mask"].bool().unsqueeze(-1)
        return {"context": torch.where(keep, context_BSD, context_BSD.new_zeros(()))}
