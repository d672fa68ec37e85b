"""Config -> Plan: the placement resolved (the one caller of :func:`~mmpipe.sched.plan.parse_placement`),
sequence parallelism and memory policies applied and checked against the model, the schedule built."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from mmpipe.assemble.graphs import sample_inputs
from mmpipe.config import RunConfig, StageParallelConfig
from mmpipe.devices import DeviceType, resolve_device, run_devices
from mmpipe.errors import PlanError
from mmpipe.graph import Graph
from mmpipe.kernels import registry as kernels
from mmpipe.memory.budget import FILE_TIER_BYTES_PER_S, BlockPricing, choose_policies
from mmpipe.memory.policy import repeated_blocks
from mmpipe.models import training_stages
from mmpipe.rundir import PLAN_FILE, VAL_PLAN_FILE
from mmpipe.sched.cluster import Cluster
from mmpipe.sched.cost import build_meta_module, measure_graph_costs
from mmpipe.sched.plan import ActionKind, DeviceGroup, Plan
from mmpipe.sched.results import parse_placement
from mmpipe.sched.schedule import ScheduleKind, build_plan

logger = logging.getLogger(__name__)


def default_placement(graph: Graph, world_size: int) -> dict[str, DeviceGroup]:
    """All stages on rank 0 for one rank; else frozen stages on rank 0, trainable ones data-parallel on the rest."""
    if world_size == 1:
        return {s: DeviceGroup((0,)) for s in graph.stages}
    rest = tuple(range(1, world_size))
    return {s: DeviceGroup((0,)) if st.frozen else DeviceGroup(rest, len(rest)) for s, st in graph.stages.items()}


def check_placement(cfg: RunConfig) -> None:
    """Reject a placement naming unknown stages or ranks outside ``launch.nproc``, or asking for what
    this runtime cannot run yet, before anything is written."""
    names = training_stages(cfg.model)
    for stage, p in cfg.parallel.items():
        if (p.ulysses, p.ring) != (1, 1) and stage not in names:
            raise PlanError(f"parallel.{stage}: no stage {stage!r} in this graph; stages: {list(names)}")
    if not cfg.placement or cfg.placement == "auto":
        return
    assert isinstance(cfg.placement, dict)
    placement = parse_placement(cfg.placement)
    unknown = sorted(set(placement) - set(names))
    missing = sorted(set(names) - set(placement))
    if unknown or missing:
        raise PlanError(f"placement: unknown stages {unknown}, unplaced stages {missing}; stages: {list(names)}")
    for stage, group in placement.items():
        bad = [r for r in group.ranks if not 0 <= r < cfg.launch.nproc]
        if bad:
            raise PlanError(f"placement.{stage}: ranks {bad} outside launch.nproc={cfg.launch.nproc}")
    check_frames(apply_parallel(placement, cfg.parallel), cfg)


def apply_parallel(
    placement: dict[str, DeviceGroup], parallel: dict[str, StageParallelConfig]
) -> dict[str, DeviceGroup]:
    """``placement`` with each stage's ``parallel.<stage>`` sequence parallelism (dp = ranks / sp)."""
    out = dict(placement)
    for stage, p in parallel.items():
        if (p.ulysses, p.ring) == (1, 1):
            continue
        if stage not in placement:
            raise PlanError(f"parallel.{stage}: no stage {stage!r} in this graph; stages: {sorted(placement)}")
        group = placement[stage]
        if group.sp > 1 and (group.ulysses, group.ring) != (p.ulysses, p.ring):
            raise PlanError(
                f"parallel.{stage}: ulysses={p.ulysses} ring={p.ring} contradicts placement.{stage} "
                f"(ulysses={group.ulysses} ring={group.ring})"
            )
        sp = p.ulysses * p.ring
        if len(group.ranks) % sp:
            raise PlanError(
                f"parallel.{stage}: ulysses={p.ulysses} x ring={p.ring} = {sp} does not divide the "
                f"{len(group.ranks)} ranks placed for {stage!r} ({list(group.ranks)})"
            )
        out[stage] = dataclasses.replace(group, dp=len(group.ranks) // sp, ulysses=p.ulysses, ring=p.ring)
    return out


def check_stage_support(graph: Graph, placement: dict[str, DeviceGroup], cfg: RunConfig) -> None:
    """Each stage can take its placement: sequence-parallel degrees (capabilities, head counts, a
    token share on every rank), activation offload, parameters gathered once per step or replicated,
    and the DiT kernels of ``model.kernels``."""
    for stage, group in placement.items():
        if group.gather_once and (graph.stages[stage].frozen or len(group.ranks) == 1):
            raise PlanError(
                f"placement.{stage}.gather_once=true: only a trainable stage sharded (FSDP) over several ranks "
                f"gathers its parameters; {stage!r} is {'frozen' if graph.stages[stage].frozen else 'on one rank'}"
            )
        if group.replicate and (graph.stages[stage].frozen or len(group.ranks) == 1):
            raise PlanError(
                f"placement.{stage}.replicate=true: only a trainable stage over several ranks chooses between "
                f"sharded (FSDP) and replicated (DDP) parameters; {stage!r} is "
                f"{'frozen (its weights are whole on every rank already)' if graph.stages[stage].frozen else 'on one rank'}"
            )
        if group.sp > 1:
            graph.stages[stage].check_sequence_parallel(group.ulysses, group.ring)
        if group.offload and not graph.stages[stage].capabilities.offload:
            raise PlanError(
                f"placement.{stage}: offload={group.offload}, but stage {stage!r} cannot offload activations"
            )
    choice = kernel_choice(cfg)
    for st in graph.stages.values():  # model.kernels: DiT kernels, on the DiTs they are written for
        check_kernels = getattr(st, "check_kernels", None)
        if check_kernels is not None:
            check_kernels(choice)
    check_frames(placement, cfg)


def check_frames(placement: dict[str, DeviceGroup], cfg: RunConfig) -> None:
    """The DiT, split by whole latent frames, has at least one frame per sequence-parallel rank."""
    latent_frames = (cfg.data.frames - 1) // 4 + 1  # the Wan VAE's causal 4x temporal compression
    for stage, group in placement.items():
        if stage == "dit" and latent_frames < group.sp:
            raise PlanError(
                f"parallel.{stage}: data.frames={cfg.data.frames} gives {latent_frames} latent frames, fewer than "
                f"its {group.sp} sequence-parallel ranks (ulysses={group.ulysses} x ring={group.ring}); "
                "every rank needs at least one frame"
            )


def apply_memory(graph: Graph, placement: dict[str, DeviceGroup], plan: Plan, cfg: RunConfig) -> dict[str, DeviceGroup]:
    """``placement`` with each stage's ``memory.<stage>`` policy as recompute / offload fractions."""
    out = dict(placement)
    for stage, m in cfg.memory.items():
        if m.policy == "keep" and m.blocks is None:
            continue
        what = f"memory.{stage}.policy={m.policy}" if m.blocks is None else f"memory.{stage}.blocks"
        if stage not in placement:
            raise PlanError(f"memory.{stage}: no stage {stage!r} in this graph; stages: {sorted(placement)}")
        group = placement[stage]
        if stage not in plan.backward:
            raise PlanError(f"{what}: stage {stage!r} runs no backward, so it saves no activations to manage")
        if group.recompute or group.offload or group.blocks:
            raise PlanError(
                f"{what} contradicts placement.{stage} "
                f"(recompute={group.recompute} offload={group.offload} blocks={group.blocks!r})"
            )
        offloads = m.policy in ("offload", "auto") or "offload" in (m.blocks or [])
        if offloads and not graph.stages[stage].capabilities.offload:
            raise PlanError(f"{what}: stage {stage!r} cannot offload activations")
        if m.blocks is not None or m.policy == "selective":
            n = count_blocks(graph, stage)
            names = m.blocks if m.blocks is not None else ["selective"] * n
            if len(names) != n:
                raise PlanError(
                    f"memory.{stage}.blocks names {len(names)} policies; stage {stage!r} has {n} repeated blocks"
                )
            letters = "".join(name[0] for name in names)  # keep/offload/recompute/selective -> k/o/r/s
            out[stage] = dataclasses.replace(
                group, recompute=letters.count("r") / n, offload=letters.count("o") / n, blocks=letters
            )
            continue
        match m.policy:
            case "recompute":
                recompute, offload = 1.0, 0.0
            case "offload":
                recompute, offload = 0.0, 1.0
            case "auto":
                budget = m.budget_gb if m.budget_gb is not None else device_budget_gb(graph, stage, placement, cfg)
                recompute, offload = auto_memory(graph, stage, group, plan, cfg, budget)
        out[stage] = dataclasses.replace(group, recompute=recompute, offload=offload)
    return out


def count_blocks(graph: Graph, stage: str) -> int:
    """The number of repeated blocks of ``stage``'s module, counted on the meta device (no weights)."""

    blocks = repeated_blocks(build_meta_module(graph.stages[stage], torch.float32))
    if not blocks:
        raise PlanError(f"memory.{stage}: stage {stage!r} has no repeated blocks to give policies to")
    return len(blocks)


DEVICE_RESERVE = 0.15  # of a GPU's memory, kept for workspaces, the allocator's fragmentation, CUDA context


def device_budget_gb(graph: Graph, stage: str, placement: dict[str, DeviceGroup], cfg: RunConfig) -> float:
    """``memory.<stage>.policy=auto`` without ``budget_gb``: the GPU's memory less a reserve and the
    weights of the stages that share the stage's first rank (bf16 frozen, 16 bytes a trained parameter)."""
    devices = run_devices(cfg, local_ranks=0)
    if devices.device is not DeviceType.CUDA:
        raise PlanError(f"memory.{stage}.policy=auto: give memory.{stage}.budget_gb on CPU ranks (GiB per rank)")

    rank = placement[stage].ranks[0]
    others = 0
    for name, group in placement.items():
        if name == stage or rank not in group.ranks:
            continue
        params = sum(p.numel() for p in build_meta_module(graph.stages[name], torch.float32).parameters())
        others += params * (2 if graph.stages[name].frozen else 16) // len(group.ranks)
    total = torch.cuda.get_device_properties(devices.rank_device()).total_memory
    return (total * (1 - DEVICE_RESERVE) - others) / 2**30


def auto_memory(
    graph: Graph, stage: str, group: DeviceGroup, plan: Plan, cfg: RunConfig, budget_gb: float
) -> tuple[float, float]:
    """The budget planner's fractions for ``stage`` on one of its ranks: its cost measured on the meta
    device for this run's shapes, the micro-batches the schedule keeps in flight on that rank, and
    its parameters, gradients and Adam moments (16 bytes a parameter, sharded over the group)."""

    data = cfg.data
    devices = run_devices(cfg, local_ranks=0)
    shapes = sample_inputs(graph, cfg.model.text_len, data.frames, data.height, data.width)
    per_sample = measure_graph_costs(graph, shapes, dtype=devices.precision.dtype)[stage]
    rows = (cfg.train.batch_size // cfg.train.micro_batches) / group.dp / group.sp  # samples' worth per rank
    cuda = devices.device is DeviceType.CUDA
    cluster = Cluster.local_cuda(cfg.launch.nproc) if cuda else Cluster.local(cfg.launch.nproc)
    pricing = BlockPricing.from_cost(
        per_sample,
        rows=rows,
        flops_per_s=cluster.peak_flops * cluster.efficiency,
        # CPU: the file tier, whose reads block the backward; CUDA: pinned host memory over PCIe
        offload_bytes_per_s=cluster.host_bandwidth if cuda else FILE_TIER_BYTES_PER_S,
        pending_blocks=0 if cuda else 1,  # the file tier writes one block at a time
    )
    fixed = 16 * per_sample.params // len(group.ranks) if stage in plan.trainable else 0
    try:
        choice = choose_policies(
            pricing,
            budget_bytes=int(budget_gb * 2**30),
            inflight=inflight_micro_batches(plan, stage),
            fixed_bytes=fixed,
        )
    except ValueError as err:
        raise PlanError(f"memory.{stage}.budget_gb={budget_gb:g}: {err}") from None
    logger.info("memory.%s: %d of %d blocks recomputed, %d offloaded (%.2f GiB a rank)", stage,
                choice.recompute, choice.blocks, choice.offload, choice.resident_bytes / 2**30)  # fmt: skip
    return choice.fractions


def inflight_micro_batches(plan: Plan, stage: str) -> int:
    """The most forwards of ``stage`` whose backward has not run yet, on its first rank's action list."""
    live = peak = 0
    for a in plan.actions[plan.groups[stage].ranks[0]]:
        if a.stage == stage and a.kind in (ActionKind.F, ActionKind.B):
            live += 1 if a.kind == ActionKind.F else -1
            peak = max(peak, live)
    return max(peak, 1)


def make_plans(graph: Graph, cfg: RunConfig) -> tuple[Plan, Plan]:
    """(training plan, forward-only validation plan) of ``graph`` under the configured placement."""
    world = cfg.launch.nproc
    if cfg.placement == "auto":
        raise PlanError(
            "placement=auto must be resolved (mmpipe.assemble.planning.auto_placement) before plans are made"
        )
    if isinstance(cfg.placement, str):  # RunConfig reads a placement FILE at validation
        raise PlanError(f"placement={cfg.placement!r}: expected auto, a mapping or a file")
    placement = parse_placement(cfg.placement) if cfg.placement else default_placement(graph, world)
    placement = apply_parallel(placement, cfg.parallel)
    check_stage_support(graph, placement, cfg)
    check_shared_gpu_groups(cfg, placement)
    kind = ScheduleKind(cfg.train.schedule)
    n_micro = cfg.train.micro_batches
    size = cfg.train.batch_size // n_micro
    train_plan = build_plan(graph, placement, n_micro, world_size=world, schedule=kind, batch=size)
    if any(m.policy != "keep" or m.blocks is not None for m in cfg.memory.values()):  # same actions
        placement = apply_memory(graph, placement, train_plan, cfg)
        train_plan = build_plan(graph, placement, n_micro, world_size=world, schedule=kind, batch=size)
    val_plan = build_plan(graph, placement, n_micro, world_size=world, schedule=kind, train=False, batch=size)
    return train_plan, val_plan


def check_shared_gpu_groups(cfg: RunConfig, placement: dict[str, DeviceGroup]) -> None:
    """Ranks sharing GPUs (gloo on CUDA) exchange edge tensors through the host; the collectives of
    FSDP2 and sequence parallelism on CUDA tensors need NCCL, one GPU per rank. (Decided from the
    config alone, so that a GPU run's plan can be rebuilt on a machine without one.)"""
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if not (cuda and cfg.launch.backend == "gloo"):
        return
    for stage, group in placement.items():
        if len(group.ranks) > 1:
            raise PlanError(
                f"placement.{stage}: {len(group.ranks)} ranks (dp={group.dp}, ulysses={group.ulysses}, "
                f"ring={group.ring}) with device=cuda launch.backend=gloo: data and sequence parallelism on CUDA "
                "need launch.backend=nccl (one GPU per rank); gloo on CUDA runs pipelined placements, one rank a stage"
            )


def kernel_choice(cfg: RunConfig) -> kernels.KernelChoice:
    """``model.kernels`` resolved for the run's device (``auto``: Triton on CUDA; on CPU Triton runs interpreted)."""
    device = resolve_device(cfg.device)
    return kernels.resolve(kernels.KernelChoice(**dataclasses.asdict(cfg.model.kernels)), device.value)


def write_plans(run_dir: Path, train_plan: Plan, val_plan: Plan) -> None:
    """Write a run's plans (``plan.txt``, ``plan-val.txt``): what its workers run and its report reads."""
    (run_dir / PLAN_FILE).write_text(train_plan.to_text())
    (run_dir / VAL_PLAN_FILE).write_text(val_plan.to_text())


def read_plans(run_dir: Path) -> tuple[Plan, Plan]:
    """(training plan, validation plan) as the run wrote them; ``ValueError`` naming a missing file."""
    plans = []
    for name in (PLAN_FILE, VAL_PLAN_FILE):
        path = run_dir / name
        if not path.is_file():
            raise ValueError(f"{str(run_dir)!r} has no {name} (written when the run was prepared)")
        plans.append(Plan.from_text(path.read_text()))
    return plans[0], plans[1]
