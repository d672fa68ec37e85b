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
import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from mmpipe.graph import INPUT, Graph
from mmpipe.runtime.events import EventRecorder
from mmpipe.runtime.mesh import MeshOwner
from mmpipe.runtime.transport import isend_tensors, nbytes, recv_tensors
from mmpipe.sched.plan import Action, ActionKind, Plan, PlanError, check_split, overlapping_ranks, send_window

BatchFn = Callable[[int], dict[str, torch.Tensor]]  # micro-batch index -> full micro-batch graph inputs
OptionsFn = Callable[[str, int, tuple[int, int, int]], dict[str, Any]]  # stage, mb, rows -> forward options


class ExecutionError(RuntimeError):
    """An action failed at run time; the message carries this rank's plan table."""


@dataclasses.dataclass
class StageOptim:
    """The optimizer side of one trainable stage on this rank."""

    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    grad_clip: float


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
    ) -> None:
        self.graph, self.plan, self.mesh, self.rank = graph, plan, mesh, mesh.rank
        self.groups = plan.groups
        self.batch_size = batch_size
        self.events = events
        # Sends in flight (works + the tensors they read), kept across passes: a rank that only
        # produces for others may run ahead into the next step by up to this many messages.
        self.max_inflight = max_inflight_sends or send_window(plan)
        self._inflight: collections.deque[tuple[list[dist.Work], list[torch.Tensor]]] = collections.deque()
        if plan.batch and plan.batch != batch_size:
            raise PlanError(f"the plan was made for micro-batches of {plan.batch} samples, not {batch_size}")
        for stage, group in plan.placement:
            check_split(stage, group, batch_size, backward=stage in plan.backward)
        self.local = plan.stages_on(self.rank)
        self.optimizers: dict[str, StageOptim] = {}  # filled by the trainer for local trainable stages
        self.modules: dict[str, nn.Module] = {s: self._build(s) for s in self.local}
        self._port_edges = [e for e in graph.edges if e.src != INPUT]
        self._tags = {pair: i for i, pair in enumerate(graph.stage_edges())}
        # Output ports that carry gradients: declared floating point, or of unspecified dtype.
        self._float_ports = {
            name: {p for p, spec in st.outputs.items() if spec.dtype is None or spec.dtype.is_floating_point}
            for name, st in graph.stages.items()
        }

    def _build(self, stage: str) -> nn.Module:
        # Order of parallelisms (DESIGN.md): sequence parallel -> activation policy -> compile -> FSDP2.
        module = self.graph.stages[stage].module
        mesh = self.mesh.dp_mesh(stage)
        if mesh is not None and not self.graph.stages[stage].frozen:
            # FSDP2 averages gradients over the group (gloo has no pre-scaled sum); _backward
            # seeds each rank's backward dp times its share so that the average is the sum.
            fully_shard(module, mesh=mesh)
        return module

    def rows(self, stage: str, rank: int | None = None) -> tuple[int, int]:
        """The rows of each micro-batch that ``rank`` (default: this rank) holds of ``stage``."""
        return self.groups[stage].rows(self.rank if rank is None else rank, self.batch_size)

    # ---- one pass over an action list -------------------------------------------------------------
    def run(
        self, actions: tuple[Action, ...], batch_fn: BatchFn, options_fn: OptionsFn, *, flush: bool = True
    ) -> dict[str, Any]:
        """Interpret ``actions``; returns ``{"loss": weighted local loss sum, "grad_norm": {stage: norm}}``.

        ``flush=False`` returns with sends still in flight (bounded by ``max_inflight_sends``).
        """
        state = _StepState()
        for a in actions:  # the pass's last backward of each stage reduces its gradients
            if a.kind == ActionKind.B:
                state.last_backward[a.stage] = _mb(a)
        for i, action in enumerate(actions):
            start = time.perf_counter()
            try:
                moved = self._dispatch(action, state, batch_fn, options_fn)
            except (RuntimeError, ValueError) as err:
                raise ExecutionError(
                    f"rank {self.rank} failed at step {i} ({action}): {err}\n{self.plan.format_table({self.rank: i})}"
                ) from err
            if self.events is not None:
                self.events.record(action, start, time.perf_counter(), moved)
        if flush:
            self.flush()
        return {"loss": state.loss, "grad_norm": state.grad_norms}

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
                st.grad_norms[a.stage] = self._step(a.stage)
        return 0

    # ---- compute --------------------------------------------------------------------------------
    def _forward(self, stage: str, mb: int, st: _StepState, batch_fn: BatchFn, options_fn: OptionsFn) -> None:
        lo, hi = self.rows(stage)
        wants_grad = stage in self.plan.backward
        inputs: dict[str, torch.Tensor] = {}
        for e in self.graph.producers(stage):
            if e.src == INPUT:
                inputs[e.dst_port] = st.batch(mb, batch_fn)[e.src_port][lo:hi]
                continue
            x = self._edge_value(e.src, stage, e.src_port, mb, st)
            if wants_grad and e.src in self.plan.backward and x.is_floating_point():
                x = x.detach().requires_grad_(True)
            inputs[e.dst_port] = x
        with torch.set_grad_enabled(wants_grad):
            out = self.graph.stages[stage].forward(
                self.modules[stage], inputs, **options_fn(stage, mb, (lo, hi, self.batch_size))
            )
        st.inputs[(stage, mb)] = inputs
        st.outputs[(stage, mb)] = out
        if "loss" in out and not self.graph.consumers(stage):
            weight = (hi - lo) / self.batch_size
            st.loss += out["loss"].detach().float() * weight / self.plan.micro_batches

    def _edge_value(self, src: str, dst: str, port: str, mb: int, st: _StepState) -> torch.Tensor:
        """The rows of ``src.port`` this rank's ``dst`` needs: local slices and received pieces, in row order."""
        lo, hi = self.rows(dst)
        pieces = []
        for q in overlapping_ranks(self.groups[dst], self.rank, self.groups[src], self.batch_size):
            if q == self.rank:
                plo, _ = self.rows(src)
                a, b = max(lo, plo), min(hi, self.rows(src)[1])
                pieces.append(st.outputs[(src, mb)][port][a - plo : b - plo])
            else:
                pieces.append(st.received[(src, dst, mb, q)][port])
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _backward(self, stage: str, mb: int, st: _StepState) -> None:
        out = st.outputs[(stage, mb)]
        dp = self.groups[stage].dp
        module = self.modules[stage]
        if isinstance(module, FSDPModule):
            # Accumulate unreduced gradients and reduce-scatter once, in the last micro-batch's backward.
            module.set_requires_gradient_sync(mb == st.last_backward[stage])
        # Seed the backward with dp x this rank's share of d(loss): FSDP2's average over the group
        # then yields the sum of the shares; the input gradients are scaled back by 1/dp below.
        if not any(c in self.plan.backward for c in self.plan.consumers(stage)):
            # a loss stage: its slice's mean loss is dp x (rows / batch) = 1 times its share
            (out["loss"] / self.plan.micro_batches).backward()
        else:
            grads = st.grads.pop((stage, mb), {})
            ports = [p for p in grads if out[p].requires_grad]
            seeds = [grads[p] * dp if dp > 1 else grads[p] for p in ports]
            torch.autograd.backward([out[p] for p in ports], seeds)
        inputs = st.inputs.pop((stage, mb))
        for e in self.graph.producers(stage):
            x = inputs[e.dst_port]
            if e.src == INPUT or e.src not in self.plan.backward or not x.is_floating_point():
                continue
            grad = x.grad if x.grad is not None else torch.zeros_like(x)  # an input the stage did not use
            if dp > 1:
                grad = grad / dp
            if self.rank in self.groups[e.src].ranks:
                self._accumulate(e.src, e.src_port, stage, mb, self.rank, grad, st)
            st.pending_grads[(e.src, stage, mb)][e.src_port] = grad
        del st.outputs[(stage, mb)]

    def _accumulate(
        self, src: str, port: str, consumer: str, mb: int, peer: int, grad: torch.Tensor, st: _StepState
    ) -> None:
        """Add the gradient rows ``peer`` computed for ``consumer`` into ``src``'s output gradient."""
        slo, shi = self.rows(src)
        clo, chi = self.rows(consumer, peer)
        a, b = max(slo, clo), min(shi, chi)
        piece = grad if peer != self.rank else grad[a - clo : b - clo]
        buf = st.grads[(src, mb)]
        if port not in buf:
            buf[port] = torch.zeros_like(st.outputs[(src, mb)][port])
        buf[port][a - slo : b - slo] += piece

    def _step(self, stage: str) -> float:
        opt = self.optimizers[stage]
        params = [p for p in self.modules[stage].parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, opt.grad_clip or float("inf"))
        if hasattr(norm, "full_tensor"):  # DTensor under FSDP2: the norm over the whole group
            norm = norm.full_tensor()
        opt.optimizer.step()
        opt.optimizer.zero_grad(set_to_none=True)
        opt.lr_scheduler.step()
        return float(norm)

    # ---- transfers ------------------------------------------------------------------------------
    def _edge_ports(self, src: str, dst: str, *, grad: bool = False) -> list[tuple[str, str]]:
        """The ports of the ``src -> dst`` bundle; gradients travel only for floating-point ports."""
        ports = sorted((e.src_port, e.dst_port) for e in self._port_edges if (e.src, e.dst) == (src, dst))
        if grad:
            float_ports = self._float_ports[src]
            ports = [(sp, dp) for sp, dp in ports if sp in float_ports]
        return ports

    def _send(self, a: Action, st: _StepState, *, grad: bool) -> int:
        assert a.dst is not None and a.peer is not None and a.mb is not None
        ports = self._edge_ports(a.stage, a.dst, grad=grad)
        if grad:  # this rank holds a.dst; the peer holds a.stage
            lo, hi = self.rows(a.dst)
            plo, phi = self.rows(a.stage, a.peer)
            sent = st.pending_grads[(a.stage, a.dst, a.mb)]
            tensors = [sent[sp][max(lo, plo) - lo : min(hi, phi) - lo] for sp, _ in ports]
        else:
            lo, hi = self.rows(a.stage)
            clo, chi = self.rows(a.dst, a.peer)
            out = st.outputs[(a.stage, a.mb)]
            tensors = [out[sp][max(lo, clo) - lo : min(hi, chi) - lo] for sp, _ in ports]
        self._inflight.append((isend_tensors(tensors, a.peer, self._tag(a.stage, a.dst, grad)), tensors))
        while len(self._inflight) > self.max_inflight:  # bound how far a producer runs ahead
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
        ports = self._edge_ports(a.stage, a.dst, grad=grad)
        tensors = recv_tensors(a.peer, self._tag(a.stage, a.dst, grad), len(ports))
        if grad:
            for (sp, _), g in zip(ports, tensors, strict=True):
                self._accumulate(a.stage, sp, a.dst, a.mb, a.peer, g, st)
        else:
            st.received[(a.stage, a.dst, a.mb, a.peer)] = {sp: t for (sp, _), t in zip(ports, tensors, strict=True)}
        return nbytes(tensors)

    def _tag(self, src: str, dst: str, grad: bool) -> int:
        return 2 * self._tags[(src, dst)] + int(grad)


def _mb(a: Action) -> int:
    assert a.mb is not None
    return a.mb


@dataclasses.dataclass
class _StepState:
    """Everything one pass over an action list holds; dropped when the pass ends."""

    batches: dict[int, dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)
    inputs: dict[tuple[str, int], dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)
    outputs: dict[tuple[str, int], Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    received: dict[tuple[str, str, int, int], dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)
    grads: defaultdict[tuple[str, int], dict[str, torch.Tensor]] = dataclasses.field(
        default_factory=lambda: defaultdict(dict)
    )
    pending_grads: defaultdict[tuple[str, str, int], dict[str, torch.Tensor]] = dataclasses.field(
        default_factory=lambda: defaultdict(dict)
    )
    loss: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(()))
    grad_norms: dict[str, float] = dataclasses.field(default_factory=dict)
    last_backward: dict[str, int] = dataclasses.field(default_factory=dict)

    def batch(self, mb: int, batch_fn: BatchFn) -> dict[str, torch.Tensor]:
        if mb not in self.batches:
            self.batches[mb] = batch_fn(mb)
        return self.batches[mb]
