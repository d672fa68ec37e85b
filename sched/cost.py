"""Per-stage cost for given input shapes, counted on the meta device: FLOPs, bytes, memory.

Every stage of a graph is instantiated from its config under ``torch.device("meta")`` (no memory,
no weights) and run on meta inputs of one sample, in topological order, so each stage sees the
shapes its producers really emit. Under ``torch.utils.flop_counter.FlopCounterMode`` the forward
(and, for stages on the backward path, a backward from a unit gradient) is counted, and
``torch.autograd.graph.saved_tensors_hooks`` measure the activation bytes autograd keeps for the
backward, attributed to the repeated blocks (transformer layers) they belong to. A 14B-parameter
DiT at 720p costs a couple of seconds and no memory.

Two conventions make meta execution stand for a real training run:
- attention runs as the fused flash kernel (``aten._scaled_dot_product_flash_attention``): same
  FLOPs as the math decomposition, but the activation bytes of a kernel that does not keep the
  ``S x S`` probabilities. Masks are dropped (padding masks do not change dense FLOPs; real
  trainers use variable-length kernels);
- data-dependent scalars (``tensor.item()``, ``if mask.all():``) read as 1 / true, i.e. an
  unpadded sequence: the most expensive case.

Costs are per sample; a stage's FLOPs and activations scale linearly with its batch.
Results are cached in memory and on disk (``$MMPIPE_CACHE``, default ``~/.cache/mmpipe``) keyed by
the stage's class, config and shapes and the library versions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import diffusers
import torch
import torch.nn.functional as F
import transformers
from diffusers.utils import logging as dlogging
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModel, PretrainedConfig

from mmpipe.graph import Graph, Stage
from mmpipe.memory.policy import repeated_blocks
from mmpipe.sched.schedule import backward_stages

ShapeDtype = tuple[tuple[int, ...], torch.dtype]
_ATTENTION_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention")


@dataclasses.dataclass(frozen=True)
class StageCost:
    """What one sample costs a stage. ``block_*`` describe its repeated blocks (transformer layers):
    recomputing them keeps only their inputs; sequence parallelism splits their ``tokens``."""

    forward_flops: float
    backward_flops: float  # 0 for stages off the backward path
    attention_flops: float  # the part of forward_flops inside attention kernels
    params: int
    output_bytes: int  # what the stage sends to its consumers (bf16 activations as measured)
    activation_bytes: int  # saved for the backward, keeping everything
    block_flops: float  # forward FLOPs inside the repeated blocks
    block_activation_bytes: int  # the part of activation_bytes saved inside the blocks
    block_input_bytes: int  # the blocks' inputs: what recomputing every block keeps
    blocks: int
    tokens: int  # sequence length the blocks run on (0: no blocks)
    hidden: int
    heads: int
    split_units: int = 0  # what sequence parallelism splits whole (e.g. latent frames); 0: tokens

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def build_meta_module(stage: Stage, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """The stage's module with meta tensors, built from its config (diffusers, transformers or a
    stage-provided ``build_from_config``)."""
    source = getattr(stage, "source", None)
    model_cls = getattr(stage, "model_cls", None)
    builder = getattr(stage, "build_from_config", None)
    if builder is None and (source is None or model_cls is None):
        raise ValueError(f"stage {stage.name!r} ({type(stage).__name__}) has no config-built module to cost")
    with torch.device("meta"), _quiet():
        if builder is not None:
            module = builder()
        else:
            assert source is not None and model_cls is not None
            module = _from_config(model_cls, source.config)
    with _quiet():
        return module.to(dtype)


def _from_config(model_cls: Any, config: Any) -> nn.Module:
    if isinstance(config, PretrainedConfig):
        return AutoModel.from_config(config) if model_cls is AutoModel else model_cls(config)
    return model_cls.from_config(dict(config))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence diffusers' "should be kept in float32" notes: the cost model never runs numerics."""

    level = dlogging.get_verbosity()
    dlogging.set_verbosity_error()
    try:
        yield
    finally:
        dlogging.set_verbosity(level)


def measure_stage_cost(
    stage: Stage,
    inputs: Mapping[str, ShapeDtype],
    *,
    backward: bool | None = None,
    dtype: torch.dtype = torch.bfloat16,
    **options: Any,
) -> StageCost:
    """Cost of ``stage`` on inputs of the given ``(shape, dtype)`` (batch = the shapes' first dim),
    its module's parameters in ``dtype``."""
    cost, _ = _measure(stage, {k: _meta_tensor(s, d) for k, (s, d) in inputs.items()}, backward, options, dtype)
    return cost


def measure_graph_costs(
    graph: Graph,
    inputs: Mapping[str, ShapeDtype],
    *,
    backward: frozenset[str] | None = None,
    cache: bool = True,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, StageCost]:
    """Per-sample cost of every stage of ``graph``, given the graph inputs' per-sample shapes
    (``{"video": ((1, 3, 81, 720, 1280), torch.float32), ...}``; batch 1).

    ``backward``: the stages that run a backward (default: trainable stages and their consumers).
    """

    backward = backward_stages(graph) if backward is None else backward
    unknown = sorted(set(inputs) - set(graph.input_specs))
    if unknown:
        raise ValueError(f"unknown graph inputs {unknown}; the graph's inputs are {sorted(graph.input_specs)}")
    values: dict[str, dict[str, torch.Tensor]] = {"input": {k: _meta_tensor(s, d) for k, (s, d) in inputs.items()}}
    costs: dict[str, StageCost] = {}
    for name in graph.topological_order():
        stage = graph.stages[name]
        feed = {}
        for e in graph.producers(name):
            if e.src_port in values.get(e.src, {}):
                feed[e.dst_port] = values[e.src][e.src_port]
            elif stage.inputs[e.dst_port].required:
                raise ValueError(f"cannot cost stage {name!r}: input {e.dst_port!r} needs {e}, which is not given")
        key = _cache_key(stage, feed, name in backward, dtype) if cache else None
        hit = _cache_get(key) if key else None
        if hit is not None:
            costs[name], shapes = hit
            values[name] = {k: _meta_tensor(s, d) for k, (s, d) in shapes.items()}
            continue
        costs[name], out = _measure(stage, feed, name in backward, {"seed": 0}, dtype)
        values[name] = out
        if key:
            _cache_put(key, costs[name], {k: (tuple(v.shape), v.dtype) for k, v in out.items()})
    return costs


def measure_decode_cost(
    vae: Stage, video: ShapeDtype, *, cache: bool = True, dtype: torch.dtype = torch.bfloat16
) -> tuple[StageCost, tuple[int, ...]]:
    """What decoding one sample costs ``vae``'s module: the FLOPs of ``decode`` of the latents it
    encodes a video of ``video``'s ``(shape, dtype)`` into, and those latents' raw shape
    ``(1, Z, t, h, w)``. The serving planner's decode stage (a training graph only encodes)."""
    feed = {"video": _meta_tensor(*video)}
    key = _cache_key(vae, feed, False, dtype, what="decode") if cache else None
    hit = _cache_get(key) if key else None
    if hit is not None:
        return hit[0], hit[1]["latents"][0]
    module: Any = build_meta_module(vae, dtype)  # diffusers' AutoencoderKL* (encode/decode are not nn.Module API)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), _MetaScalars(), _FlashAttention():
        z = module.encode(feed["video"].to(dtype)).latent_dist.mode()
        with counter:
            out = module.decode(z, return_dict=False)[0]
    attention = sum(
        v for k, v in counter.get_flop_counts()["Global"].items() if str(k).split(".")[-1] in _ATTENTION_OPS
    )
    cost = StageCost(
        forward_flops=float(counter.get_total_flops()),
        backward_flops=0.0,
        attention_flops=float(attention),
        params=sum(p.numel() for p in module.parameters()),
        output_bytes=_nbytes(out),
        activation_bytes=0,
        block_flops=0.0,
        block_activation_bytes=0,
        block_input_bytes=0,
        blocks=0,
        tokens=0,
        hidden=0,
        heads=0,
    )
    if key:
        _cache_put(key, cost, {"latents": (tuple(z.shape), z.dtype), "video": (tuple(out.shape), out.dtype)})
    return cost, tuple(z.shape)


def _measure(
    stage: Stage,
    inputs: dict[str, torch.Tensor],
    backward: bool | None,
    options: Mapping[str, Any],
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[StageCost, dict[str, torch.Tensor]]:
    backward = (not stage.frozen) if backward is None else backward
    module = build_meta_module(stage, dtype)
    if stage.frozen:
        module.requires_grad_(False)
    params = {id(p) for p in module.parameters()}
    blocks = repeated_blocks(module)
    tracker = _BlockTracker(blocks, params)
    counter = FlopCounterMode(display=False)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_MetaScalars())
        stack.enter_context(_FlashAttention())
        stack.enter_context(counter)
        stack.enter_context(tracker.hooks(counter))
        stack.enter_context(torch.set_grad_enabled(backward))
        out = stage.forward(module, inputs, **options)
        forward = counter.get_total_flops()
        attention = sum(
            v for k, v in counter.get_flop_counts()["Global"].items() if str(k).split(".")[-1] in _ATTENTION_OPS
        )
        tensors = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
        needs = [t for t in tensors.values() if t.requires_grad]
        if backward and needs:
            tracker.recording = False
            torch.autograd.backward(needs, [torch.ones_like(t) for t in needs])
    cfg = getattr(getattr(stage, "source", None), "config", None)
    cost = StageCost(
        forward_flops=float(forward),
        backward_flops=float(counter.get_total_flops() - forward),
        attention_flops=float(attention),
        params=sum(p.numel() for p in module.parameters()),
        output_bytes=sum(_nbytes(t) for t in tensors.values()),
        activation_bytes=tracker.saved_total,
        block_flops=float(tracker.block_flops),
        block_activation_bytes=tracker.saved_in_blocks,
        block_input_bytes=tracker.block_input_bytes,
        blocks=len(blocks),
        tokens=tracker.tokens,
        hidden=tracker.hidden,
        heads=_heads(cfg),
        split_units=_split_units(stage, inputs),
    )
    return cost, {k: v.detach() for k, v in tensors.items()}


class _BlockTracker:
    """Saved-tensor bytes (in and out of blocks), block FLOPs and block input bytes of one forward."""

    def __init__(self, blocks: list[nn.Module], params: set[int]) -> None:
        self.blocks, self.params = blocks, params
        self.seen: set[int] = set()
        self.depth = 0
        self.recording = True
        self.saved_total = self.saved_in_blocks = self.block_input_bytes = 0
        self.block_flops = 0
        self.tokens = self.hidden = 0

    @contextlib.contextmanager
    def hooks(self, counter: FlopCounterMode) -> Iterator[None]:
        start: list[int] = []

        def pre(_: nn.Module, args: tuple, kwargs: dict) -> None:
            if self.recording and self.depth == 0:
                tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
                self.block_input_bytes += sum(_nbytes(t) for t in tensors if t.is_floating_point())
                # The longest sequence any block runs on (not, e.g., a text refiner's).
                if tensors and tensors[0].dim() == 3 and tensors[0].shape[1] > self.tokens:
                    self.tokens, self.hidden = int(tensors[0].shape[1]), int(tensors[0].shape[2])
                start.append(counter.get_total_flops())
            self.depth += 1

        def post(*_: Any) -> None:
            self.depth -= 1
            if self.recording and self.depth == 0 and start:
                self.block_flops += counter.get_total_flops() - start.pop()

        def pack(t: torch.Tensor) -> torch.Tensor:
            base = t._base if t._base is not None else t
            if self.recording and id(base) not in self.params and id(base) not in self.seen:
                self.seen.add(id(base))
                self.saved_total += _nbytes(base)
                if self.depth:
                    self.saved_in_blocks += _nbytes(base)
            return t

        handles = [b.register_forward_pre_hook(pre, with_kwargs=True) for b in self.blocks]
        handles += [b.register_forward_hook(post) for b in self.blocks]
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
        finally:
            for h in handles:
                h.remove()


class _MetaScalars(TorchDispatchMode):
    """Data-dependent scalars of meta tensors read as 1 (true): an unpadded, unmasked sample."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            dtype = args[0].dtype
            return True if dtype == torch.bool else (1.0 if dtype.is_floating_point else 1)
        return func(*args, **(kwargs or {}))


class _FlashAttention(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` as the fused flash kernel (see the module docstring)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        a = dict(zip(names, args, strict=False)) | kwargs
        q, k, v = a["query"], a["key"], a["value"]
        if k.shape[-3] != q.shape[-3]:  # grouped-query attention: expand key/value heads
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        causal = bool(a.get("is_causal", False))
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=a.get("scale"))[0]


def _split_units(stage: Stage, feed: Mapping[str, torch.Tensor]) -> int:
    """The size of the first input a sequence-parallel stage splits (its frames, for a DiT)."""
    for port, dim in stage.sequence_inputs.items():
        if port in feed:
            return int(feed[port].shape[dim])
    return 0


def _heads(cfg: Any) -> int:
    if cfg is None:
        return 0
    get = cfg.get if isinstance(cfg, Mapping) else lambda k, d=None: getattr(cfg, k, d)
    for key in ("num_attention_heads", "num_heads", "n_head"):
        value = get(key, None)
        if isinstance(value, int):
            return value
    return 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _meta_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.empty(shape, dtype=dtype, device="meta")
    return torch.ones(shape, dtype=dtype, device="meta")


# -- cache -------------------------------------------------------------------------------------


_MEMORY_CACHE: dict[str, tuple[StageCost, dict[str, ShapeDtype]]] = {}


def _cache_dir() -> Path:
    return Path(os.environ.get("MMPIPE_CACHE", Path.home() / ".cache" / "mmpipe")) / "costs"


def _cache_key(
    stage: Stage, feed: Mapping[str, torch.Tensor], backward: bool, dtype: torch.dtype, *, what: str = ""
) -> str | None:
    """``what``: a measurement other than the stage's forward (``"decode"``), keyed apart."""
    cfg = getattr(getattr(stage, "source", None), "config", None)
    if cfg is None:
        return None
    cfg_dict = cfg.to_dict() if isinstance(cfg, PretrainedConfig) else dict(cfg) if isinstance(cfg, Mapping) else None
    if cfg_dict is None:
        cfg_dict = dict(vars(cfg))
    blob = json.dumps(
        {
            "v": 2,
            "cls": type(stage).__qualname__,
            "stage": {k: v for k, v in vars(stage).items() if isinstance(v, int | float | str | bool)},
            "config": cfg_dict,
            "inputs": {k: [list(t.shape), str(t.dtype)] for k, t in sorted(feed.items())},
            "backward": backward,
            "dtype": str(dtype),
            "versions": [torch.__version__, diffusers.__version__, transformers.__version__],
        }
        | ({"what": what} if what else {}),
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _cache_get(key: str) -> tuple[StageCost, dict[str, ShapeDtype]] | None:
    if key in _MEMORY_CACHE:
        return _MEMORY_CACHE[key]
    path = _cache_dir() / f"{key}.json"
    try:
        raw = json.loads(path.read_text())
        hit = (
            StageCost(**raw["cost"]),
            {k: (tuple(s), getattr(torch, d.removeprefix("torch."))) for k, (s, d) in raw["outputs"].items()},
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    _MEMORY_CACHE[key] = hit
    return hit


def _cache_put(key: str, cost: StageCost, outputs: dict[str, ShapeDtype]) -> None:
    _MEMORY_CACHE[key] = (cost, outputs)
    path = _cache_dir() / f"{key}.json"
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        raw = {"cost": cost.to_json(), "outputs": {k: [list(s), str(d)] for k, (s, d) in outputs.items()}}
        tmp.write_text(json.dumps(raw))
        tmp.replace(path)
