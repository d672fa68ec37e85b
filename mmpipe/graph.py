"""The DAG of model stages: nodes with named tensor ports, edges ``producer.port -> consumer.port``.

A :class:`Graph` is pure structure plus the stages' adapters; it never owns a device or a process
group. Validation (cycles, unknown or unconnected ports, shape / dtype mismatch) happens when the
graph is built, so a bad graph fails with a ``ValueError`` naming the stage and port before any
model is instantiated or any worker starts.

Graph-level inputs are ports of the reserved pseudo-stage ``input`` (``graph.add_input("video",
spec)`` then ``graph.connect("input.video", "vae.video")``). Output ports that feed nothing are the
graph's outputs.

Shape legend for port specs: a dimension is an ``int`` (must match exactly) or a symbol ``str``
(``"B"`` batch, ``"L"`` text tokens, ``"T"``/``"H"``/``"W"`` frames / height / width) that matches
anything; ``None`` as the whole shape means "any rank".
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import networkx as nx
import torch
from torch import nn

if TYPE_CHECKING:
    from mmpipe.parallel.sequence import SequenceMesh

INPUT = "input"

Dim = int | str


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """The symbolic shape and dtype of one port. ``None`` fields match anything."""

    shape: tuple[Dim, ...] | None = None
    dtype: torch.dtype | None = None
    required: bool = True

    def mismatch(self, other: TensorSpec) -> str | None:
        """Why a tensor described by ``self`` cannot flow into a port described by ``other``."""
        if self.dtype is not None and other.dtype is not None and self.dtype != other.dtype:
            return f"dtype {self.dtype} != {other.dtype}"
        if self.shape is None or other.shape is None:
            return None
        if len(self.shape) != len(other.shape):
            return (
                f"rank {len(self.shape)} {_fmt_shape(self.shape)} != rank {len(other.shape)} {_fmt_shape(other.shape)}"
            )
        for i, (a, b) in enumerate(zip(self.shape, other.shape, strict=True)):
            if isinstance(a, int) and isinstance(b, int) and a != b:
                return f"dim {i}: {_fmt_shape(self.shape)} != {_fmt_shape(other.shape)}"
        return None

    def check_value(self, value: Any) -> str | None:
        """Why a run-time ``value`` does not satisfy this spec (``None`` when it does)."""
        if not isinstance(value, torch.Tensor):
            return f"expected a tensor, got {type(value).__name__}"
        actual = TensorSpec(tuple(value.shape), value.dtype)
        return actual.mismatch(self)


def _fmt_shape(shape: tuple[Dim, ...]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What parallelism and memory policies a stage can take (checked by the planner and configs)."""

    sequence_parallel: bool = False
    fsdp: bool = False
    offload: bool = False


@dataclasses.dataclass(frozen=True)
class Edge:
    """``src.src_port -> dst.dst_port``; ``src == "input"`` for graph inputs."""

    src: str
    src_port: str
    dst: str
    dst_port: str

    def __str__(self) -> str:
        return f"{self.src}.{self.src_port} -> {self.dst}.{self.dst_port}"


class Stage(abc.ABC):
    """A node of the graph: an adapter around one unmodified diffusers / transformers module.

    Subclasses declare ``inputs`` and ``outputs`` (port name -> :class:`TensorSpec`), build their
    module in :meth:`build` and map input ports to output ports in :meth:`forward`.
    """

    kind: str = "stage"
    capabilities: Capabilities = Capabilities()

    def __init__(self, name: str, *, frozen: bool) -> None:
        if not name or "." in name or name == INPUT:
            raise ValueError(f"invalid stage name {name!r}: must be non-empty, without '.', and not {INPUT!r}")
        self.name = name
        self.frozen = frozen
        self._module: nn.Module | None = None

    @property
    @abc.abstractmethod
    def inputs(self) -> Mapping[str, TensorSpec]:
        """Input ports."""

    @property
    @abc.abstractmethod
    def outputs(self) -> Mapping[str, TensorSpec]:
        """Output ports."""

    @abc.abstractmethod
    def build(self) -> nn.Module:
        """Instantiate the stage's module (tiny random config or a local ``from_pretrained`` dir)."""

    @abc.abstractmethod
    def forward(self, module: nn.Module, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        """Compute the output ports from the input ports."""

    # ---- sequence parallelism (stages with ``capabilities.sequence_parallel``) ------------------
    #: ports a sequence-parallel replica splits, ``port -> dim``; the others are whole on every rank
    sequence_inputs: Mapping[str, int] = {}
    sequence_outputs: Mapping[str, int] = {}
    #: the stage's attention is causal: its sequence is split zig-zag (see mmpipe.parallel.sequence)
    sequence_causal: bool = False

    def check_sequence_parallel(self, ulysses: int, ring: int) -> None:
        """Raise a ``ValueError`` naming the values unless the stage can run split ``ulysses x ring``
        ways (checked before any worker starts)."""
        if ulysses * ring > 1 and not self.capabilities.sequence_parallel:
            raise ValueError(
                f"stage {self.name!r} ({self.kind}) cannot be sequence parallel (ulysses={ulysses} ring={ring})"
            )

    def sequence_length(self, inputs: Mapping[str, Any]) -> int:
        """The whole length of the split sequence, from this rank's inputs (stages with ``sequence_outputs``)."""
        raise NotImplementedError(f"stage {self.name!r} ({self.kind}) declares no split outputs")

    def parallelize_sequence(self, module: nn.Module, mesh: SequenceMesh, *, attention: str = "torch") -> None:
        """Make ``module`` run on this rank's shard of the sequence under ``mesh`` (in place), its
        local attention through backend ``attention`` (``model.kernels.attention``)."""
        raise ValueError(f"stage {self.name!r} ({self.kind}) cannot be sequence parallel")

    @property
    def module(self) -> nn.Module:
        """The stage's module, built on first use; frozen stages are in eval mode without grads."""
        if self._module is None:
            module = self.build()
            if self.frozen:
                module.eval().requires_grad_(False)
            self._module = module
        return self._module

    def num_parameters(self) -> int:
        """Parameter count of the built module."""
        return sum(p.numel() for p in self.module.parameters())

    def device(self) -> torch.device:
        """Where the built module's parameters live (CPU for a module without parameters)."""
        param = next(self.module.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def __call__(self, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        # Inputs follow the module: a graph's stages may sit on different devices (a CUDA DiT fed
        # by CPU-side tokens), and a no-op .to() costs nothing where they already match.
        device = self.device()
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        # Frozen stages never build an autograd graph: they are pure producers of edge tensors.
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):
            return self.forward(self.module, inputs, **options)


#: ``(stage, inputs, options) -> outputs``: how one process of a multi-process run obtains a
#: stage's outputs (computes them, or receives them from the rank that does)
StageHost = Callable[["Stage", Mapping[str, Any], dict[str, Any]], dict[str, Any]]


class Graph:
    """Stages plus edges between their named ports, backed by a ``networkx.MultiDiGraph``."""

    def __init__(self, name: str = "graph") -> None:
        self.name = name
        self.stages: dict[str, Stage] = {}
        self.input_specs: dict[str, TensorSpec] = {}
        self.edges: list[Edge] = []
        self._nx = nx.MultiDiGraph()
        self._nx.add_node(INPUT)
        #: stages :meth:`run` does not call directly: their host computes the outputs (e.g. on one
        #: rank, broadcast to the others; see ``mmpipe.runtime.inference``)
        self.hosts: dict[str, StageHost] = {}

    # ---- building -------------------------------------------------------------------------
    def add_input(self, name: str, spec: TensorSpec) -> None:
        """Declare a graph-level input port ``input.<name>``."""
        if name in self.input_specs:
            raise ValueError(f"graph input {name!r} is declared twice")
        self.input_specs[name] = spec

    def add_stage(self, stage: Stage) -> Stage:
        """Add a stage node; names are unique."""
        if stage.name in self.stages:
            raise ValueError(f"stage {stage.name!r} is added twice")
        self.stages[stage.name] = stage
        self._nx.add_node(stage.name)
        return stage

    def connect(self, src: str, dst: str) -> Edge:
        """Add the edge ``"producer.port" -> "consumer.port"``, checking ports and specs now."""
        src_stage, src_port = _split(src)
        dst_stage, dst_port = _split(dst)
        src_spec = self._port_spec(src_stage, src_port, output=True)
        dst_spec = self._port_spec(dst_stage, dst_port, output=False)
        for e in self.edges:
            if (e.dst, e.dst_port) == (dst_stage, dst_port):
                raise ValueError(f"input port {dst} is already fed by {e.src}.{e.src_port}")
        if (why := src_spec.mismatch(dst_spec)) is not None:
            raise ValueError(f"edge {src} -> {dst}: shape/dtype mismatch: {why}")
        edge = Edge(src_stage, src_port, dst_stage, dst_port)
        self.edges.append(edge)
        self._nx.add_edge(src_stage, dst_stage, key=str(edge))
        return edge

    def _port_spec(self, stage: str, port: str, *, output: bool) -> TensorSpec:
        if stage == INPUT:
            if not output:
                raise ValueError(f"'{INPUT}' is the graph's input pseudo-stage; it has no input port {port!r}")
            if port not in self.input_specs:
                raise ValueError(f"unknown graph input {port!r}; declared: {sorted(self.input_specs)}")
            return self.input_specs[port]
        if stage not in self.stages:
            raise ValueError(f"unknown stage {stage!r}; stages: {sorted(self.stages)}")
        ports = self.stages[stage].outputs if output else self.stages[stage].inputs
        if port not in ports:
            kind = "output" if output else "input"
            raise ValueError(f"stage {stage!r} has no {kind} port {port!r}; its {kind} ports: {sorted(ports)}")
        return ports[port]

    # ---- validation ---------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ``ValueError`` naming the stage and port for a cycle or an unconnected required input."""
        try:
            cycle = nx.find_cycle(self._nx)
        except nx.NetworkXNoCycle:
            cycle = None
        if cycle:
            path = " -> ".join([u for u, *_ in cycle] + [cycle[0][0]])
            raise ValueError(f"graph {self.name!r} has a cycle: {path}")
        fed = {(e.dst, e.dst_port) for e in self.edges}
        for name, stage in self.stages.items():
            for port, spec in stage.inputs.items():
                if spec.required and (name, port) not in fed:
                    raise ValueError(f"stage {name!r}: required input port {port!r} is not connected")

    def topological_order(self) -> list[str]:
        """Stage names in an order where every producer precedes its consumers (stable by insertion)."""
        self.validate()
        order = list(nx.lexicographical_topological_sort(self._nx, key=list(self._nx.nodes).index))
        return [n for n in order if n != INPUT]

    def stage_edges(self) -> list[tuple[str, str]]:
        """Stage-level ``(producer, consumer)`` pairs, without graph inputs, in edge order."""
        return list(dict.fromkeys((e.src, e.dst) for e in self.edges if e.src != INPUT))

    def producers(self, stage: str) -> list[Edge]:
        """Edges feeding ``stage``."""
        return [e for e in self.edges if e.dst == stage]

    def consumers(self, stage: str) -> list[Edge]:
        """Edges leaving ``stage``."""
        return [e for e in self.edges if e.src == stage]

    def frozen_prefix(self) -> list[str]:
        """Frozen stages fed only by graph inputs and other such stages, in topological order: their
        outputs are a function of the sample (what a training run may cache instead of recomputing)."""
        prefix: list[str] = []
        for name in self.topological_order():
            if self.stages[name].frozen and all(e.src == INPUT or e.src in prefix for e in self.producers(name)):
                prefix.append(name)
        return prefix

    def data_inputs(self, stage: str) -> set[str]:
        """The graph inputs ``stage``'s outputs depend on: those it reads and those of the stages
        upstream of it."""
        ports: set[str] = set()
        for e in self.producers(stage):
            ports |= {e.src_port} if e.src == INPUT else self.data_inputs(e.src)
        return ports

    def trainable_stages(self) -> list[Stage]:
        """Stages that are not frozen, in topological order."""
        return [self.stages[n] for n in self.topological_order() if not self.stages[n].frozen]

    # ---- single-process execution -------------------------------------------------------------
    def run(
        self,
        inputs: Mapping[str, Any],
        options: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        until: str | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Run every stage once in topological order; returns each stage's output ports.

        ``options`` maps a stage name to keyword options of its ``forward`` (a seed, a step count);
        ``until``: stop after that stage (what it needs has run before it).
        """
        missing = sorted(k for k, spec in self.input_specs.items() if spec.required and k not in inputs)
        if missing:
            raise ValueError(f"graph {self.name!r}: missing inputs {missing}")
        values: dict[str, dict[str, Any]] = {INPUT: dict(inputs)}
        for name in self.topological_order():
            stage = self.stages[name]
            # An optional port whose producer has no value (an optional graph input) stays unset.
            port_values = {
                e.dst_port: values[e.src][e.src_port] for e in self.producers(name) if e.src_port in values[e.src]
            }
            _check_ports(name, "input", stage.inputs, port_values)
            stage_options = dict((options or {}).get(name, {}))
            host = self.hosts.get(name)
            out = host(stage, port_values, stage_options) if host is not None else stage(port_values, **stage_options)
            _check_ports(name, "output", stage.outputs, out)
            values[name] = out
            if name == until:
                break
        del values[INPUT]
        return values

    # ---- printing -----------------------------------------------------------------------------
    def __str__(self) -> str:
        lines = [f"Graph {self.name!r}: {len(self.stages)} stages, {len(self.edges)} edges"]
        if self.input_specs:
            lines.append("  inputs: " + ", ".join(f"{k}{_spec_str(s)}" for k, s in self.input_specs.items()))
        for name in self.topological_order():
            st = self.stages[name]
            mode = "frozen" if st.frozen else "trainable"
            params = f"{st.num_parameters():,} params" if st._module is not None else "not built"
            lines.append(f"  [{st.kind}] {name} ({mode}, {params})")
            lines.append("      in : " + ", ".join(f"{k}{_spec_str(s)}" for k, s in st.inputs.items()))
            lines.append("      out: " + ", ".join(f"{k}{_spec_str(s)}" for k, s in st.outputs.items()))
        lines.append("  edges:")
        lines.extend(f"    {e}" for e in self.edges)
        return "\n".join(lines)


def _spec_str(spec: TensorSpec) -> str:
    shape = _fmt_shape(spec.shape) if spec.shape is not None else "(...)"
    dtype = f":{str(spec.dtype).removeprefix('torch.')}" if spec.dtype is not None else ""
    return f"{shape}{dtype}{'' if spec.required else '?'}"


def _split(endpoint: str) -> tuple[str, str]:
    stage, dot, port = endpoint.partition(".")
    if not dot or not stage or not port:
        raise ValueError(f"edge endpoint {endpoint!r} must be 'stage.port'")
    return stage, port


def _check_ports(stage: str, kind: str, specs: Mapping[str, TensorSpec], values: Mapping[str, Any]) -> None:
    for port, spec in specs.items():
        if port not in values:
            if spec.required:
                raise ValueError(f"stage {stage!r}: {kind} port {port!r} has no value")
            continue
        if (why := spec.check_value(values[port])) is not None:
            raise ValueError(f"stage {stage!r}: {kind} port {port!r}: {why}")
