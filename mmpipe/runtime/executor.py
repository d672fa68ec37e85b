"""The per-rank interpreter of a Plan: builds only its own stages and runs its action list.

Edge tensors cross stage boundaries as detached leaves (``requires_grad`` when the producer is on
the backward path), on the same rank as well as between ranks, so every stage's backward is its
own action: ``B`` of a consumer fills its inputs' ``.grad``, which flow to the producer locally or
with ``SENDG``/``RECVG``, and ``B`` of the producer runs ``autograd.backward`` on its outputs with
them. A stage's group may hold dp > 1 ranks (FSDP2, gradients averaged over the group): each rank
of it holds a contiguous slice of every micro-batch's rows, and transfers move exactly the rows
where the producer's and the consumer's slices overlap.

Legend: rows are the micro-batch (dim 0) indices ``[start, stop)`` a rank holds of a stage.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils._pytree import tree_map_only

from mmpipe.devices import Precision, autocast
from mmpipe.errors import ExecutionError, NonFiniteError, PlanError
from mmpipe.graph import INPUT, Edge, Graph
from mmpipe.kernels.registry import KernelChoice
from mmpipe.memory.host import HostTier
from mmpipe.memory.policy import BLOCK_LETTERS, BlockPolicy, apply_block_policies, block_policies, repeated_blocks
from mmpipe.memory.tiers import FileTier, Tier
from mmpipe.parallel.reshard import Region
from mmpipe.parallel.sequence import SequenceLayout
from mmpipe.runtime.events import EventRecorder
from mmpipe.runtime.frozen_cache import FrozenOutputCache
from mmpipe.runtime.mesh import MeshOwner
from mmpipe.runtime.optim import StageOptim
from mmpipe.runtime.transport import isend_message, nbytes, recv_tensors
from mmpipe.sched.plan import Action, ActionKind, Plan, check_split, overlapping_ranks, send_window

BatchFn = Callable[[int], dict[str, torch.Tensor]]  # micro-batch index -> full micro-batch graph inputs
OptionsFn = Callable[[str, int, tuple[int, int, int]], dict[str, Any]]  # stage, mb, rows -> forward options
# micro-batch index -> per row, the key of each graph input (what it is a function of: the
# frozen-output cache keys a stage's row by the keys of the inputs it depends on)
KeysFn = Callable[[int], Sequence[Mapping[str, Hashable]]]


def own_outputs(module: nn.Module, args: Any, output: Any) -> Any:
    """A forward hook: the module's output tensors that are views (diffusers' DiTs unpatchify with
    ``reshape`` / ``permute``) become tensors of their own. FSDP2 warns on every forward of a root
    module that returns a view, since an in-place op on it would skip the pre-backward all-gather;
    a copy (the size of the latents, values and gradients unchanged) cannot be caught that way."""
    return tree_map_only(torch.Tensor, lambda t: t.clone() if t._is_view() else t, output)


class Executor:
    """Runs one rank's share of a graph under a plan."""

    def __init__(
        self,
        graph: Graph,
        plan: Plan,
        mesh: MeshOwner,
        *,
        batch_size: int,
        events: EventRecorder | None = None,
        max_inflight_sends: int | None = None,
        spill_dir: Path | None = None,
        device: torch.device | None = None,
        precision: Precision = Precision.FP32,
        wire: torch.device | None = None,
        compile_blocks: bool = False,
        kernels: KernelChoice | None = None,
        frozen_cache_bytes: int = 0,
    ) -> None:
        self.graph, self.plan, self.mesh, self.rank = graph, plan, mesh, mesh.rank
        # device: where this rank's modules and tensors live; wire: where edge payloads travel
        # (None: as they are, CPU; the GPU under NCCL; the host when gloo moves CUDA tensors)
        self.device = device if device is not None else torch.device("cpu")
        self.precision, self.wire, self.compile_blocks = precision, wire, compile_blocks
        self.kernels = kernels or KernelChoice()  # the run's resolved model.kernels (all torch: stock modules)
        self.spill_dir = spill_dir  # where offloaded activations go on CPU (a file tier per rank)
        self.spill: Tier | None = None  # this rank's offload tier, made by the first stage that offloads
        self.groups = plan.groups
        self.batch_size = batch_size
        self.events = events
        # Sends in flight (works + the tensors they read), kept across passes: a rank that only
        # produces for others may run ahead into the next step by up to this many messages.
        self.max_inflight = max_inflight_sends or send_window(plan)
        self._inflight: collections.deque[tuple[list[dist.Work], list[torch.Tensor]]] = collections.deque()
        if wire is not None and wire.type == "cuda":
            check_pair_order(plan)
        if plan.batch and plan.batch != batch_size:
            raise PlanError(f"the plan was made for micro-batches of {plan.batch} samples, not {batch_size}")
        for stage, group in plan.placement:
            check_split(stage, group, batch_size, backward=stage in plan.backward)
        self.local = plan.stages_on(self.rank)
        self.optimizers: dict[str, StageOptim] = {}  # filled by the trainer for local trainable stages
        # replicated (DDP) trainable stages: the process group their gradients are all-reduced over
        self._replicated: dict[str, dist.ProcessGroup] = {}
        self.modules: dict[str, nn.Module] = {s: self._build(s) for s in self.local}
        # frozen stages fed only by the data, whole on this rank's rows: kept per sample when run()
        # is given sample keys (mmpipe.runtime.frozen_cache)
        self.frozen_cache = FrozenOutputCache(frozen_cache_bytes) if frozen_cache_bytes > 0 else None
        # (frozen stages are never sharded, _build; a sequence-parallel one runs collectives, so ranks
        # of its group could hit and miss apart: not cached)
        self._cached = {
            s for s in graph.frozen_prefix() if s in self.local and s not in plan.backward and self.groups[s].sp == 1
        }
        self._key_ports = {s: sorted(graph.data_inputs(s)) for s in self._cached}
        self._port_edges = [e for e in graph.edges if e.src != INPUT]
        self._tags = {pair: i for i, pair in enumerate(graph.stage_edges())}
        # Output ports that carry gradients: declared floating point, or of unspecified dtype.
        self._float_ports = {
            name: {p for p, spec in st.outputs.items() if spec.dtype is None or spec.dtype.is_floating_point}
            for name, st in graph.stages.items()
        }

    def _build(self, stage: str) -> nn.Module:
        # Order (DESIGN.md): kernels -> sequence parallel -> activation policy -> compile -> FSDP2 (or DDP).
        st = self.graph.stages[stage]
        module = st.module
        group = self.groups[stage]
        module.to(self.device)
        if st.frozen and self.precision is Precision.BF16:
            module.to(torch.bfloat16)  # frozen weights in bf16 (no master copy to keep); trained: fp32 masters
        if self.kernels != KernelChoice() and hasattr(st, "use_kernels"):  # opt-in (model.kernels)
            st.use_kernels(module, self.kernels)
        if group.sp > 1:
            st.check_sequence_parallel(group.ulysses, group.ring)
            seq_mesh = self.mesh.sequence_mesh(stage, zigzag=st.sequence_causal)
            st.parallelize_sequence(module, seq_mesh, attention=self.kernels.attention)
        if group.recompute or group.offload or group.blocks.strip("k"):
            self._apply_memory_policy(stage, module)
        if self.compile_blocks and not st.frozen:
            compile_blocks(module)
        mesh = self.mesh.fsdp_mesh(stage)
        if mesh is not None and not st.frozen and group.replicate:
            # DDP: whole parameters on every rank of the group, made bitwise alike from its first rank;
            # the gradients are all-reduced once per step, in the last micro-batch's backward (_backward).
            pg = mesh.get_group()
            with torch.no_grad():
                for p in module.parameters():
                    dist.broadcast(p, src=group.ranks[0], group=pg)
            self._replicated[stage] = pg
        elif mesh is not None and not st.frozen:
            # FSDP2 averages gradients over the group (gloo has no pre-scaled sum); _backward
            # seeds each rank's backward (group size) times its share so that the average is the sum.
            # gather_once: keep the gathered parameters from the step's first forward to its last
            # backward (set in _backward), trading their memory for one all-gather per step.
            module.register_forward_hook(own_outputs)  # before fully_shard's: its post-forward sees the copies
            fully_shard(
                module, mesh=mesh, reshard_after_forward=not group.gather_once, mp_policy=self._mixed_precision()
            )
        return module

    def _mixed_precision(self) -> MixedPrecisionPolicy:
        """bf16 on CUDA: parameters gathered in bf16, gradients reduced in float32 into float32
        masters (FSDP2's recipe); float32 otherwise (gloo's CPU collectives, and exact CPU parity)."""
        if self.precision is Precision.BF16 and self.device.type == "cuda":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    def _apply_memory_policy(self, stage: str, module: nn.Module) -> None:
        """The group's recompute / offload fractions of the stage's repeated blocks (see
        ``mmpipe.memory.policy.block_policies``), offloading to pinned host memory on GPU, to this
        rank's spill directory on CPU."""
        group = self.groups[stage]
        blocks = repeated_blocks(module)
        if not blocks:
            raise PlanError(f"stage {stage!r}: recompute / offload need repeated blocks, and its module has none")
        if group.blocks:
            if len(group.blocks) != len(blocks):
                raise PlanError(
                    f"stage {stage!r}: blocks={group.blocks!r} names {len(group.blocks)} policies, "
                    f"its module has {len(blocks)} repeated blocks"
                )
            policies = [BLOCK_LETTERS[c] for c in group.blocks]
        else:
            policies = block_policies(len(blocks), group.recompute, group.offload)
        tier = None
        if BlockPolicy.OFFLOAD in policies:
            tier = self._offload_tier(cuda=any(p.is_cuda for p in module.parameters()))
        apply_block_policies(blocks, policies, tier=tier)

    def _offload_tier(self, *, cuda: bool) -> Tier:
        if self.spill is None:
            spill_dir = self.spill_dir / f"rank{self.rank}" if self.spill_dir is not None else None
            self.spill = HostTier() if cuda else FileTier(spill_dir)
        return self.spill

    # ---- who holds and who needs which part of an edge tensor ------------------------------------
    def _layout(self, stage: str) -> SequenceLayout:
        g = self.groups[stage]
        return SequenceLayout(g.ulysses, g.ring, zigzag=self.graph.stages[stage].sequence_causal)

    def _dims(self, e: Edge) -> tuple[int | None, int | None]:
        """The sequence dims along which the producer and the consumer split the edge's tensor."""
        src, dst = self.graph.stages[e.src], self.graph.stages[e.dst]
        pdim = src.sequence_outputs.get(e.src_port) if self.groups[e.src].sp > 1 else None
        cdim = dst.sequence_inputs.get(e.dst_port) if self.groups[e.dst].sp > 1 else None
        if pdim is not None and cdim is not None and pdim != cdim:
            raise PlanError(f"edge {e}: the producer splits dim {pdim}, the consumer dim {cdim}")
        return pdim, cdim

    def _held(self, e: Edge, rank: int, length: int, mb: int) -> Region:
        """What ``rank`` of the producer holds and sends of the edge's tensor in micro-batch ``mb``."""
        g = self.groups[e.src]
        rows = g.rows(rank, self.batch_size, mb)
        pdim, cdim = self._dims(e)
        if pdim is not None:
            return Region(rows, pdim, tuple(self._layout(e.src).ranges(length, g.sp_index(rank))), length)
        if g.sp_index(rank) != 0:  # a replicated output is sent by its replica's first rank only
            return Region((rows[0], rows[0]))
        return Region.whole(rows, cdim, length)

    def _needed(self, e: Edge, rank: int, length: int, mb: int) -> Region:
        """What ``rank`` of the consumer needs of the edge's tensor in micro-batch ``mb``."""
        g = self.groups[e.dst]
        rows = g.rows(rank, self.batch_size, mb)
        pdim, cdim = self._dims(e)
        if cdim is not None:
            return Region(rows, cdim, tuple(self._layout(e.dst).ranges(length, g.sp_index(rank))), length)
        return Region.whole(rows, pdim, length)

    def _length(self, e: Edge, mb: int, st: _StepState) -> int:
        """The whole length of the edge tensor along its split dim (0 when nobody splits it)."""
        key = (e.src, e.src_port, mb)
        if key not in st.lengths:  # a whole tensor this rank produced
            pdim, cdim = self._dims(e)
            dim = cdim if cdim is not None else pdim
            st.lengths[key] = 0 if dim is None else st.outputs[(e.src, mb)][e.src_port].shape[dim]
        return st.lengths[key]

    def rows(self, stage: str, mb: int, rank: int | None = None) -> tuple[int, int]:
        """The rows of micro-batch ``mb`` that ``rank`` (default: this rank) holds of ``stage``."""
        return self.groups[stage].rows(self.rank if rank is None else rank, self.batch_size, mb)

    # ---- one pass over an action list -------------------------------------------------------------
    def run(
        self,
        actions: tuple[Action, ...],
        batch_fn: BatchFn,
        options_fn: OptionsFn,
        *,
        flush: bool = True,
        step: int | None = None,
        keys_fn: KeysFn | None = None,
    ) -> dict[str, Any]:
        """Interpret ``actions``; returns ``{"loss": weighted local loss sum, "grad_norm": {stage: norm},
        "skipped": [stages whose non-finite update was skipped]}``.

        ``flush=False`` returns with sends still in flight (bounded by ``max_inflight_sends``);
        ``step``: the training step, named by a non-finite error; ``keys_fn``: each micro-batch's sample
        keys, with which the frozen prefix's outputs are kept and reused (with ``frozen_cache_bytes``).
        """
        state = _StepState(loss=torch.zeros((), device=self.device), step=step, keys_fn=keys_fn)
        for a in actions:  # the pass's last backward of each stage reduces its gradients
            if a.kind == ActionKind.B:
                state.last_backward[a.stage] = _mb(a)
        for i, action in enumerate(actions):
            start = self.events.mark() if self.events is not None else 0.0
            tier = dataclasses.replace(self.spill.stats) if self.spill is not None else None
            cached = state.cached_rows
            try:
                # Under torch.profiler (profile.enabled), each action is a range named like its text form.
                with record_function(str(action)) if torch.autograd._profiler_enabled() else contextlib.nullcontext():
                    moved = self._dispatch(action, state, batch_fn, options_fn)
            except (RuntimeError, ValueError) as err:
                raise ExecutionError(
                    f"rank {self.rank} failed at step {i} ({action}): {err}\n{self.plan.format_table({self.rank: i})}"
                ) from err
            if self.events is not None:
                extra: dict[str, float] = {"frozen_cache_rows": state.cached_rows - cached}  # served, not computed
                if tier is not None and self.spill is not None:  # what the offload tier did in this action
                    now = self.spill.stats
                    extra |= {
                        "offloaded_bytes": now.offloaded_bytes - tier.offloaded_bytes,
                        "offload_returned_bytes": now.returned_bytes - tier.returned_bytes,
                        "offload_write_s": now.write_s - tier.write_s,  # the background writer's
                        # the action waiting on the tier: the forward on the writer, the backward on reads
                        "offload_wait_s": now.read_s - tier.read_s + now.pack_wait_s - tier.pack_wait_s,
                    }
                self.events.record(action, start, self.events.mark(), moved, **extra)
        for stage in self.local:  # a forward-only pass leaves gather_once parameters gathered
            module = self.modules[stage]
            if self.groups[stage].gather_once and isinstance(module, FSDPModule) and stage not in state.last_backward:
                module.reshard()
        if flush:
            self.flush()
        return {"loss": state.loss, "grad_norm": state.grad_norms, "skipped": state.skipped}

    def _dispatch(self, a: Action, st: _StepState, batch_fn: BatchFn, options_fn: OptionsFn) -> int:
        match a.kind:
            case ActionKind.F:
                self._forward(a.stage, _mb(a), st, batch_fn, options_fn)
            case ActionKind.B:
                self._backward(a.stage, _mb(a), st)
            case ActionKind.SEND:
                return self._send(a, st, grad=False)
            case ActionKind.RECV:
                return self._recv(a, st, grad=False)
            case ActionKind.SEND_GRAD:
                return self._send(a, st, grad=True)
            case ActionKind.RECV_GRAD:
                return self._recv(a, st, grad=True)
            case ActionKind.STEP:
                st.grad_norms[a.stage] = self._step(a.stage, st)
        return 0

    # ---- compute --------------------------------------------------------------------------------
    def _forward(self, stage: str, mb: int, st: _StepState, batch_fn: BatchFn, options_fn: OptionsFn) -> None:
        lo, hi = self.rows(stage, mb)
        keys = None
        if self.frozen_cache is not None and st.keys_fn is not None and stage in self._cached:
            ports = self._key_ports[stage]
            keys = [tuple(row[p] for p in ports) for row in list(st.keys_fn(mb))[lo:hi]]
            kept = self.frozen_cache.get(stage, keys, self.device)
            if kept is not None:  # every row kept: no inputs loaded, nothing computed
                st.inputs[(stage, mb)], st.outputs[(stage, mb)] = {}, kept
                st.cached_rows += hi - lo
                return
        # Build an autograd graph only when this pass runs the stage's backward (not in a forward-only
        # pass, e.g. validation, over the same executor).
        wants_grad = stage in self.plan.backward and stage in st.last_backward
        inputs: dict[str, torch.Tensor] = {}
        options = options_fn(stage, mb, (lo, hi, self.batch_size))
        shards: dict[str, Region] = {}
        for e in self.graph.producers(stage):
            if e.src == INPUT:
                inputs[e.dst_port] = st.batch(mb, batch_fn)[e.src_port][lo:hi].to(self.device, non_blocking=True)
                continue
            x, need = self._edge_value(e, mb, st)
            if need.dim is not None and self._dims(e)[1] is not None:
                shards[e.dst_port] = need
            if wants_grad and e.src in self.plan.backward and x.is_floating_point():
                x = x.detach().requires_grad_(True)
            inputs[e.dst_port] = x
        spec = self.graph.stages[stage]
        if self.groups[stage].sp > 1:
            options["shards"] = shards
        with torch.set_grad_enabled(wants_grad), autocast(self.device, self.precision):
            out = spec.forward(self.modules[stage], inputs, **options)
        if self.groups[stage].sp > 1 and spec.sequence_outputs:
            length = spec.sequence_length(inputs)
            for port in spec.sequence_outputs:
                st.lengths[(stage, port, mb)] = length
        st.inputs[(stage, mb)] = inputs
        st.outputs[(stage, mb)] = out
        if keys is not None and self.frozen_cache is not None:
            self.frozen_cache.put(stage, keys, out)
        if "loss" in out and not self.graph.consumers(stage):
            # dp replicas weigh their rows; the sp ranks of a replica return shares that sum to its loss
            weight = (hi - lo) / self.batch_size
            st.loss += out["loss"].detach().float() * weight / self.plan.micro_batches

    def _edge_value(self, e: Edge, mb: int, st: _StepState) -> tuple[torch.Tensor, Region]:
        """What this rank's ``e.dst`` needs of ``e``'s tensor, from local slices and received pieces."""
        length = self._length(e, mb, st)
        need = self._needed(e, self.rank, length, mb)
        pieces = []
        for q in overlapping_ranks(self.groups[e.dst], self.rank, self.groups[e.src], self.batch_size, mb):
            held = self._held(e, q, length, mb)
            piece = held.intersect(need)
            if piece.empty:
                continue
            if q == self.rank:
                value = held.extract(st.outputs[(e.src, mb)][e.src_port], piece)
            else:
                value = st.received[(e.src, e.dst, mb, q)][(e.src_port, e.dst_port)]
            pieces.append((piece, value))
        if not pieces:
            raise ValueError(
                f"{e}: rank {self.rank} of {e.dst} would hold no part of it ({need}); the sequence is "
                f"shorter than {e.dst}'s sequence-parallel degree {self.groups[e.dst].sp}"
            )
        if len(pieces) == 1 and pieces[0][0] == need:
            return pieces[0][1], need
        buf = torch.empty(need.shape(pieces[0][1]), dtype=pieces[0][1].dtype, device=pieces[0][1].device)
        for piece, value in pieces:
            need.add_into(buf, piece, value, accumulate=False)
        return buf, need

    def _backward(self, stage: str, mb: int, st: _StepState) -> None:
        out = st.outputs[(stage, mb)]
        group = self.groups[stage]
        n = len(group.ranks)
        module = self.modules[stage]
        if isinstance(module, FSDPModule):
            # Accumulate unreduced gradients and reduce-scatter once, in the last micro-batch's backward.
            module.set_requires_gradient_sync(mb == st.last_backward[stage])
            if group.gather_once:
                module.set_reshard_after_backward(mb == st.last_backward[stage])
        # Seed the backward with n (the group's size) x this rank's share of d(loss): FSDP2's average
        # over the group then yields the sum of the shares; input gradients are scaled back by 1/n below.
        if not any(c in self.plan.backward for c in self.plan.consumers(stage)):
            # a loss stage: its replica's slice loss is dp x (rows / batch) = 1 times the slice's share
            # of the micro-batch loss, and each of the replica's sp ranks returns a share of that
            (out["loss"] * group.sp / self.plan.micro_batches).backward()
        else:
            grads = st.grads.pop((stage, mb), {})
            ports = [p for p in grads if out[p].requires_grad]
            seeds = [grads[p] * n if n > 1 else grads[p] for p in ports]
            torch.autograd.backward([out[p] for p in ports], seeds)
        inputs = st.inputs.pop((stage, mb))
        for e in self.graph.producers(stage):
            x = inputs[e.dst_port]
            if e.src == INPUT or e.src not in self.plan.backward or not x.is_floating_point():
                continue
            grad = x.grad if x.grad is not None else torch.zeros_like(x)  # an input the stage did not use
            if n > 1:
                grad = grad / n
            if self.rank in self.groups[e.src]:
                self._accumulate(e, mb, self.rank, grad, st)
            st.pending_grads[(e.src, stage, mb)][(e.src_port, e.dst_port)] = grad
        del st.outputs[(stage, mb)]
        if stage in self._replicated and mb == st.last_backward[stage]:
            self._all_reduce_gradients(stage, n)

    def _all_reduce_gradients(self, stage: str, n: int) -> None:
        """A replicated stage's gradients averaged over its group: one flat all-reduce of every
        parameter's gradient (a parameter without one contributes zeros, so every rank agrees).
        With the backward seeded ``n`` times each rank's share (above), the average is the sum of
        the shares, as FSDP2's reduce-scatter gives a sharded stage."""
        params = [p for p in self.modules[stage].parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self._replicated[stage])
        flat.div_(n)
        at = 0
        for p, g in zip(params, grads, strict=True):
            size = g.numel()
            p.grad = flat[at : at + size].view_as(p)
            at += size

    def _accumulate(self, e: Edge, mb: int, peer: int, grad: torch.Tensor, st: _StepState) -> None:
        """Add the gradient ``peer`` computed for its part of ``e``'s tensor into this rank's output gradient
        (``grad``: the piece both hold when ``peer`` is remote, ``peer``'s whole input gradient when local)."""
        length = self._length(e, mb, st)
        held, need = self._held(e, self.rank, length, mb), self._needed(e, peer, length, mb)
        piece = held.intersect(need)
        if piece.empty:
            return
        buf = st.grads[(e.src, mb)]
        if e.src_port not in buf:
            buf[e.src_port] = torch.zeros_like(st.outputs[(e.src, mb)][e.src_port])
        value = grad if peer != self.rank else need.extract(grad, piece)
        held.add_into(buf[e.src_port], piece, value, accumulate=True)

    def _step(self, stage: str, st: _StepState) -> float:
        opt = self.optimizers[stage]
        params = [p for p in self.modules[stage].parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, opt.grad_clip or float("inf"))
        if hasattr(norm, "full_tensor"):  # DTensor under FSDP2: the norm over the whole group
            norm = norm.full_tensor()
        value = float(norm)  # the group's norm: every rank of an FSDP group decides alike
        if not math.isfinite(value):
            if not opt.skip_nonfinite:
                raise NonFiniteError(self._nonfinite_message(stage, st))
            opt.optimizer.zero_grad(set_to_none=True)  # the update is dropped; the lr schedule waits too
            st.skipped.append(stage)
            return value
        opt.optimizer.step()
        opt.optimizer.zero_grad(set_to_none=True)
        opt.lr_scheduler.step()
        return value

    def _nonfinite_message(self, stage: str, st: _StepState) -> str:
        """Which tensor went non-finite first: the stage's loss, else its first parameter's gradient."""
        where = f"training step {st.step + 1}: " if st.step is not None else ""
        if not bool(torch.isfinite(st.loss)):
            return f"{where}stage {stage!r}: the loss is {st.loss.item()} (train.nonfinite=stop)"
        for name, p in self.modules[stage].named_parameters():
            grad: Any = p.grad
            grad = grad.to_local() if hasattr(grad, "to_local") else grad  # a DTensor shard under FSDP2
            if grad is not None and not bool(torch.isfinite(grad).all()):
                kind = "NaN" if bool(torch.isnan(grad).any()) else "infinite"
                return f"{where}stage {stage!r}: the gradient of {name} is {kind} (train.nonfinite=stop)"
        return f"{where}stage {stage!r}: the gradient norm is non-finite on another rank (train.nonfinite=stop)"

    # ---- transfers ------------------------------------------------------------------------------
    def _edge_ports(self, src: str, dst: str, *, grad: bool = False) -> list[Edge]:
        """The port edges of the ``src -> dst`` bundle; gradients travel only for floating-point ports."""
        edges = sorted(
            (e for e in self._port_edges if (e.src, e.dst) == (src, dst)), key=lambda e: (e.src_port, e.dst_port)
        )
        if grad:
            edges = [e for e in edges if e.src_port in self._float_ports[src]]
        return edges

    def _send(self, a: Action, st: _StepState, *, grad: bool) -> int:
        """Send the peer exactly the part of each port's tensor it needs (or, for gradients, holds)."""
        assert a.dst is not None and a.peer is not None and a.mb is not None
        edges = self._edge_ports(a.stage, a.dst, grad=grad)
        tensors, lengths = [], []
        for e in edges:
            length = self._length(e, a.mb, st)
            if grad:  # this rank holds a.dst; the peer holds a.stage
                need = self._needed(e, self.rank, length, a.mb)
                piece = self._held(e, a.peer, length, a.mb).intersect(need)
                tensors.append(need.extract(st.pending_grads[(a.stage, a.dst, a.mb)][(e.src_port, e.dst_port)], piece))
            else:
                held = self._held(e, self.rank, length, a.mb)
                piece = held.intersect(self._needed(e, a.peer, length, a.mb))
                tensors.append(held.extract(st.outputs[(a.stage, a.mb)][e.src_port], piece))
            lengths.append(length)
        # A forward message ends with the whole lengths along the split dims, which the receiver
        # needs to know its own part; the events count only the payload.
        message = tensors if grad else [*tensors, torch.tensor(lengths, dtype=torch.int64)]
        self._inflight.append(isend_message(message, a.peer, self._tag(a.stage, a.dst, grad), wire=self.wire))
        if len(self._inflight) > self.max_inflight:  # bound how far a producer runs ahead
            # Completed sends leave the window wherever they are in it: a frozen stage's send that
            # ran ahead may stay unreceived until the step's last micro-batch while later ones finish.
            self._inflight = collections.deque(
                (works, m) for works, m in self._inflight if not all(w.is_completed() for w in works)
            )
        while len(self._inflight) > self.max_inflight:
            self._wait_oldest()
        return nbytes(tensors)

    def _wait_oldest(self) -> None:
        works, _ = self._inflight.popleft()
        for work in works:
            work.wait()

    def flush(self) -> None:
        """Wait for every send in flight (before collectives, checkpoints and exit)."""
        while self._inflight:
            self._wait_oldest()

    def _recv(self, a: Action, st: _StepState, *, grad: bool) -> int:
        assert a.dst is not None and a.peer is not None and a.mb is not None
        edges = self._edge_ports(a.stage, a.dst, grad=grad)
        expected = len(edges) + (not grad)
        tensors = recv_tensors(a.peer, self._tag(a.stage, a.dst, grad), expected, wire=self.wire, device=self.device)
        if grad:
            for e, g in zip(edges, tensors, strict=True):
                self._accumulate(e, a.mb, a.peer, g, st)
            return nbytes(tensors)
        *tensors, lengths = tensors
        for e, length in zip(edges, lengths.tolist(), strict=True):
            st.lengths[(e.src, e.src_port, a.mb)] = length
        st.received[(a.stage, a.dst, a.mb, a.peer)] = {
            (e.src_port, e.dst_port): t for e, t in zip(edges, tensors, strict=True)
        }
        return nbytes(tensors)

    def _tag(self, src: str, dst: str, grad: bool) -> int:
        return 2 * self._tags[(src, dst)] + int(grad)


def compile_blocks(module: nn.Module) -> None:
    """Regional compilation: ``torch.compile`` each repeated block in place (torchtitan's recipe).
    Identical blocks share one compiled graph (parameters are graph inputs, not constants), so a
    30-block DiT compiles once; applied after the activation policy wraps a block's forward, so a
    recomputed block's recomputation runs compiled too."""
    blocks = repeated_blocks(module)
    if not blocks:
        raise PlanError(f"model.compile=true: {type(module).__name__} has no repeated blocks to compile")
    for block in blocks:
        block.compile()


def check_pair_order(plan: Plan) -> None:
    """NCCL matches a pair of ranks' point-to-point messages in the order they were posted (it has
    no tags): every rank must receive each peer's bundles in the order that peer sends them."""
    sent: defaultdict[tuple[int, int], list[tuple[str, str | None, int | None, ActionKind]]] = defaultdict(list)
    received: defaultdict[tuple[int, int], list[tuple[str, str | None, int | None, ActionKind]]] = defaultdict(list)
    pairs = {ActionKind.SEND: ActionKind.RECV, ActionKind.SEND_GRAD: ActionKind.RECV_GRAD}
    for rank, actions in enumerate(plan.actions):
        for a in actions:
            assert a.peer is not None or a.kind not in (*pairs, *pairs.values())
            if a.kind in pairs:
                sent[(rank, a.peer)].append((a.stage, a.dst, a.mb, pairs[a.kind]))  # type: ignore[index]
            elif a.kind in pairs.values():
                received[(a.peer, rank)].append((a.stage, a.dst, a.mb, a.kind))  # type: ignore[index]
    for (src, dst), order in sent.items():
        if received[(src, dst)] != order:
            raise PlanError(
                f"rank {dst} receives rank {src}'s messages in another order than they are sent, which NCCL "
                f"cannot match (it has no tags): sent {order}, received {received[(src, dst)]}"
            )


def _mb(a: Action) -> int:
    assert a.mb is not None
    return a.mb


@dataclasses.dataclass
class _StepState:
    """Everything one pass over an action list holds; dropped when the pass ends."""

    batches: dict[int, dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)
    inputs: dict[tuple[str, int], dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)
    outputs: dict[tuple[str, int], Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    received: dict[tuple[str, str, int, int], dict[tuple[str, str], torch.Tensor]] = dataclasses.field(
        default_factory=dict
    )
    lengths: dict[tuple[str, str, int], int] = dataclasses.field(default_factory=dict)  # (src, port, mb)
    grads: defaultdict[tuple[str, int], dict[str, torch.Tensor]] = dataclasses.field(
        default_factory=lambda: defaultdict(dict)
    )
    pending_grads: defaultdict[tuple[str, str, int], dict[tuple[str, str], torch.Tensor]] = dataclasses.field(
        default_factory=lambda: defaultdict(dict)
    )
    loss: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(()))
    grad_norms: dict[str, float] = dataclasses.field(default_factory=dict)
    last_backward: dict[str, int] = dataclasses.field(default_factory=dict)
    step: int | None = None  # the training step (for errors)
    keys_fn: KeysFn | None = None  # micro-batch -> sample keys (frozen-output cache)
    cached_rows: int = 0  # rows the frozen-output cache served in this pass
    skipped: list[str] = dataclasses.field(default_factory=list)  # stages whose update was dropped

    def batch(self, mb: int, batch_fn: BatchFn) -> dict[str, torch.Tensor]:
        if mb not in self.batches:
            self.batches[mb] = batch_fn(mb)
        return self.batches[mb]
