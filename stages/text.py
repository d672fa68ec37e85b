"""Text encoder stages: T5 / UMT5 encoders and causal LMs (Qwen2, Llama) used as text encoders.

Both return the last hidden states with padded positions set to exactly zero, the way
``WanPipeline._get_t5_prompt_embeds`` trims each prompt to its length and pads with zeros.

The pipelines whose DiT takes a text mask keep their own encodings: :class:`LTXT5TextEncoderStage`
(``LTXPipeline._get_t5_prompt_embeds``: T5 run without a mask, the mask handed on),
:class:`CogVideoXT5TextEncoderStage` (``CogVideoXPipeline._get_t5_prompt_embeds``: the same, no mask) and
:class:`HunyuanTextEncoderStage` (``HunyuanVideoPipeline.encode_prompt``: the Llama context of the
prompt template with its system part cropped, its mask, and CLIP's pooled vector). Graph inputs are
tensors, so prompts are tokenized in the data pipeline with the stage's own :meth:`tokenize`
(``mmpipe.train.data.Collator`` calls it), exactly as the pipeline tokenizes them.

Legend: B batch, L tokens (``max_length``), D hidden size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import (
    AutoModel,
    AutoTokenizer,
    CLIPTextModel,
    PreTrainedTokenizerBase,
    T5EncoderModel,
    UMT5EncoderModel,
)

from mmpipe.graph import TensorSpec
from mmpipe.stages._source import ModuleSource, SourcedStage


def prompt_specs() -> dict[str, TensorSpec]:
    """The token ports of a stage (or graph) that reads prompts for classifier-free guidance: the
    prompts' ids and mask and the negative prompts' (optional); "L" the padded length."""
    ids = TensorSpec(("B", "L"), torch.int64)
    optional_ids = TensorSpec(("B", "L"), torch.int64, required=False)
    return {
        "input_ids": ids,
        "attention_mask": ids,
        "negative_input_ids": optional_ids,
        "negative_attention_mask": optional_ids,
    }


def context_specs(width: int | str) -> dict[str, TensorSpec]:
    """``context`` and the optional ``negative_context`` (``(B, L, width)``) such a stage outputs."""
    context = TensorSpec(("B", "L", width))
    return {"context": context, "negative_context": dataclasses.replace(context, required=False)}


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
        return prompt_specs()

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        return context_specs(self.hidden_size)

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


class LTXT5TextEncoderStage(TextEncoderStage):
    """``input_ids, attention_mask -> context, context_mask``: ``LTXPipeline``'s T5 encoding.

    The encoder runs on the padded ids without a mask and its hidden states are kept as they are
    (``LTXPipeline._get_t5_prompt_embeds``); the mask goes on to the DiT (``encoder_attention_mask``).
    Prompts are not cleaned.
    """

    model_cls = T5EncoderModel
    hidden_size_key = "d_model"

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        mask = TensorSpec(("B", "L"), torch.int64)
        return {
            **super().outputs,
            "context_mask": mask,
            "negative_context_mask": dataclasses.replace(mask, required=False),
        }

    def forward(self, module: nn.Module, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        out = {"context": module(input_ids=inputs["input_ids"])[0], "context_mask": inputs["attention_mask"]}
        if "negative_input_ids" in inputs:
            out["negative_context"] = module(input_ids=inputs["negative_input_ids"])[0]
            out["negative_context_mask"] = inputs["negative_attention_mask"]
        return out


class CogVideoXT5TextEncoderStage(TextEncoderStage):
    """``input_ids, attention_mask -> context``: ``CogVideoXPipeline``'s T5 encoding.

    The encoder runs on the padded ids without a mask and its hidden states are kept as they are,
    padding included (``CogVideoXPipeline._get_t5_prompt_embeds``; the DiT takes no text mask). The
    prompts are tokenized to ``max_length`` tokens, the pipeline's ``max_sequence_length``: the
    transformer's ``max_text_seq_length`` (its sin-cos positions cover exactly that many text tokens).
    Prompts are not cleaned; ``attention_mask`` is accepted and unused, as the pipeline does.
    """

    model_cls = T5EncoderModel
    hidden_size_key = "d_model"

    def forward(self, module: nn.Module, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        out = {"context": module(input_ids=inputs["input_ids"])[0]}
        if "negative_input_ids" in inputs:
            out["negative_context"] = module(input_ids=inputs["negative_input_ids"])[0]
        return out


class HunyuanTextEncoderStage(SourcedStage):
    """``input_ids, attention_mask, clip_input_ids -> context, context_mask, pooled``:
    ``HunyuanVideoPipeline.encode_prompt`` as one stage over both text encoders.

    ``input_ids`` / ``attention_mask`` ``(B, crop_start + L)``: the Llama tokens of each prompt in
    ``prompt_template``; the context is the LM's hidden states ``hidden_layers_to_skip`` layers before
    the last, with the template's first ``crop_start`` tokens (its system part) cropped, as is the
    mask (``_get_llama_prompt_embeds``). ``clip_input_ids`` ``(B, clip_length)``: the CLIP tokens of
    the prompt (``prompt_2`` is the prompt), whose ``pooler_output`` is the pooled vector
    (``_get_clip_prompt_embeds``). The module is a ``ModuleDict`` of ``llama`` and ``clip``.
    """

    kind = "text_encoder"
    model_cls = nn.ModuleDict

    def __init__(
        self,
        name: str,
        source: ModuleSource,
        tokenizer: PreTrainedTokenizerBase,
        tokenizer_2: PreTrainedTokenizerBase,
        *,
        max_length: int,
        prompt_template: Mapping[str, Any],
        clip_length: int = 77,
        hidden_layers_to_skip: int = 2,
    ) -> None:
        super().__init__(name, source, frozen=True)
        if max_length <= 0:
            raise ValueError(f"stage {name!r}: max_length must be positive, got {max_length}")
        self.tokenizer, self.tokenizer_2 = tokenizer, tokenizer_2
        self.max_length, self.clip_length = max_length, clip_length
        self.template: str = prompt_template["template"]
        crop_start = prompt_template.get("crop_start")
        if crop_start is None:  # the pipeline's rule: the template's tokens less <|eot_id|> and "{}"
            ids = tokenizer(self.template, padding="max_length", return_attention_mask=False)["input_ids"]
            crop_start = len(ids) - 2
        self.crop_start = int(crop_start)
        self.hidden_layers_to_skip = hidden_layers_to_skip
        cfg = source.config
        self.hidden_size: int = cfg["llama"].hidden_size
        self.pooled_size: int = cfg["clip"].hidden_size

    @classmethod
    def from_pipeline_dir(
        cls, name: str, root: str | Path, *, max_length: int, prompt_template: Mapping[str, Any]
    ) -> HunyuanTextEncoderStage:
        """Both encoders of a ``HunyuanVideoPipeline`` directory (``text_encoder``, ``text_encoder_2``
        and their tokenizers), loaded lazily on the rank that runs the stage."""
        root = Path(root)
        llama = ModuleSource.from_pretrained(AutoModel, root / "text_encoder")
        clip = ModuleSource.from_pretrained(CLIPTextModel, root / "text_encoder_2")
        source = ModuleSource(
            config={"llama": llama.config, "clip": clip.config},
            load=lambda: nn.ModuleDict({"llama": llama.load(), "clip": clip.load()}),
        )
        tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
        tokenizer_2 = AutoTokenizer.from_pretrained(root / "tokenizer_2")
        return cls(name, source, tokenizer, tokenizer_2, max_length=max_length, prompt_template=prompt_template)

    def build_from_config(self) -> nn.Module:
        """Both encoders from their configs (the cost model builds them on the meta device)."""
        cfg = self.source.config
        return nn.ModuleDict({"llama": AutoModel.from_config(cfg["llama"]), "clip": CLIPTextModel(cfg["clip"])})

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        ids = TensorSpec(("B", self.crop_start + self.max_length), torch.int64)
        return {
            "input_ids": ids,
            "attention_mask": ids,
            "clip_input_ids": TensorSpec(("B", self.clip_length), torch.int64),
        }

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        return {
            "context": TensorSpec(("B", self.max_length, self.hidden_size)),
            "context_mask": TensorSpec(("B", self.max_length), torch.int64),
            "pooled": TensorSpec(("B", self.pooled_size)),
        }

    def tokenize(self, prompts: Sequence[str], max_length: int | None = None) -> dict[str, torch.Tensor]:
        """The stage's inputs for ``prompts``, tokenized as ``HunyuanVideoPipeline.encode_prompt`` does
        (``max_length``: the prompt tokens after the crop, the stage's by default)."""
        if isinstance(prompts, str):
            raise ValueError("tokenize expects a list of prompts, got a single string")
        length = self.max_length if max_length is None else max_length
        llama = self.tokenizer(
            [self.template.format(p) for p in prompts],
            max_length=self.crop_start + length,
            padding="max_length",
            truncation=True,
            return_tensors="pt",
            return_attention_mask=True,
        )
        clip = self.tokenizer_2(
            list(prompts), padding="max_length", max_length=self.clip_length, truncation=True, return_tensors="pt"
        )
        return {
            "input_ids": llama.input_ids.long(),
            "attention_mask": llama.attention_mask.long(),
            "clip_input_ids": clip.input_ids.long(),
        }

    def forward(self, module: nn.Module, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        mask_BL = inputs["attention_mask"]
        encoders: Any = module  # nn.ModuleDict
        llama, clip = encoders["llama"], encoders["clip"]
        hidden = llama(input_ids=inputs["input_ids"], attention_mask=mask_BL, output_hidden_states=True).hidden_states
        context_BLD = hidden[-(self.hidden_layers_to_skip + 1)]
        pooled_BD = clip(inputs["clip_input_ids"], output_hidden_states=False).pooler_output
        crop = self.crop_start
        return {"context": context_BLD[:, crop:], "context_mask": mask_BL[:, crop:], "pooled": pooled_BD}
