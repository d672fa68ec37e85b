"""Fused normalisation + AdaLN modulation, as video DiTs apply it before attention and the MLP.

``norm_modulate(x, shift, scale) = norm(x) * (1 + scale) + shift``, with ``norm`` a LayerNorm
without affine parameters (Wan's ``FP32LayerNorm(elementwise_affine=False)``) or an RMSNorm,
computed in float32 (float64 for float64 inputs) and returned in ``x``'s dtype. ``shift`` and
``scale`` are per sample (``B1D``, Wan 2.1) or per token (``BSD``, Wan 2.2 TI2V).

One Triton program normalises one row (token) in registers and applies the modulation in the same
pass: one read of ``x`` and one write of the output instead of eager PyTorch's five elementwise
kernels. The backward recomputes the row statistics it saved (mean and 1/std, 8 bytes a token). A
backward program takes several rows of one sample and, for per-sample modulation, sums its gradients
over them in registers, writing one float32 partial per program (summed by PyTorch) instead of a
full-size float32 product per token that is then read back: at 64k tokens x 5120 that is ~20 MB, not
1.3 GB, written and read.

Legend: B batch, S tokens, D channels.
"""

from __future__ import annotations

from typing import Any

import torch

from mmpipe.kernels._triton import AVAILABLE, can_run, output, output_like, row_warps

if AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def _normalize(x, mask, D, eps, RMS: tl.constexpr, ACC: tl.constexpr):
        """A row's centred values (RMS: as they are), its mean (RMS: 0) and 1 / std."""
        if RMS:
            mean = tl.zeros((), dtype=ACC)
            xc = x
        else:
            mean = tl.sum(x, axis=0) / D
            xc = tl.where(mask, x - mean, 0.0)
        return xc, mean, 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / D + eps)

    @triton.jit
    def _chunk_row(chunk, i, ROWS, b, S, mask, cols):
        """Row ``i`` of a backward program's chunk of sample ``b``: its position in the sample, its 64-bit
        index (``row * D`` passes 2**31 at a few samples of 64k tokens x 5120), the index its statistics
        are read at (row 0 past the sample's end, where x and dy load as 0) and its column mask (empty
        past the end; built by a vector compare: Triton's interpreter refuses ``mask & (s < S)``)."""
        s = chunk * ROWS + i
        row = b * S + s
        return s, row, tl.where(s < S, row, 0), mask & (cols * 0 + s < S)

    @triton.jit
    def _normalize_backward(g, xhat, rstd, D, RMS: tl.constexpr):
        """d(loss)/d(x) of a row from d(loss)/d(xhat) ``g``."""
        c2 = tl.sum(g * xhat, axis=0) / D
        if RMS:
            return (g - xhat * c2) * rstd
        return (g - tl.sum(g, axis=0) / D - xhat * c2) * rstd

    @triton.jit
    def _norm_modulate_fwd_kernel(
        x_ptr, shift_ptr, scale_ptr, out_ptr, mean_ptr, rstd_ptr,
        S, D, mod_sb, mod_ss, eps,
        RMS: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)  # row * D passes 2**31 at a few samples of 64k tokens x 5120
        b = row // S
        s = row % S
        cols = tl.arange(0, BLOCK_D)
        mask = cols < D
        x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(ACC)
        xc, mean, rstd = _normalize(x, mask, D, eps, RMS, ACC)
        mod = b * mod_sb + s * mod_ss + cols
        shift = tl.load(shift_ptr + mod, mask=mask, other=0.0).to(ACC)
        scale = tl.load(scale_ptr + mod, mask=mask, other=0.0).to(ACC)
        y = xc * rstd * (1.0 + scale) + shift
        tl.store(out_ptr + row * D + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def _norm_modulate_bwd_kernel(
        dy_ptr, x_ptr, scale_ptr, mean_ptr, rstd_ptr, dx_ptr, dshift_ptr, dscale_ptr,
        S, D, mod_sb, mod_ss, ROWS,
        RMS: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr, PER_TOKEN: tl.constexpr,
    ):  # fmt: skip
        """``ROWS`` rows of one sample. Per-token modulation: each row's shift and scale gradients are
        stored; per sample: summed in registers over the rows, one partial per program."""
        chunk = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        mask = cols < D
        scale = tl.load(scale_ptr + b * mod_sb + cols, mask=mask, other=0.0).to(ACC)  # per sample
        dshift_acc = tl.zeros([BLOCK_D], ACC)
        dscale_acc = tl.zeros([BLOCK_D], ACC)
        for i in range(0, ROWS):
            s, row, safe, m = _chunk_row(chunk, i, ROWS, b, S, mask, cols)
            if PER_TOKEN:
                scale = tl.load(scale_ptr + b * mod_sb + s * mod_ss + cols, mask=m, other=0.0).to(ACC)
            x = tl.load(x_ptr + row * D + cols, mask=m, other=0.0).to(ACC)
            dy = tl.load(dy_ptr + row * D + cols, mask=m, other=0.0).to(ACC)
            mean = tl.load(mean_ptr + safe)
            rstd = tl.load(rstd_ptr + safe)
            xhat = tl.where(m, (x - mean) * rstd, 0.0)
            dx = _normalize_backward(dy * (1.0 + scale), xhat, rstd, D, RMS)
            tl.store(dx_ptr + row * D + cols, dx.to(dx_ptr.dtype.element_ty), mask=m)
            if PER_TOKEN:
                tl.store(dshift_ptr + row * D + cols, dy, mask=m)
                tl.store(dscale_ptr + row * D + cols, dy * xhat, mask=m)
            else:  # rows past the sample's end load zeros and add nothing
                dshift_acc += dy
                dscale_acc += dy * xhat
        if not PER_TOKEN:
            partial = (b * tl.num_programs(0) + chunk) * D
            tl.store(dshift_ptr + partial + cols, dshift_acc, mask=mask)
            tl.store(dscale_ptr + partial + cols, dscale_acc, mask=mask)

    @triton.jit
    def _gated_fwd_kernel(
        x_ptr, y_ptr, gate_ptr, shift_ptr, scale_ptr, h_ptr, out_ptr, mean_ptr, rstd_ptr,
        S, D, mod_sb, mod_ss, eps,
        RMS: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)  # row * D passes 2**31 at a few samples of 64k tokens x 5120
        b = row // S
        s = row % S
        cols = tl.arange(0, BLOCK_D)
        mask = cols < D
        mod = b * mod_sb + s * mod_ss + cols
        x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(ACC)
        y = tl.load(y_ptr + row * D + cols, mask=mask, other=0.0).to(ACC)
        gate = tl.load(gate_ptr + mod, mask=mask, other=0.0).to(ACC)
        # the residual stream is kept in x's dtype, and normalised as stored (as the eager block does)
        h_stored = (x + y * gate).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * D + cols, h_stored, mask=mask)
        hc, mean, rstd = _normalize(h_stored.to(ACC), mask, D, eps, RMS, ACC)
        shift = tl.load(shift_ptr + mod, mask=mask, other=0.0).to(ACC)
        scale = tl.load(scale_ptr + mod, mask=mask, other=0.0).to(ACC)
        tl.store(out_ptr + row * D + cols, (hc * rstd * (1.0 + scale) + shift).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def _gated_bwd_kernel(
        dout_ptr, dh_ptr, h_ptr, y_ptr, gate_ptr, scale_ptr, mean_ptr, rstd_ptr,
        dx_ptr, dy_ptr, dgate_ptr, dscale_ptr,
        S, D, mod_sb, mod_ss, ROWS,
        RMS: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr, PER_TOKEN: tl.constexpr,
    ):  # fmt: skip
        """``ROWS`` rows of one sample; the gate and scale gradients as in the norm's backward (the shift's,
        ``dout`` summed, is left to PyTorch: a third running sum would not fit the registers)."""
        chunk = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        mask = cols < D
        dgate_acc = tl.zeros([BLOCK_D], ACC)
        dscale_acc = tl.zeros([BLOCK_D], ACC)
        for i in range(0, ROWS):
            s, row, safe, m = _chunk_row(chunk, i, ROWS, b, S, mask, cols)
            # reloaded per row even when per sample (mod_ss 0: an L1/L2 hit), which keeps two row
            # vectors out of the registers the running sums need
            mod = b * mod_sb + s * mod_ss + cols
            gate = tl.load(gate_ptr + mod, mask=m, other=0.0).to(ACC)
            scale = tl.load(scale_ptr + mod, mask=m, other=0.0).to(ACC)
            h = tl.load(h_ptr + row * D + cols, mask=m, other=0.0).to(ACC)
            dout = tl.load(dout_ptr + row * D + cols, mask=m, other=0.0).to(ACC)
            dh = tl.load(dh_ptr + row * D + cols, mask=m, other=0.0).to(ACC)
            y = tl.load(y_ptr + row * D + cols, mask=m, other=0.0).to(ACC)
            mean = tl.load(mean_ptr + safe)
            rstd = tl.load(rstd_ptr + safe)
            hhat = tl.where(m, (h - mean) * rstd, 0.0)
            # the residual stream's gradient: its later uses plus the norm's
            dtotal = dh + _normalize_backward(dout * (1.0 + scale), hhat, rstd, D, RMS)
            tl.store(dx_ptr + row * D + cols, dtotal.to(dx_ptr.dtype.element_ty), mask=m)
            tl.store(dy_ptr + row * D + cols, (dtotal * gate).to(dy_ptr.dtype.element_ty), mask=m)
            if PER_TOKEN:
                tl.store(dgate_ptr + row * D + cols, dtotal * y, mask=m)
                tl.store(dscale_ptr + row * D + cols, dout * hhat, mask=m)
            else:
                dgate_acc += dtotal * y
                dscale_acc += dout * hhat
        if not PER_TOKEN:
            partial = (b * tl.num_programs(0) + chunk) * D
            tl.store(dgate_ptr + partial + cols, dgate_acc, mask=mask)
            tl.store(dscale_ptr + partial + cols, dscale_acc, mask=mask)


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _rows_per_program(B: int, S: int, device: torch.device) -> int:
    """Rows one backward program takes. Its per-sample modulation gradients are summed in registers over
    them and written once, so the partials cost ``B * S / rows`` rows of float32 instead of ``B * S``:
    about 8 programs an SM on a GPU. Interpreted: 3, so test shapes have several programs a sample and a
    ragged last one."""
    if device.type != "cuda":
        return 3
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, triton.cdiv(B * S, 8 * sms))


def _mod_grads(x: torch.Tensor, per_token: bool, chunks: int, acc: torch.dtype) -> torch.Tensor:
    """A poisoned buffer for a modulation gradient of ``x``'s modulation: per token ``(B, S, D)``, or per
    sample one partial sum per backward program ``(B, chunks, D)``."""
    B, S, D = x.shape
    return output((B, S if per_token else chunks, D), acc, x.device)


def _row_meta(D: int, acc: torch.dtype, rms: bool) -> dict[str, Any]:
    """The kernels' compile-time arguments for rows of ``D`` channels (one program holds a row in
    registers; :func:`mmpipe.kernels._triton.row_warps` spreads it over warps)."""
    block = triton.next_power_of_2(D)
    acc_tl = tl.float64 if acc == torch.float64 else tl.float32
    return dict(RMS=rms, BLOCK_D=block, ACC=acc_tl, num_warps=row_warps(block))


def norm_modulate_reference(
    x_BSD: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, *, rms: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """Eager PyTorch, as Wan's block writes it: ``(norm(x.float()) * (1 + scale) + shift).type_as(x)``."""
    acc = _acc_dtype(x_BSD)
    x = x_BSD.to(acc)
    if rms:
        xhat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    else:
        xhat = torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=eps)
    return (xhat * (1 + scale.to(acc)) + shift.to(acc)).to(x_BSD.dtype)


def _check(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    if x.ndim != 3:
        raise ValueError(f"norm_modulate expects x of shape (B, S, D), got {tuple(x.shape)}")
    B, S, D = x.shape
    for name, t in (("shift", shift), ("scale", scale)):
        if t.shape not in ((B, 1, D), (B, S, D)):
            raise ValueError(
                f"norm_modulate: {name} must be (B, 1, D) or (B, S, D) = {(B, S, D)}, got {tuple(t.shape)}"
            )
    if shift.shape != scale.shape:
        raise ValueError(f"norm_modulate: shift {tuple(shift.shape)} and scale {tuple(scale.shape)} differ")
    return (S * D, D) if shift.shape[1] == S and S > 1 else (D, 0)  # modulation strides (sample, token)


@torch.library.custom_op("mmpipe::norm_modulate_fwd", mutates_args=())
def _fwd(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, rms: bool, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not can_run(x, shift, scale):
        raise RuntimeError("norm_modulate's Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    mod_sb, mod_ss = _check(x, shift, scale)
    B, S, D = x.shape
    x, shift, scale = x.contiguous(), shift.contiguous(), scale.contiguous()
    acc = _acc_dtype(x)
    out = output_like(x)  # poisoned in tests: an element the kernel misses stays NaN
    mean = output((B * S,), acc, x.device)
    rstd = output((B * S,), acc, x.device)
    if B * S:
        _norm_modulate_fwd_kernel[(B * S,)](
            x, shift, scale, out, mean, rstd, S, D, mod_sb, mod_ss, eps,
            **_row_meta(D, acc, rms),
        )  # fmt: skip
    return out, mean, rstd


@_fwd.register_fake
def _(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, rms: bool, eps: float):  # type: ignore[no-untyped-def]
    B, S, _ = x.shape
    acc = _acc_dtype(x)
    return torch.empty_like(x), x.new_empty((B * S,), dtype=acc), x.new_empty((B * S,), dtype=acc)


@torch.library.custom_op("mmpipe::norm_modulate_bwd", mutates_args=())
def _bwd(
    dy: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, rms: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mod_sb, mod_ss = _check(x, scale, scale)
    B, S, D = x.shape
    dy, x, scale = dy.contiguous(), x.contiguous(), scale.contiguous()
    per_token = mod_ss != 0
    rows = _rows_per_program(B, S, x.device)
    chunks = triton.cdiv(S, rows)
    dx = output_like(x)
    dshift, dscale = (_mod_grads(x, per_token, chunks, mean.dtype) for _ in range(2))
    if B * S:
        _norm_modulate_bwd_kernel[(chunks, B)](
            dy, x, scale, mean, rstd, dx, dshift, dscale, S, D, mod_sb, mod_ss, rows,
            PER_TOKEN=per_token, **_row_meta(D, mean.dtype, rms),
        )  # fmt: skip
    return dx, _reduce_mod(dshift, per_token, scale.dtype), _reduce_mod(dscale, per_token, scale.dtype)


@_bwd.register_fake
def _(dy, x, scale, mean, rstd, rms):  # type: ignore[no-untyped-def]
    return torch.empty_like(x), torch.empty_like(scale), torch.empty_like(scale)


def _setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x, shift, scale, rms, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, scale, mean, rstd)
    ctx.rms = rms


def _backward(ctx, dout, _dmean, _drstd):  # type: ignore[no-untyped-def]
    x, scale, mean, rstd = ctx.saved_tensors
    dx, dshift, dscale = _bwd(dout, x, scale, mean, rstd, ctx.rms)
    return dx, dshift, dscale, None, None


_fwd.register_autograd(_backward, setup_context=_setup)


def norm_modulate(
    x_BSD: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, *, rms: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """``norm(x) * (1 + scale) + shift`` in one Triton kernel (forward and backward); see the module."""
    return _fwd(x_BSD, shift, scale, rms, eps)[0]


# ---- gated residual + norm + modulation ------------------------------------------------------------
def gated_norm_modulate_reference(
    x_BSD: torch.Tensor,
    y_BSD: torch.Tensor,
    gate: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    *,
    rms: bool = False,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager PyTorch, as Wan's block writes it: ``h = (x.float() + y * gate).type_as(x)``, then
    :func:`norm_modulate_reference` of ``h``; returns ``(h, out)``."""
    acc = _acc_dtype(x_BSD)
    h = (x_BSD.to(acc) + y_BSD.to(acc) * gate.to(acc)).to(x_BSD.dtype)
    return h, norm_modulate_reference(h, shift, scale, rms=rms, eps=eps)


def _reduce_mod(grads: torch.Tensor, per_token: bool, dtype: torch.dtype) -> torch.Tensor:
    """A modulation gradient from :func:`_mod_grads`' buffer, in ``dtype``: per token as it is, per
    sample the programs' partial sums added up."""
    return (grads if per_token else grads.sum(1, keepdim=True)).to(dtype)


@torch.library.custom_op("mmpipe::gated_norm_modulate_fwd", mutates_args=())
def _gated_fwd(
    x: torch.Tensor,
    y: torch.Tensor,
    gate: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    rms: bool,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if not can_run(x, y, gate, shift, scale):
        raise RuntimeError("gated_norm_modulate's Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    if y.shape != x.shape:
        raise ValueError(f"gated_norm_modulate: y {tuple(y.shape)} must have x's shape {tuple(x.shape)}")
    mod_sb, mod_ss = _check(x, shift, scale)
    _check(x, gate, scale)
    B, S, D = x.shape
    x, y, gate, shift, scale = (t.contiguous() for t in (x, y, gate, shift, scale))
    acc = _acc_dtype(x)
    h, out = output_like(x), output_like(x)
    mean = output((B * S,), acc, x.device)
    rstd = output((B * S,), acc, x.device)
    if B * S:
        _gated_fwd_kernel[(B * S,)](
            x, y, gate, shift, scale, h, out, mean, rstd, S, D, mod_sb, mod_ss, eps,
            **_row_meta(D, acc, rms),
        )  # fmt: skip
    return h, out, mean, rstd


@_gated_fwd.register_fake
def _(x, y, gate, shift, scale, rms, eps):  # type: ignore[no-untyped-def]
    B, S, _ = x.shape
    acc = _acc_dtype(x)
    return torch.empty_like(x), torch.empty_like(x), x.new_empty((B * S,), dtype=acc), x.new_empty((B * S,), dtype=acc)


@torch.library.custom_op("mmpipe::gated_norm_modulate_bwd", mutates_args=())
def _gated_bwd(
    dout: torch.Tensor,
    dh: torch.Tensor,
    h: torch.Tensor,
    y: torch.Tensor,
    gate: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    rms: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    mod_sb, mod_ss = _check(h, scale, scale)
    _check(h, gate, scale)
    B, S, D = h.shape
    dout, dh, h, y, gate, scale = (t.contiguous() for t in (dout, dh, h, y, gate, scale))
    per_token = mod_ss != 0
    rows = _rows_per_program(B, S, h.device)
    chunks = triton.cdiv(S, rows)
    dx, dy = output_like(h), output_like(y)
    dgate, dscale = (_mod_grads(h, per_token, chunks, mean.dtype) for _ in range(2))
    if B * S:
        _gated_bwd_kernel[(chunks, B)](
            dout, dh, h, y, gate, scale, mean, rstd, dx, dy, dgate, dscale, S, D, mod_sb, mod_ss, rows,
            PER_TOKEN=per_token, **_row_meta(D, mean.dtype, rms),
        )  # fmt: skip
    # the shift's gradient: dout itself (a copy: an output may not alias an input), or summed over the tokens
    dshift = dout.to(scale.dtype, copy=True) if per_token else dout.sum(1, keepdim=True, dtype=mean.dtype)
    dgate, dscale = _reduce_mod(dgate, per_token, gate.dtype), _reduce_mod(dscale, per_token, scale.dtype)
    return dx, dy, dgate, dshift.to(scale.dtype), dscale


@_gated_bwd.register_fake
def _(dout, dh, h, y, gate, scale, mean, rstd, rms):  # type: ignore[no-untyped-def]
    return (
        torch.empty_like(h),
        torch.empty_like(y),
        torch.empty_like(gate),
        torch.empty_like(scale),
        torch.empty_like(scale),
    )


def _gated_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    _, y, gate, _, scale, rms, _ = inputs
    h, _, mean, rstd = output
    ctx.save_for_backward(h, y, gate, scale, mean, rstd)
    ctx.rms = rms


def _gated_backward(ctx, dh, dout, _dmean, _drstd):  # type: ignore[no-untyped-def]
    h, y, gate, scale, mean, rstd = ctx.saved_tensors
    dh = torch.zeros_like(h) if dh is None else dh
    dout = torch.zeros_like(h) if dout is None else dout
    dx, dy, dgate, dshift, dscale = _gated_bwd(dout, dh, h, y, gate, scale, mean, rstd, ctx.rms)
    return dx, dy, dgate, dshift, dscale, None, None


_gated_fwd.register_autograd(_gated_backward, setup_context=_gated_setup)


def gated_norm_modulate(
    x_BSD: torch.Tensor,
    y_BSD: torch.Tensor,
    gate: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    *,
    rms: bool = False,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated residual and the next modulated norm in one kernel: ``h = x + y * gate`` (in ``x``'s
    dtype) and ``norm(h) * (1 + scale) + shift``; returns ``(h, out)``. ``gate``, ``shift`` and
    ``scale`` are per sample (``B1D``) or per token (``BSD``)."""
    h, out, _, _ = _gated_fwd(x_BSD, y_BSD, gate, shift, scale, rms, eps)
    return h, out
