"""Row-exact batching: a batched forward whose every row is bitwise the row computed alone.

Batching requests must not change their outputs: the same seed gives the same video whether a
request ran alone (``graph.generate``) or with others. A DiT's rows are independent in exact
arithmetic, but not in floating point, because the kernels choose *how* to compute by the shape
of the whole batch and the thread count (measured with torch 2.13 on x86 CPUs):

* GEMMs: BLAS picks its kernel and splits the rows among threads by row count and thread count
  (a 5-row GEMM gives other bits alone than inside a 30-row one at 2 threads), and MKL's code
  path may depend on the inputs' memory alignment;
* convolutions: oneDNN chooses its algorithm by shape;
* elementwise activations (GELU, SiLU): ATen computes each thread's chunk of the flattened tensor
  with vector instructions and its last ``numel % (2 * vector width)`` elements with the scalar
  formula, which differs from the vector one in the last bits; which elements fall in a tail
  depends on the batch's total size and the thread count;
* attention: with one token per row, the batched cross-attention gave other bits than the rows
  alone at 2 and 4 threads (the CPU flash kernel splits its work over batch x heads x query
  blocks, and its inner GEMMs run on pointers into the batch);
* weights: the same DiT loaded by ``from_pretrained`` (tensors 8 bytes past a 64-byte boundary,
  mapped from the file) and deep-copied (aligned) gives other bits, so alignment is part of a call.

So no list of "row-invariant" kernels survives another CPU, thread count or shape. The mechanism
instead runs every row exactly as it runs alone: on CPU :func:`make_row_exact` makes the module's
forward split a batch into samples and call the original forward once per sample, on a fresh
contiguous copy of each sample's inputs (a new allocation, 64-byte aligned by torch's CPU
allocator: the same values, shape, strides and alignment a caller's batch-of-one tensor has), then
concatenates the outputs. A batch of one whose inputs are contiguous and 64-byte aligned (as
every freshly computed tensor is) goes to the original forward untouched; other inputs are
copied the same way. Every kernel then sees, for row ``i`` of a batch, the very call it sees when
the row runs alone, hence returns the same bits. The guarantee:

    on CPU, for a module whose rows do not interact (a DiT in inference: no batch statistics),
    row ``i`` of ``module(batch)`` is bitwise ``module(row i)`` at the same torch thread count,
    on any CPU and at any thread count, for any batch it is in.

It rests only on kernels being deterministic for identical inputs at a fixed thread count (ATen's
static OpenMP partitioning; MKL without ``MKL_CBWR`` given 64-byte aligned inputs), not on which
kernel a CPU picks. It does *not* make outputs equal across thread counts: a 2-thread GEMM may
differ from a 1-thread one, batched or not. The price is the batching speed-up itself: a batch
costs what its rows cost one after another (on CPU, at the serving sizes, GEMMs of a DiT's
tokens per sample are already large; ``benchmarks/serve.py`` measures the whole engine).

On CUDA (and other devices) the batched forward runs unchanged: there, batching is the throughput,
and bf16 kernels chosen per batch size keep a row close to, not bitwise, its row alone
(``tests/serve/test_engine_cuda.py`` bounds the difference).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

# torch's CPU allocator aligns every allocation to 64 bytes (c10 ``gAlignment``), the width of an
# AVX-512 register and of a cache line: the most a kernel's code path can see of an address.
ALIGNMENT = 64
_MARK = "_row_exact_forward"


def _is_alone(t: torch.Tensor) -> bool:
    """Whether ``t`` looks, to a kernel, like a fresh allocation: contiguous and 64-byte aligned."""
    return t.is_contiguous() and t.data_ptr() % ALIGNMENT == 0


def _as_alone(value: Any, rows: slice | None, batch: int) -> Any:
    """``value`` as a batch-of-one caller would pass it: a batched tensor cut to ``rows`` (all rows
    when ``None``) and copied into a fresh contiguous allocation unless it already is one; anything
    else (flags, nested options, tensors without the batch dimension) as it is."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != batch:
        return value
    sample = value if rows is None else value[rows]
    if rows is None and _is_alone(sample):
        return sample
    return sample.clone(memory_format=torch.contiguous_format)


def _concat(parts: Sequence[Any]) -> Any:
    """The per-sample outputs joined as the batched forward returns them: tensors concatenated on
    the batch dimension, inside tuples, lists and dict-like outputs (diffusers' ``ModelOutput``)."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(parts))
    if isinstance(first, dict):
        return type(first)(**{k: _concat([p[k] for p in parts]) for k in first})
    if isinstance(first, tuple | list):
        return type(first)(_concat(column) for column in zip(*parts, strict=True))
    return first


def _batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The first dimension of the first tensor argument (positional, then keyword); ``None``
    without one, or when it is not on the CPU (other devices keep the batched forward)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0] if value.device.type == "cpu" else None
    return None


def _row_exact_forward(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    batch = _batch_size(args, kwargs)
    if batch is None:
        return forward(*args, **kwargs)
    samples = [None] if batch == 1 else [slice(i, i + 1) for i in range(batch)]
    outputs = [
        forward(
            *(_as_alone(a, rows, batch) for a in args),
            **{k: _as_alone(v, rows, batch) for k, v in kwargs.items()},
        )
        for rows in samples
    ]
    return outputs[0] if batch == 1 else _concat(outputs)


def make_row_exact(module: nn.Module) -> None:
    """Make ``module``'s forward row-exact on CPU, in place (see the module docstring): a batch runs
    sample by sample, each on a fresh copy of its rows. The batch is the first dimension of the
    first tensor argument; every tensor argument with that first dimension is split, the others
    are passed to each sample whole. Parameters, buffers and the state dict are untouched; calling
    it again changes nothing."""
    if getattr(module, _MARK, False):
        return
    # An instance attribute, as accelerate's and diffusers' hooks wrap ``forward``; a partial (not a
    # closure) so that ``copy.deepcopy`` of the module rebinds it to the copy.
    module.forward = functools.partial(_row_exact_forward, module.forward)
    setattr(module, _MARK, True)
