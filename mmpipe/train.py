"""``mmpipe train``: a training graph (text-to-video, or understand-then-generate) on local ranks.

Every micro-batch's inputs (which samples, which noise, which timestep) are a pure function of
``(train.seed, step, micro-batch)``, never of a running RNG, so a resumed run and an uninterrupted
run produce bitwise-identical loss trajectories, and the distributed runtime can reproduce the
single-process run exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from torch.utils.data import Subset
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from mmpipe.checkpoint import latest_checkpoint, load_checkpoint, remove_stale, save_checkpoint
from mmpipe.config import DataConfig, ModelConfig, RunConfig, StageParallelConfig, from_dict, to_dict
from mmpipe.data import FolderVideoDataset, MovingShapesDataset, caption_vocabulary
from mmpipe.devices import Backend, DeviceType, Precision, rank_device, resolve_backend, resolve_device
from mmpipe.errors import loading_errors
from mmpipe.graph import Graph
from mmpipe.kernels import registry as kernels
from mmpipe.pipelines import (
    T2V_TRAIN_STAGES,
    U2G_TRAIN_STAGES,
    build_t2v_training_graph,
    build_u2g_training_graph,
    check_pipeline_dir,
)
from mmpipe.presets import VISION_IMAGE_SIZE, save_tiny_u2g_pipeline, save_tiny_wan_pipeline
from mmpipe.report.recording import RankRecording, write_chrome_trace
from mmpipe.runtime.events import EventRecorder
from mmpipe.runtime.executor import Executor, NonFiniteError, OptionsFn, StageOptim
from mmpipe.runtime.mesh import MeshOwner
from mmpipe.sched.plan import ActionKind, DeviceGroup, Plan, PlanError, parse_placement
from mmpipe.sched.schedule import ScheduleKind, build_plan
from mmpipe.stages.text import tokenize

logger = logging.getLogger(__name__)

SizedDataset = MovingShapesDataset | FolderVideoDataset | Subset

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"


# ---- run directory -------------------------------------------------------------------------------
def resolve_run_dir(cfg: RunConfig) -> Path:
    """The run directory: ``cfg.run_dir`` or ``runs/<model>-<timestamp>``; checked against ``resume``."""
    if cfg.run_dir is None:
        if cfg.train.resume:
            raise ValueError("train.resume=true needs run_dir=<the run to continue>")
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        return Path("runs") / f"{cfg.model.name}-{stamp}"
    run_dir = Path(cfg.run_dir)
    if cfg.train.resume and latest_checkpoint(run_dir) is None:
        raise ValueError(f"train.resume=true but run_dir={str(run_dir)!r} has no checkpoint")
    if not cfg.train.resume and latest_checkpoint(run_dir) is not None:
        raise ValueError(f"run_dir={str(run_dir)!r} already has checkpoints: pass train.resume=true or a new run_dir")
    return run_dir


def load_run_config(run_dir: Path) -> RunConfig:
    """The config a run was trained with (``RUN_DIR/config.yaml``)."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{str(run_dir)!r} is not an mmpipe run directory (no {CONFIG_FILE})")
    return from_dict(RunConfig, yaml.safe_load(path.read_text()))


def check_resume_compatible(old: RunConfig, new: RunConfig) -> None:
    """A resumed run may change steps / logging, not the model or the data."""
    for section in ("model", "data"):
        if getattr(old, section) != getattr(new, section):
            raise ValueError(f"train.resume=true: {section} config differs from the checkpointed run's")


def pipeline_dir(model: ModelConfig, run_dir: Path) -> Path:
    """The model's WanPipeline-layout directory: ``model.path``, or the run's tiny preset."""
    return Path(model.path) if model.path is not None else run_dir / "pipeline"


# ---- data ----------------------------------------------------------------------------------------
def build_datasets(data: DataConfig) -> tuple[SizedDataset, SizedDataset]:
    """(train, validation) datasets; moving shapes validation clips come from a different seed."""
    size = {"frames": data.frames, "height": data.height, "width": data.width}
    if data.root is None:
        train = MovingShapesDataset(num_samples=data.num_samples, seed=data.seed, **size)
        val = MovingShapesDataset(num_samples=data.val_samples, seed=data.seed + 7919, **size)
        return train, val
    folder = FolderVideoDataset(root=data.root, captions_file=data.captions_file, **size)
    return folder, Subset(folder, range(min(data.val_samples, len(folder))))


def vocabulary(train_set: SizedDataset) -> list[str]:
    """Texts whose words the tiny preset's tokenizer must know: every caption of the data."""
    if isinstance(train_set, FolderVideoDataset):
        return [entry.caption for entry in train_set.entries]
    return caption_vocabulary()


def sample_indices(step: int, batch_size: int, n: int, seed: int) -> list[int]:
    """The dataset indices of ``step``: epoch-wise permutations seeded by (seed, epoch)."""
    out = []
    for g in range(step * batch_size, (step + 1) * batch_size):
        epoch, pos = divmod(g, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        out.append(int(perm[pos]))
    return out


def training_stages(model: ModelConfig) -> tuple[str, ...]:
    """The stage names of the model's training graph (placements must name exactly these)."""
    return U2G_TRAIN_STAGES if model.kind == "u2g" else T2V_TRAIN_STAGES


def build_training_graph(model: ModelConfig, pipe_dir: Path) -> Graph:
    """The training graph of ``model.kind`` over a pipeline directory."""
    build = build_u2g_training_graph if model.kind == "u2g" else build_t2v_training_graph
    return build(pipe_dir, text_len=model.text_len)


class Collator:
    """Samples -> the graph inputs of a micro-batch: tokens, videos and (u2g) the conditioning image."""

    def __init__(self, graph: Graph, pipe_dir: Path, text_len: int) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(pipe_dir / "tokenizer")
        self.clean = prompt_clean if "text" in graph.stages else None
        self.text_len = text_len
        self.image = "pixel_values" in graph.input_specs

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        tokens = tokenize(self.tokenizer, [s["caption"] for s in samples], max_length=self.text_len, clean=self.clean)
        video_B3THW = torch.stack([s["video"] for s in samples])
        out = {**tokens, "video": video_B3THW}
        if self.image:  # the first frame, at the vision tower's resolution
            size = (VISION_IMAGE_SIZE, VISION_IMAGE_SIZE)
            out["pixel_values"] = F.interpolate(video_B3THW[:, :, 0], size=size, mode="bilinear", antialias=True)
        return out


def micro_batches(
    dataset: SizedDataset, indices: list[int], n_micro: int, collate: Collator
) -> Iterator[dict[str, torch.Tensor]]:
    """Split ``indices`` into ``n_micro`` equal micro-batches of graph inputs."""
    size = len(indices) // n_micro
    for m in range(n_micro):
        yield collate([dataset[i] for i in indices[m * size : (m + 1) * size]])


def micro_batch_seed(seed: int, step: int, micro: int) -> int:
    """The noise / timestep seed of one micro-batch (``step=-1`` is the validation set)."""
    return (seed * 1_000_003 + step + 1) * 1024 + micro


# ---- plan ----------------------------------------------------------------------------------------
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


def auto_placement(graph: Graph, cfg: RunConfig) -> dict[str, Any]:
    """The planner's placement of ``graph`` on ``launch.nproc`` local CPU ranks (config form)."""
    from mmpipe.planning import default_calibration_path, plan
    from mmpipe.sched.cluster import Cluster
    from mmpipe.workloads import sample_inputs

    data = cfg.data
    path = default_calibration_path()
    report = plan(
        graph,
        Cluster.local(cfg.launch.nproc),
        inputs=sample_inputs(graph, cfg.model.text_len, data.frames, data.height, data.width),
        global_batch=cfg.train.batch_size,
        micro_batches=cfg.train.micro_batches,
        calibration=path if path.is_file() else None,
        name=cfg.model.name,
    )
    logger.info("placement=auto (%s):\n%s", "calibrated" if path.is_file() else "uncalibrated", report.format())
    placement: dict[str, Any] = {}
    for s, g in report.best.candidate.placement().items():
        placement[s] = {"ranks": list(g.ranks), "dp": g.dp, "ulysses": g.ulysses, "ring": g.ring}
        # the memory policy the layout needs to fit (recomputed / file-tier offloaded blocks)
        placement[s].update({k: v for k, v in (("recompute", g.recompute), ("offload", g.offload)) if v})
    return placement


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
    token share on every rank), activation offload, and parameters gathered once per step."""
    for stage, group in placement.items():
        if group.gather_once and (graph.stages[stage].frozen or len(group.ranks) == 1):
            raise PlanError(
                f"placement.{stage}.gather_once=true: only a trainable stage sharded (FSDP) over several ranks "
                f"gathers its parameters; {stage!r} is {'frozen' if graph.stages[stage].frozen else 'on one rank'}"
            )
        if group.sp > 1:
            graph.stages[stage].check_sequence_parallel(group.ulysses, group.ring)
        if group.offload and not graph.stages[stage].capabilities.offload:
            raise PlanError(
                f"placement.{stage}: offload={group.offload}, but stage {stage!r} cannot offload activations"
            )
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
    from mmpipe.sched.cost import build_meta_module, repeated_blocks

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
    from mmpipe.sched.cost import build_meta_module

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
    from mmpipe.memory.budget import FILE_TIER_BYTES_PER_S, BlockPricing, choose_policies
    from mmpipe.sched.cluster import Cluster
    from mmpipe.sched.cost import measure_graph_costs
    from mmpipe.workloads import sample_inputs

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
        raise PlanError("placement=auto must be resolved (mmpipe.train.auto_placement) before plans are made")
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


# ---- devices -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RunDevices:
    """Where a run's ranks compute, how their tensors move, and in which precision."""

    device: DeviceType
    backend: Backend
    precision: Precision

    def rank_device(self) -> torch.device:
        """This process's device: ``cuda:LOCAL_RANK`` (torchrun and the local launcher set it)."""
        return rank_device(self.device, int(os.environ.get("LOCAL_RANK", "0")))

    def wire(self) -> torch.device | None:
        """Where edge payloads travel: the GPU under NCCL, the host under gloo (None: CPU ranks)."""
        if self.device is DeviceType.CPU:
            return None
        return torch.device("cpu") if self.backend.staged else self.rank_device()


def run_devices(cfg: RunConfig, *, local_ranks: int | None = None) -> RunDevices:
    """``device``, ``launch.backend`` and ``train.precision`` resolved for this machine; a CUDA
    request without a GPU, or more NCCL ranks than GPUs, is a ``ValueError`` naming the key."""
    device = resolve_device(cfg.device)
    nproc = cfg.launch.nproc if local_ranks is None else local_ranks
    backend = resolve_backend(device, cfg.launch.backend, local_ranks=nproc)
    precision = Precision.BF16 if device is DeviceType.CUDA else Precision.FP32
    if cfg.train.precision != "auto":
        precision = Precision(cfg.train.precision)
    return RunDevices(device, backend, precision)


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


# ---- the loop ------------------------------------------------------------------------------------
@dataclasses.dataclass
class TrainResult:
    """What a finished ``train`` call returns."""

    run_dir: Path
    steps: int
    first_val_loss: float | None
    last_val_loss: float


def prepare_run(cfg: RunConfig) -> tuple[Path, Graph, RunConfig]:
    """Check everything the config and the model's config decide (run directory, placement, head,
    block and frame counts, memory policies), then write the run directory: its config and, for the
    tiny preset, its random-weight pipeline. Returns the run directory, the graph over it and the
    config with ``placement=auto`` resolved. A refused config leaves nothing behind; before any
    worker starts."""
    run_dir = resolve_run_dir(cfg)
    if cfg.train.resume:
        check_resume_compatible(load_run_config(run_dir), cfg)
    with _staged_pipeline(cfg, run_dir) as staged:
        with loading_errors(f"model.path={cfg.model.path!r}") if cfg.model.path else contextlib.nullcontext():
            graph = build_training_graph(cfg.model, staged)
        if cfg.placement == "auto":
            cfg = dataclasses.replace(cfg, placement=auto_placement(graph, cfg))
        make_plans(graph, cfg)  # the checks that need the model's config
        run_dir.mkdir(parents=True, exist_ok=True)
        remove_stale(run_dir)  # what a save killed in an earlier attempt left
        (run_dir / CONFIG_FILE).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        pipe_dir = pipeline_dir(cfg.model, run_dir)
        if staged != pipe_dir:  # the tiny preset, built in a temporary folder: now the run's
            shutil.move(staged, pipe_dir)
    return run_dir, build_training_graph(cfg.model, pipe_dir), cfg


@contextlib.contextmanager
def _staged_pipeline(cfg: RunConfig, run_dir: Path) -> Iterator[Path]:
    """The pipeline directory to check the config against: ``model.path``, the run's own (resumed),
    or the tiny preset saved into a temporary folder that is removed unless it was moved."""
    existing = pipeline_dir(cfg.model, run_dir)
    if cfg.model.path is not None or (existing / "model_index.json").is_file():
        yield existing
        return
    train_set, _ = build_datasets(cfg.data)
    with tempfile.TemporaryDirectory(prefix="mmpipe-pipeline-") as tmp:
        save = save_tiny_u2g_pipeline if cfg.model.kind == "u2g" else save_tiny_wan_pipeline
        yield save(cfg.model, vocabulary(train_set), Path(tmp) / "pipeline", seed=cfg.train.seed)


def train(cfg: RunConfig) -> TrainResult:
    """Train the trainable stages of the text-to-video graph on ``launch.nproc`` local ranks."""
    if cfg.model.arch is not None and cfg.model.path is None:
        raise ValueError(
            f"model {cfg.model.name!r} is an architecture-only preset (no weights): plan it with "
            f"`mmpipe plan model={cfg.model.name}`, or train local weights with model.path=DIR"
        )
    if cfg.model.path is not None:  # refused before a run directory is written
        check_pipeline_dir(cfg.model.path, key="model.path")
    devices = run_devices(cfg)  # no GPU for device=cuda, or too few for NCCL: refused before anything is written
    check_placement(cfg)
    choice = kernel_choice(cfg)  # an unavailable kernel is an error before anything is written
    if "triton" in dataclasses.astuple(choice) and devices.device is DeviceType.CPU:
        logger.warning("model.kernels: the Triton kernels run in Triton's CPU interpreter here (tests only: very slow)")
    run_dir, graph, cfg = prepare_run(cfg)
    train_plan, _ = make_plans(graph, cfg)
    cfg = dataclasses.replace(cfg, run_dir=str(run_dir))
    if cfg.launch.nproc == 1:
        result = run_rank(cfg, graph, rank=0, world_size=1)
        write_chrome_trace(run_dir)
        return result
    from mmpipe.runtime.launch import launch_local

    print(train_plan.format_table())
    launch_local(cfg)
    write_chrome_trace(run_dir)
    records = read_metrics(run_dir)
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    first = records[0]["val_loss"] if records and records[0]["step"] == 0 else None
    return TrainResult(run_dir=run_dir, steps=cfg.train.steps, first_val_loss=first, last_val_loss=vals[-1])


class TrainLoop:
    """One rank's training loop state: executor, optimizers, data, logging (:func:`start_rank` makes it)."""

    def __init__(self, cfg: RunConfig, graph: Graph, rank: int, world_size: int) -> None:
        assert cfg.run_dir is not None
        self.cfg, self.graph, self.rank = cfg, graph, rank
        self.run_dir = Path(cfg.run_dir)
        self.train_plan, self.val_plan = make_plans(graph, cfg)
        devices = run_devices(cfg, local_ranks=0)  # checked against the GPUs before launch
        self.mesh = MeshOwner(self.train_plan, rank, world_size, device_type=devices.device.value)
        self.micro_size = cfg.train.batch_size // cfg.train.micro_batches
        self.events = EventRecorder(self.run_dir, rank, devices.rank_device())
        self.executor = Executor(
            graph,
            self.train_plan,
            self.mesh,
            batch_size=self.micro_size,
            events=self.events,
            spill_dir=self.run_dir / "spill",
            device=devices.rank_device(),
            precision=devices.precision,
            wire=devices.wire(),
            compile_blocks=cfg.model.compile,
        )
        self.executor.optimizers = {s: self._optim(s) for s in self.executor.local if s in self.train_plan.trainable}
        for s in self.executor.optimizers:
            self.executor.modules[s].train()
        self.train_set, val_set = build_datasets(cfg.data)
        self.collate = Collator(graph, pipeline_dir(cfg.model, self.run_dir), cfg.model.text_len)
        n_val = len(val_set) // self.micro_size * self.micro_size
        val_mbs = list(micro_batches(val_set, list(range(n_val)), n_val // self.micro_size, self.collate))
        self.val_batches = val_mbs
        self.trainable = sorted(self.train_plan.trainable)
        self.skipped_in_a_row = self.skipped_total = 0

    def _optim(self, stage: str) -> StageOptim:
        tc = self.cfg.train
        params = [p for p in self.executor.modules[stage].parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (tc.warmup_steps + 1)))
        return StageOptim(opt, sched, tc.grad_clip, skip_nonfinite=tc.nonfinite == "skip")

    def options(self, step: int) -> OptionsFn:
        seed = self.cfg.train.seed
        return lambda stage, mb, rows: {"seed": micro_batch_seed(seed, step, mb), "rows": rows}

    def batch_fn(self, step: int) -> Callable[[int], dict[str, torch.Tensor]]:
        tc = self.cfg.train
        indices = sample_indices(step, tc.batch_size, len(self.train_set), self.cfg.data.seed)
        size = self.micro_size
        return lambda mb: self.collate([self.train_set[i] for i in indices[mb * size : (mb + 1) * size]])

    def reduce(self, local: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Sum a metrics vector over ranks (each value is owned by one rank, the others add 0)."""
        if self.mesh.distributed:
            dist.all_reduce(local, group=group)
        return local

    @property
    def lead(self) -> bool:
        """The rank that logs: the first rank holding a trainable stage."""
        return self.rank == self.mesh.metrics_ranks[0]

    def train_step(self, step: int) -> dict[str, Any] | None:
        """One optimizer step of this rank's actions; the metrics record on ranks that report them."""
        self.events.step, self.events.phase = step + 1, "train"
        reporting = self.rank in self.mesh.metrics_ranks
        actions = self.train_plan.actions[self.rank]
        out = self.executor.run(actions, self.batch_fn(step), self.options(step), flush=reporting, step=step)
        if not reporting:
            return None
        group = self.mesh.metrics_group
        owned = [self._owns_norm(s) for s in self.trainable]
        norms = [out["grad_norm"].get(s, 0.0) if own else 0.0 for s, own in zip(self.trainable, owned, strict=True)]
        lrs = [
            self.executor.optimizers[s].lr_scheduler.get_last_lr()[0] if own else 0.0
            for s, own in zip(self.trainable, owned, strict=True)
        ]
        spilled = float(self.executor.spill.stats.offloaded_bytes) if self.executor.spill is not None else 0.0
        skipped = float(len(out["skipped"]))
        vec = self.reduce(torch.tensor([spilled, skipped, *norms, *lrs], dtype=torch.float64), group)
        loss = self.reduce(out["loss"].reshape(1).cpu(), group)  # float32, summed exactly as a single rank would
        record: dict[str, Any] = {"step": step + 1, "loss": loss.item()}
        if vec[0] > 0:  # activations offloaded so far (all ranks), by the file tier
            record["offloaded_bytes"] = int(vec[0])
        self._count_skipped(step, int(vec[1]), record)
        k = len(self.trainable)
        for s, norm, lr in zip(self.trainable, vec[2 : 2 + k].tolist(), vec[2 + k :].tolist(), strict=True):
            suffix = "" if k == 1 else f"/{s}"
            record[f"grad_norm{suffix}"], record[f"lr{suffix}"] = norm, lr
        return record

    def _count_skipped(self, step: int, skipped: int, record: dict[str, Any]) -> None:
        """``train.nonfinite=skip``: count the step's dropped updates; stop after ``max_skipped`` in a row."""
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        if not skipped:
            return
        self.skipped_total += 1
        record["skipped_updates"], record["skipped_steps"] = skipped, self.skipped_total
        logger.warning("step %d: non-finite gradients, %d stage update(s) skipped", step + 1, skipped)
        if self.skipped_in_a_row >= self.cfg.train.max_skipped:
            raise NonFiniteError(
                f"training step {step + 1}: {self.skipped_in_a_row} steps in a row had non-finite gradients "
                f"(train.max_skipped={self.cfg.train.max_skipped}); the last checkpoint is the last good state"
            )

    def _owns_norm(self, stage: str) -> bool:
        return self.train_plan.groups[stage].ranks[0] == self.rank

    def validation_loss(self) -> float:
        """Mean flow-matching loss on the fixed validation set with fixed noise (forward-only plan)."""
        self.executor.flush()
        n_micro, seed = self.cfg.train.micro_batches, self.cfg.train.seed
        chunks = [self.val_batches[i : i + n_micro] for i in range(0, len(self.val_batches) - n_micro + 1, n_micro)]
        total, self.events.phase = torch.zeros(()), "val"
        for c, mbs in enumerate(chunks):

            def options(stage: str, mb: int, rows: tuple[int, int, int], c: int = c) -> dict[str, Any]:
                return {"seed": micro_batch_seed(seed, -1, c * n_micro + mb), "rows": rows}

            with torch.no_grad():
                out = self.executor.run(self.val_plan.actions[self.rank], mbs.__getitem__, options)
            total += out["loss"].cpu()
        return self.reduce(total.reshape(1))[0].item() / len(chunks)


def kernel_choice(cfg: RunConfig) -> kernels.KernelChoice:
    """``model.kernels`` resolved for the run's device (``auto``: Triton on CUDA; on CPU Triton runs interpreted)."""
    device = resolve_device(cfg.device)
    return kernels.resolve(kernels.KernelChoice(**dataclasses.asdict(cfg.model.kernels)), device.value)


def start_rank(cfg: RunConfig, graph: Graph, *, rank: int, world_size: int) -> TrainLoop:
    """This process's threads, GPU and kernels set for the run, and its rank's loop built (its
    stages on its device, the optimizers of its trainable stages); ``run_rank`` drives it."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    device = run_devices(cfg, local_ranks=0).rank_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kernels.configure(kernel_choice(cfg))
    return TrainLoop(cfg, graph, rank, world_size)


def run_rank(cfg: RunConfig, graph: Graph, *, rank: int, world_size: int) -> TrainResult:
    """The training loop of one rank (all ranks run it; rank 0 logs and shows progress); the
    process's torch threads and kernel choice are as before when it returns (``train`` in-process)."""
    threads, choice = torch.get_num_threads(), kernels.chosen()
    try:
        return _run_rank(cfg, graph, rank=rank, world_size=world_size)
    finally:
        torch.set_num_threads(threads)
        kernels.configure(choice)


def _run_rank(cfg: RunConfig, graph: Graph, *, rank: int, world_size: int) -> TrainResult:
    tc = cfg.train
    loop = start_rank(cfg, graph, rank=rank, world_size=world_size)
    run_dir, lead = loop.run_dir, loop.lead
    start = 0
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None and (tc.resume or _restarted()):
        local_trainable = {s: loop.executor.modules[s] for s in loop.executor.optimizers}
        start = load_checkpoint(ckpt, local_trainable, loop.executor.optimizers)
        logger.info("rank %d resumed from %s at step %d", rank, ckpt, start)
    if lead:
        print(graph)
    metrics = open_metrics(run_dir, keep_until=start) if lead else None
    recording = RankRecording(cfg.profile, run_dir, rank, lambda: loop.events.step)  # memory, profiler window
    first_val = last_val = None
    if start == 0:
        first_val = last_val = loop.validation_loss()
        _log(metrics, {"step": 0, "val_loss": first_val})
    bar = tqdm(total=tc.steps, initial=start, desc="train", disable=not (tc.progress and lead), dynamic_ncols=True)
    t0, window = time.perf_counter(), 0
    for step in range(start, tc.steps):
        record = loop.train_step(step) or {}
        recording.step()
        window += tc.batch_size
        done = step + 1
        if done % tc.log_every == 0 or done == tc.steps:
            record["samples_per_s"] = window / (time.perf_counter() - t0)
            t0, window = time.perf_counter(), 0
        if done % tc.val_every == 0 or done == tc.steps:
            last_val = record["val_loss"] = loop.validation_loss()
        if lead:
            _log(metrics, record)
            bar.set_postfix(loss=f"{record['loss']:.4f}", **_speed(record))
        loop.events.flush()
        if done % tc.ckpt_every == 0 or done == tc.steps:
            loop.executor.flush()
            save_checkpoint(run_dir, done, loop.executor.modules, loop.executor.optimizers)
        bar.update(1)
    bar.close()
    loop.executor.flush()
    recording.close()
    loop.events.close()
    if metrics is not None:
        metrics.close()
    if last_val is None:  # resumed at the last step: nothing ran
        last_val = loop.validation_loss()
    return TrainResult(run_dir=run_dir, steps=tc.steps, first_val_loss=first_val, last_val_loss=last_val)


def _restarted() -> bool:
    """Whether the elastic agent restarted this worker group (then it resumes from the last checkpoint)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def _speed(record: dict[str, Any]) -> dict[str, str]:
    return {"samples/s": f"{record['samples_per_s']:.1f}"} if "samples_per_s" in record else {}


def _log(stream: Any, record: dict[str, Any]) -> None:
    if stream is None:
        return
    stream.write(json.dumps(record) + "\n")
    stream.flush()


def open_metrics(run_dir: Path, keep_until: int) -> Any:
    """``metrics.jsonl`` for appending, without records past ``keep_until`` (a killed run's tail)."""
    path = run_dir / METRICS_FILE
    kept = [r for r in read_metrics(run_dir) if r["step"] <= keep_until] if keep_until and path.exists() else []
    stream = path.open("w")
    for record in kept:
        _log(stream, record)
    return stream


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``RUN_DIR/metrics.jsonl``."""
    lines = (run_dir / METRICS_FILE).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]
