"""Model-agnostic glue that makes unmodified diffusers / transformers attention run sequence parallel.

diffusers attention processors and transformers attention functions end in
``F.scaled_dot_product_attention`` on ``BHSD`` tensors. :class:`SequenceParallelProcessor` wraps a
diffusers processor and, for self-attention only, routes that one call to
:func:`~mmpipe.parallel.sequence.sequence_parallel_attention` (a ``TorchFunctionMode`` active for the
duration of the processor call), so projections, norms and rotary embeddings stay the model's own
code. Cross-attention is left alone: its queries are this rank's tokens and its keys / values the
whole (replicated) text context, which is already exact.

transformers models reach it through their attention-function registry: :func:`use_sequence_parallel_attention`
registers :func:`transformers_attention` under ``"mmpipe_sequence_parallel"`` and switches the model
to it; the model's forward then passes the :class:`SequenceState` as the ``mmpipe_sequence`` keyword,
which transformers hands through to every attention call. With that implementation transformers
builds no mask: the callers feed causal sequences whose padding is all at the end, which no real
token attends to.

The sequence's global length changes per call (resolution, frames), so it lives in a
:class:`SequenceState` that the stage sets around each forward (:meth:`SequenceState.tokens`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers import AttentionInterface

from mmpipe.parallel.attention import AttentionImpl
from mmpipe.parallel.sequence import SequenceMesh, joint_sequence_parallel_attention, sequence_parallel_attention


@dataclasses.dataclass
class SequenceState:
    """A stage replica's mesh and the sequence currently being processed (``length`` tokens, split in
    units of ``unit`` tokens, e.g. one latent frame)."""

    mesh: SequenceMesh
    impl: AttentionImpl | None = None
    length: int | None = None
    unit: int = 1

    @contextlib.contextmanager
    def tokens(self, length: int, *, unit: int = 1) -> Iterator[None]:
        """Within the block, attention calls see a sequence of ``length`` tokens."""
        self.length, self.unit = length, unit
        try:
            yield
        finally:
            self.length = None

    @property
    def token_mesh(self) -> SequenceMesh:
        """The mesh with the layout in tokens (units of ``unit`` tokens)."""
        return dataclasses.replace(self.mesh, layout=dataclasses.replace(self.mesh.layout, unit=self.unit))

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """``F.scaled_dot_product_attention``'s signature, over the whole split sequence."""
        if self.length is None:
            raise RuntimeError("sequence-parallel attention called outside SequenceState.tokens()")
        if attn_mask is not None or dropout_p or enable_gqa:
            raise ValueError(
                "sequence-parallel attention supports neither attention masks, dropout nor grouped-query "
                f"broadcasting (got attn_mask={attn_mask is not None}, dropout_p={dropout_p}, enable_gqa={enable_gqa})"
            )
        return sequence_parallel_attention(
            query, key, value, mesh=self.token_mesh, length=self.length, causal=is_causal, scale=scale, impl=self.impl
        )

    def joint_attention(self, tail: int) -> Callable[..., torch.Tensor]:
        """``F.scaled_dot_product_attention``'s signature for joint attention over this rank's tokens
        plus a replicated tail of ``tail`` tokens (text) at the end of the sequence; the boolean
        ``attn_mask`` ``(B, 1, 1, S + tail)`` may drop tail keys only."""

        def attend(
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attn_mask: torch.Tensor | None = None,
            dropout_p: float = 0.0,
            is_causal: bool = False,
            scale: float | None = None,
            enable_gqa: bool = False,
        ) -> torch.Tensor:
            if self.length is None:
                raise RuntimeError("sequence-parallel attention called outside SequenceState.tokens()")
            if dropout_p or is_causal or enable_gqa:
                raise ValueError("joint sequence-parallel attention is non-causal, without dropout or GQA")
            batch = query.shape[0]
            valid = torch.ones(batch, tail, dtype=torch.bool, device=query.device)
            if attn_mask is not None:
                mask = attn_mask.expand(batch, 1, 1, attn_mask.shape[-1]).reshape(batch, -1)
                if mask.dtype != torch.bool or not bool(mask[:, : mask.shape[1] - tail].all()):
                    raise ValueError("joint sequence-parallel attention takes a boolean mask over the tail keys only")
                valid = mask[:, mask.shape[1] - tail :]
            return joint_sequence_parallel_attention(
                query, key, value, valid, mesh=self.token_mesh, length=self.length, scale=scale, impl=self.impl
            )

        return attend


class RouteSDPA(TorchFunctionMode):
    """Sends ``F.scaled_dot_product_attention`` calls to ``fn``; everything else runs unchanged."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is F.scaled_dot_product_attention:
            return self.fn(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


class SequenceParallelProcessor:
    """A diffusers attention processor whose self-attention is sequence parallel (see the module doc)."""

    def __init__(self, inner: Any, state: SequenceState) -> None:
        self.inner, self.state = inner, state
        # diffusers' Attention.forward passes a processor only the keyword arguments its __call__
        # names (it reads inspect.signature(processor.__call__)): show it the wrapped processor's.
        self.__call__ = functools.wraps(inner.__call__)(functools.partial(type(self).__call__, self))  # type: ignore[method-assign]

    def __getattr__(self, name: str) -> Any:  # diffusers reads backend attributes off processors
        return getattr(self.inner, name)

    def __call__(
        self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: Any = None, *args: Any, **kwargs: Any
    ) -> Any:
        if encoder_hidden_states is not None:
            return self.inner(attn, hidden_states, encoder_hidden_states, *args, **kwargs)
        with RouteSDPA(self.state.attention):
            return self.inner(attn, hidden_states, None, *args, **kwargs)


class JointSequenceParallelProcessor(SequenceParallelProcessor):
    """A diffusers processor of *joint* attention (HunyuanVideo, Flux-style blocks: this rank's video
    tokens and the whole text context attend together): the one attention call runs over the whole
    split video sequence with the text as a replicated tail (see ``joint_sequence_parallel_attention``)."""

    def __call__(
        self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: Any = None, *args: Any, **kwargs: Any
    ) -> Any:
        tail = 0 if encoder_hidden_states is None else encoder_hidden_states.shape[1]
        with RouteSDPA(self.state.joint_attention(tail)):
            return self.inner(attn, hidden_states, encoder_hidden_states, *args, **kwargs)


SEQUENCE_ATTENTION = "mmpipe_sequence_parallel"


def transformers_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    mmpipe_sequence: SequenceState,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function (``BHSD`` in, ``BSHD`` out) over the whole split sequence."""
    if sliding_window is not None:
        raise ValueError(f"sequence-parallel attention has no sliding window (got sliding_window={sliding_window})")
    if query.shape[1] != key.shape[1]:  # grouped-query attention: the all-to-all needs whole query groups
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    out = mmpipe_sequence.attention(query, key, value, dropout_p=dropout, is_causal=module.is_causal, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def use_sequence_parallel_attention(model: Any) -> None:
    """Switch a transformers model's attention to :func:`transformers_attention` (registered once)."""

    AttentionInterface.register(SEQUENCE_ATTENTION, transformers_attention)
    model.set_attn_implementation(SEQUENCE_ATTENTION)
