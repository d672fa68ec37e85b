"""Text encoder stages: T5 / UMT5 encoders and causal LMs (Qwen2, Llama) used as text encoders.

Both return the last hidden states with padded positions set to exactly zero, the way
``WanPipeline._get_t5_prompt_embeds`` trims each prompt to its length and pads with zeros.

Legend: B batch, L tokens (``max_length``), D hidden size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import AutoModel, PreTrainedTokenizerBase, UMT5EncoderModel

from mmpipe.graph import TensorSpec
from mmpipe.stages._source import ModuleSource, SourcedStage


def tokenize(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    max_length: int,
    clean: Callable[[str], str] | None = None,
) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` (int64, ``(B, max_length)``), padded like the diffusers pipelines."""
    if isinstance(prompts, str):
        raise ValueError("tokenize expects a list of prompts, got a single string")
    texts = [clean(p) if clean else p for p in prompts]
    enc = tokenizer(
        texts,
        padding="max_length",
        max_length=max_length,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    return {"input_ids": enc.input_ids.long(), "attention_mask": enc.attention_mask.long()}


class TextEncoderStage(SourcedStage):
    """Common ports and tokenisation of text encoders: ``input_ids, attention_mask -> context``."""

    kind = "text_encoder"
    hidden_size_key: ClassVar[str]

    def __init__(
        self,
        name: str,
        source: ModuleSource,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_length: int,
        clean: Callable[[str], str] | None = None,
    ) -> None:
        super().__init__(name, source, frozen=True)
        if max_length <= 0:
            raise ValueError(f"stage {name!r}: max_length must be positive, got {max_length}")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.hidden_size: int = getattr(source.config, self.hidden_size_key)
        self.clean = clean

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        # "L": ``max_length`` by default; a call may pad to its own (``max_sequence_length``)
        ids = TensorSpec(("B", "L"), torch.int64)
        optional_ids = TensorSpec(("B", "L"), torch.int64, required=False)
        return {
            "input_ids": ids,
            "attention_mask": ids,
            "negative_input_ids": optional_ids,
            "negative_attention_mask": optional_ids,
        }

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        context = TensorSpec(("B", "L", self.hidden_size))
        return {"context": context, "negative_context": dataclasses.replace(context, required=False)}

    def tokenize(self, prompts: Sequence[str], max_length: int | None = None) -> dict[str, torch.Tensor]:
        """Pad / truncate prompts to ``max_length`` tokens (the stage's by default), as the
        diffusers pipelines do."""
        length = self.max_length if max_length is None else max_length
        if length <= 0:
            raise ValueError(f"max_sequence_length must be positive, got {length}")
        return tokenize(self.tokenizer, prompts, max_length=length, clean=self.clean)

    def forward(self, module: nn.Module, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        out = {"context": self._encode(module, inputs["input_ids"], inputs["attention_mask"])}
        # The negative prompts of classifier-free guidance: a separate call, as the pipelines make.
        if "negative_input_ids" in inputs:
            out["negative_context"] = self._encode(
                module, inputs["negative_input_ids"], inputs["negative_attention_mask"]
            )
        return out

    def _encode(self, module: nn.Module, ids_BL: torch.Tensor, mask_BL: torch.Tensor) -> torch.Tensor:
        hidden_BLD = module(input_ids=ids_BL, attention_mask=mask_BL).last_hidden_state
        # Zero (not just ignore) padded positions: the DiT's cross-attention has no mask.
        return torch.where(mask_BL.bool().unsqueeze(-1), hidden_BLD, hidden_BLD.new_zeros(()))


class T5TextEncoderStage(TextEncoderStage):
    """A transformers ``UMT5EncoderModel`` / ``T5EncoderModel`` (Wan uses UMT5-XXL)."""

    model_cls = UMT5EncoderModel
    hidden_size_key = "d_model"


class CausalLMTextEncoderStage(TextEncoderStage):
    """A decoder-only LM (Qwen2, Llama, ...) whose last hidden states condition the DiT (no LM head)."""

    model_cls = AutoModel
    hidden_size_key = "hidden_size"
