"""The kernels swapped into diffusers' Wan DiT (``WanTransformer3DModel``), without forking it.

:func:`use_kernels` changes, per the choice:

- ``norm_modulate``: each block's ``forward`` becomes :func:`_block_forward`, diffusers'
  ``WanTransformerBlock.forward`` with its two ``norm(x) * (1 + scale) + shift`` lines through
  :func:`mmpipe.kernels.norm.norm_modulate`, and the gated attention residual with the
  cross-attention norm through :func:`mmpipe.kernels.norm.gated_norm_modulate`;
- ``rope``: the model's rotary module returns a :class:`GridRotary` (the token grid, not cosine and
  sine tables) and the self-attention processor rotates queries and keys with
  :func:`mmpipe.kernels.rope.rope3d`;
- ``attention``: the self-attention processor computes attention with the chosen backend of
  ``mmpipe.parallel.attention`` (under sequence parallelism the sequence-parallel processor routes
  it, and its local attention uses the same backend).

The equivalence with the stock modules is tested (``tests/unit/test_kernels.py``).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, cast

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_wan import _get_qkv_projections
from torch import nn
from torch.overrides import _get_current_function_mode_stack

from mmpipe.kernels.norm import gated_norm_modulate, norm_modulate
from mmpipe.kernels.registry import KernelChoice
from mmpipe.kernels.rope import rope3d
from mmpipe.parallel.attention import local_attention, select_backend
from mmpipe.parallel.modules import RouteSDPA


@dataclasses.dataclass(frozen=True)
class GridRotary:
    """What the rotary module returns with the ``rope`` kernel: the ``(F, H, W)`` token grid, the
    rotary base and the first token's index (a sequence-parallel rank's offset)."""

    grid: tuple[int, int, int]
    theta: float
    token_offset: int = 0

    def __iter__(self) -> Any:  # diffusers unpacks rotary_emb only inside the (replaced) processor
        raise TypeError("GridRotary is consumed by mmpipe's Wan attention processor, not unpacked")


def _rope_forward(rope: Any, hidden_states: torch.Tensor) -> GridRotary:
    _, _, f, h, w = hidden_states.shape
    p_t, p_h, p_w = rope.patch_size
    return GridRotary((f // p_t, h // p_h, w // p_w), float(getattr(rope, "theta", 10000.0)))  # diffusers' default


class KernelWanAttnProcessor:
    """diffusers' ``WanAttnProcessor`` for text-to-video (no image context) with mmpipe's rotary
    and attention kernels."""

    def __init__(self, attention: str) -> None:
        self.attention = attention

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: Any = None,
    ) -> torch.Tensor:
        if attn.add_k_proj is not None:
            raise ValueError(
                "mmpipe's Wan kernels cover text-to-video; image-conditioned (I2V) blocks are not supported"
            )
        query, key, value = _get_qkv_projections(attn, hidden_states, cast(Any, encoder_hidden_states))
        q_BSND = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        k_BSND = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        v_BSND = value.unflatten(2, (attn.heads, -1))
        if isinstance(rotary_emb, GridRotary):
            rot = rotary_emb
            q_BSND = rope3d(q_BSND, rot.grid, theta=rot.theta, token_offset=rot.token_offset)
            k_BSND = rope3d(k_BSND, rot.grid, theta=rot.theta, token_offset=rot.token_offset)
        elif rotary_emb is not None:
            q_BSND, k_BSND = (_apply_rotary_tables(x, *rotary_emb) for x in (q_BSND, k_BSND))
        q, k, v = (x.transpose(1, 2) for x in (q_BSND, k_BSND, v_BSND))
        if self.attention == "torch" or attention_mask is not None or _routed():
            # stock path (and the one a sequence-parallel processor reroutes)
            out_BHSD = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        else:
            out_BHSD = local_attention(q, k, v, impl=select_backend(self.attention, device=q.device))
        out = out_BHSD.transpose(1, 2).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def _routed() -> bool:
    """Whether a sequence-parallel processor routes this call's attention (it then picks the backend)."""

    return any(isinstance(m, RouteSDPA) for m in _get_current_function_mode_stack())


def _apply_rotary_tables(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb`` for Wan (interleaved channel pairs)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def _block_forward(
    self: Any,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    rotary_emb: Any,
) -> torch.Tensor:
    """diffusers' ``WanTransformerBlock.forward`` with the fused norm + modulation kernel."""

    if temb.ndim == 4:  # batch, tokens, 6, dim (Wan 2.2 TI2V): per-token modulation
        mods = [m.squeeze(2) for m in (self.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)]
    else:  # batch, 6, dim (Wan 2.1, Wan 2.2 14B)
        mods = list((self.scale_shift_table + temb.float()).chunk(6, dim=1))
    shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = mods

    norm_hidden_states = norm_modulate(hidden_states, shift_msa, scale_msa, eps=self.norm1.eps)
    attn_output = self.attn1(norm_hidden_states, None, None, rotary_emb)

    # the gated residual and the cross-attention norm in one kernel; an affine norm is a modulation
    # with scale = weight - 1 and shift = bias, the same for every sample
    norm2 = self.norm2
    if isinstance(norm2, nn.Identity):  # cross_attn_norm=False: the residual only
        hidden_states = (hidden_states.float() + attn_output * gate_msa).type_as(hidden_states)
        norm_hidden_states = hidden_states
    else:
        weight, bias, zero = getattr(norm2, "weight", None), getattr(norm2, "bias", None), gate_msa.new_zeros(())
        scale2 = (weight.float() - 1 if weight is not None else zero).expand(gate_msa.shape)
        shift2 = (bias.float() if bias is not None else zero).expand(gate_msa.shape)
        hidden_states, norm_hidden_states = gated_norm_modulate(
            hidden_states, attn_output, gate_msa, shift2, scale2, eps=norm2.eps
        )
    attn_output = self.attn2(norm_hidden_states, encoder_hidden_states, None, None)
    hidden_states = hidden_states + attn_output

    norm_hidden_states = norm_modulate(hidden_states, c_shift_msa, c_scale_msa, eps=self.norm3.eps)
    ff_output = self.ffn(norm_hidden_states)
    return (hidden_states.float() + ff_output.float() * c_gate_msa).type_as(hidden_states)


def use_kernels(transformer: nn.Module, choice: KernelChoice) -> None:
    """Swap the chosen (non-``torch``) kernels into ``transformer`` in place; see the module."""
    m: Any = transformer
    if choice.norm_modulate == "triton":
        for block in m.blocks:
            if block.norm1.elementwise_affine or block.norm3.elementwise_affine:
                raise ValueError("the fused norm_modulate kernel covers Wan's affine-free block norms only")
            block.forward = types.MethodType(_block_forward, block)
    if choice.rope == "triton":
        m.rope.forward = types.MethodType(_rope_forward, m.rope)
    if choice.rope == "triton" or choice.attention != "torch":
        for block in m.blocks:
            block.attn1.set_processor(KernelWanAttnProcessor(choice.attention))
