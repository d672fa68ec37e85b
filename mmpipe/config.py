"""Typed configs of the ``mmpipe`` commands, built from plain dicts at the entry point.

Hydra composes YAML into a ``DictConfig`` at the edge (``mmpipe.cli``); :func:`from_dict` turns
its container into these dataclasses, rejecting unknown keys and wrongly typed values with the
dotted key in the message. Library code only ever sees the dataclasses.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

T = TypeVar("T")


def _positive(section: str, obj: Any, *keys: str) -> None:
    for key in keys:
        if getattr(obj, key) <= 0:
            raise ValueError(f"{section}.{key} must be positive, got {getattr(obj, key)}")


@dataclasses.dataclass(kw_only=True)
class VideoSize:
    """Frames and resolution of one training sample."""

    frames: int
    height: int
    width: int

    def __post_init__(self) -> None:
        _positive("model.video", self, "frames", "height", "width")
        if self.frames % 4 != 1 or self.height % 16 or self.width % 16:
            raise ValueError(
                f"model.video: frames must be 4k+1 and height/width multiples of 16, "
                f"got {self.frames} x {self.height} x {self.width}"
            )


@dataclasses.dataclass(kw_only=True)
class KernelConfig:
    """Which implementation each DiT hot path uses (``model.kernels.rope=triton``): ``auto`` (default:
    mmpipe's Triton kernels on CUDA, PyTorch's on CPU), ``torch``, ``triton`` (``mmpipe.kernels``;
    interpreted on CPU, for tests)."""

    attention: Literal["torch", "triton", "xformers", "auto"] = "auto"
    norm_modulate: Literal["torch", "triton", "auto"] = "auto"
    rope: Literal["torch", "triton", "auto"] = "auto"


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    """The model: a local diffusers pipeline directory, a tiny random preset, or a full-size
    architecture-only preset (``model.arch``: configs without weights, for ``mmpipe plan``)."""

    name: str = "t2v_tiny"
    # text-to-video, understand-then-generate (vision -> LLM -> DiT), or text-to-image: an image
    # family's architecture-only preset (FLUX.1, Qwen-Image), planned for serving only
    kind: Literal["t2v", "u2g", "t2i"] = "t2v"
    path: str | None = None  # local WanPipeline-layout directory; None builds the tiny preset below
    text_encoder: Literal["umt5", "qwen2"] = "umt5"
    text_dim: int = 32
    text_len: int = 16
    dit_heads: int = 8
    dit_head_dim: int = 16
    dit_layers: int = 2
    vae_base_dim: int = 4
    # The tiny preset's VAE: random weights (width vae_base_dim), or "shapes": the Wan-architecture
    # VAE trained on the moving-shapes clips that ships with the package (mmpipe.models.shapes_vae)
    vae_weights: Literal["random", "shapes"] = "shapes"
    flow_shift: float = 3.0
    # The tiny preset as Wan 2.2's two-expert DiT: a second DiT (``transformer_2``) takes the steps
    # below this fraction of the timesteps and trains on that noise range (the first on the rest).
    # null: one DiT. With model.path the directory's model_index.json says.
    boundary_ratio: float | None = None
    # Full-size architecture presets (wan14b_t2v, hunyuan_t2v, ...): each stage's module config
    # (diffusers / transformers kwargs; ``class`` picks the family) and the per-sample video size.
    arch: dict[str, Any] | None = None
    video: VideoSize | None = None
    kernels: KernelConfig = dataclasses.field(default_factory=KernelConfig)
    # torch.compile each trained stage's repeated blocks (regional compilation, as torchtitan does)
    compile: bool = False

    def __post_init__(self) -> None:
        _positive("model", self, "text_dim", "text_len", "dit_heads", "dit_head_dim", "dit_layers", "vae_base_dim")
        if self.dit_head_dim % 2:
            # Wan's 3-D rotary embedding splits each head's dims into even frame/height/width parts.
            raise ValueError(f"model.dit_head_dim must be even, got {self.dit_head_dim}")
        if self.vae_weights not in ("random", "shapes"):
            raise ValueError(f"model.vae_weights must be 'random' or 'shapes', got {self.vae_weights!r}")
        if self.boundary_ratio is not None:
            if not 0.0 < self.boundary_ratio < 1.0:
                raise ValueError(f"model.boundary_ratio must be in (0, 1), got {self.boundary_ratio}")
            if self.path is not None or self.kind != "t2v":
                raise ValueError(
                    "model.boundary_ratio makes the tiny or an architecture t2v preset two-expert; with "
                    "model.path the directory's model_index.json says (set it to null)"
                )
        if self.kind == "u2g" and self.path is not None:
            raise ValueError("model.kind=u2g trains the tiny preset only; model.path must be null")
        if self.kind == "t2i":
            if self.arch is None or self.path is not None:
                raise ValueError(
                    f"model.kind=t2i (model {self.name!r}): image families are architecture-only presets "
                    f"(model.arch set, model.path null), planned with `mmpipe plan mode=serve`; got "
                    f"model.path={self.path!r}, model.arch {'set' if self.arch else 'missing'}"
                )
            if self.video is None or self.video.frames != 1:
                frames = self.video.frames if self.video is not None else None
                raise ValueError(f"model.kind=t2i: model.video.frames must be 1 (one image), got {frames}")
        if self.path is not None and not Path(self.path).is_dir():
            raise ValueError(f"model.path={self.path!r} is not a local directory (nothing is downloaded)")


@dataclasses.dataclass(kw_only=True)
class DataConfig:
    """Training videos: procedural moving shapes (``root: null``) or a folder with a captions file."""

    root: str | None = None
    captions_file: str = "captions.jsonl"
    frames: int = 17
    height: int = 64
    width: int = 64
    num_samples: int = 1024  # moving shapes only
    val_samples: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        _positive("data", self, "frames", "height", "width", "num_samples", "val_samples")
        if self.height % 16 or self.width % 16:
            raise ValueError(f"data.height and data.width must be multiples of 16, got {self.height}x{self.width}")
        if self.frames % 4 != 1:
            raise ValueError(f"data.frames must be 4k+1 (the VAE's temporal stride is 4), got {self.frames}")
        if self.root is not None and not Path(self.root).is_dir():
            raise ValueError(f"data.root={self.root!r} is not a directory")


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    """Optimisation, logging and checkpointing of ``mmpipe train``."""

    steps: int = 4400
    batch_size: int = 8  # global batch: samples per optimizer step
    # micro-batches a step: 0 (auto) lets placement=auto's planner choose them with the placement
    # (one when every stage is data-parallel: a smaller micro-batch only adds per-call cost); with a
    # given placement, auto is 2, so a pipelined placement overlaps its stages
    micro_batches: int = 0
    lr: float = 3e-3
    # trainable stage -> factor on lr, e.g. {llm: 0.1}: a randomly initialised LLM trained at the DiT's
    # rate collapses the instructions' states before the DiT learns to read them (RESULTS, issue 31)
    lr_scale: dict[str, float] | None = None
    warmup_steps: int = 20
    # after the warm-up: constant, or a cosine decay to 0 at train.steps (torchtitan's and diffusers'
    # training scripts' usual choice; a short run ends with the small steps that settle it)
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    # the fraction of training captions replaced by "" (the negative prompt generation's classifier-free
    # guidance runs the DiT on): without it the unconditional branch is a context never trained on
    caption_dropout: float = 0.1
    # per rank: host memory for the frozen prefix's outputs (VAE latents, text embeddings) kept per
    # sample and reused after the first epoch (mmpipe.runtime.frozen_cache); 0 recomputes them every
    # step (a dataset that augments at random needs 0)
    cache_frozen_gb: float = 2.0
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 on CUDA (fp32 master weights), fp32 on CPU
    seed: int = 0
    log_every: int = 10
    val_every: int = 100
    ckpt_every: int = 100
    resume: bool = False
    threads: int = 0  # torch intra-op threads per rank; 0: the machine's cores / launch.nproc
    progress: bool = True
    schedule: Literal["1f1b", "gpipe"] = "1f1b"
    # a non-finite loss or gradient: stop (error naming step, stage and tensor; the last good
    # checkpoint stays) or skip the step's update (counted), stopping after max_skipped in a row
    nonfinite: Literal["stop", "skip"] = "stop"
    max_skipped: int = 3

    def __post_init__(self) -> None:
        _positive("train", self, "steps", "batch_size", "lr", "log_every", "val_every", "ckpt_every")
        if self.micro_batches < 0:
            raise ValueError(f"train.micro_batches={self.micro_batches}: expected >= 1, or 0 (auto)")
        if self.micro_batches and self.batch_size % self.micro_batches:
            raise ValueError(
                f"train.batch_size={self.batch_size} is not divisible by train.micro_batches={self.micro_batches}"
            )
        if self.warmup_steps < 0 or self.grad_clip < 0 or self.weight_decay < 0 or self.threads < 0:
            raise ValueError("train.warmup_steps, grad_clip, weight_decay and threads must be >= 0")
        _positive("train", self, "max_skipped")
        if not 0.0 <= self.caption_dropout < 1.0:
            raise ValueError(f"train.caption_dropout={self.caption_dropout!r}: expected a fraction in [0, 1)")
        if not self.cache_frozen_gb >= 0.0:
            raise ValueError(f"train.cache_frozen_gb={self.cache_frozen_gb!r}: expected >= 0 (0 turns the cache off)")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"train.lr_schedule={self.lr_schedule!r}: expected constant or cosine")
        for stage, factor in (self.lr_scale or {}).items():
            if not 0.0 < factor < math.inf:
                raise ValueError(f"train.lr_scale.{stage}={factor!r}: expected a positive factor")


@dataclasses.dataclass(kw_only=True)
class LaunchConfig:
    """Local workers of ``mmpipe train`` (torch's elastic agent) and their fault tolerance."""

    # 1 runs in this process; N > 1 launches N local workers; 0: one per GPU (CUDA) or per CPU core
    nproc: int = 1
    max_restarts: int = 0  # restart the whole group after a worker dies, resuming from the last checkpoint
    timeout_s: float = 300.0  # collectives and point-to-point ops fail after this long instead of hanging
    master_port: int = 0  # 0: pick a free port
    # auto: NCCL on CUDA (one rank per GPU), gloo on CPU; gloo on CUDA lets ranks share a GPU
    # (edge tensors staged through host memory), as on a one-GPU machine
    backend: Literal["auto", "nccl", "gloo"] = "auto"

    def __post_init__(self) -> None:
        _positive("launch", self, "timeout_s")
        if isinstance(self.nproc, bool) or not isinstance(self.nproc, int) or self.nproc < 0:
            raise ValueError(f"launch.nproc={self.nproc!r}: expected 0 (one rank per GPU or core) or a positive int")
        if self.max_restarts < 0 or not 0 <= self.master_port < 65536:
            raise ValueError(f"launch.max_restarts={self.max_restarts} / master_port={self.master_port} out of range")


@dataclasses.dataclass(kw_only=True)
class StageParallelConfig:
    """Sequence parallelism of one stage (``parallel.dit.ulysses=2 parallel.dit.ring=2``): each data-
    parallel replica of the stage spans ``ulysses x ring`` of its placed ranks."""

    ulysses: int = 1
    ring: int = 1

    def __post_init__(self) -> None:
        _positive("parallel.<stage>", self, "ulysses", "ring")


@dataclasses.dataclass(kw_only=True)
class StageMemoryConfig:
    """Activation policy of one stage's repeated blocks (``memory.dit.policy=auto memory.dit.budget_gb=60``):
    ``keep`` everything, ``recompute``, ``selective`` (recompute all but the matmul and attention
    outputs) or ``offload`` (to a spill directory) every block, or ``auto``: the cheapest mix whose
    saved activations, with the micro-batches 1F1B keeps in flight, fit ``budget_gb`` per rank.
    ``blocks``: instead of a policy, one per block, in order (``[offload, offload, recompute, keep]``).
    On CUDA ranks ``budget_gb`` may be left out: ``auto`` then budgets against the GPU's memory."""

    policy: Literal["keep", "recompute", "selective", "offload", "auto"] = "keep"
    budget_gb: float | None = None
    blocks: list[Literal["keep", "recompute", "selective", "offload"]] | None = None

    def __post_init__(self) -> None:
        if self.blocks is not None and self.policy != "keep":
            raise ValueError(
                f"memory.<stage>.blocks={self.blocks} and policy={self.policy}: give a policy or a list per block"
            )
        if self.blocks is not None and not self.blocks:
            raise ValueError("memory.<stage>.blocks is empty; give one policy per repeated block")
        if self.policy == "auto" and self.budget_gb is not None and self.budget_gb <= 0:
            raise ValueError(f"memory.<stage>.policy=auto needs a positive budget_gb, got {self.budget_gb}")
        if self.policy != "auto" and self.budget_gb is not None:
            raise ValueError(f"memory.<stage>.budget_gb={self.budget_gb} is only used with policy=auto")


@dataclasses.dataclass(kw_only=True)
class TraceConfig:
    """``profile.enabled=true``: ``torch.profiler`` over a window of training steps (skip ``wait``,
    warm up for ``warmup``, record ``active``), one TensorBoard trace per rank in ``RUN_DIR/profiler``
    (``tensorboard --logdir RUN_DIR``, torch-tb-profiler). Not ``mmpipe profile``, the planner's
    calibration (:class:`ProfileConfig`)."""

    enabled: bool = False
    wait: int = 1
    warmup: int = 1
    active: int = 2

    def __post_init__(self) -> None:
        _positive("profile", self, "active")
        if self.wait < 0 or self.warmup < 0:
            raise ValueError(f"profile.wait={self.wait} and profile.warmup={self.warmup} must be >= 0")

    @property
    def window(self) -> int:
        """Training steps the profiler schedule spans."""
        return self.wait + self.warmup + self.active


def read_placement_file(path: str) -> dict[str, Any]:
    """``placement=FILE``: the stage -> group mapping a JSON or YAML file holds, or the ``placement`` of
    ``mmpipe plan --json`` saved to a file."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"placement={path!r}: expected auto, a mapping or a JSON / YAML file; no such file")
    try:
        raw = yaml.safe_load(file.read_text())  # JSON is YAML
    except yaml.YAMLError as err:
        raise ValueError(f"placement={path!r}: not JSON or YAML: {str(err).splitlines()[0]}") from None
    if isinstance(raw, dict) and isinstance(raw.get("placement"), dict):
        raw = raw["placement"]  # the whole report of mmpipe plan --json
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"placement={path!r}: the file holds no stage -> group mapping")
    return {str(k): v for k, v in raw.items()}


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    """Root config of ``mmpipe train``."""

    run_dir: str | None = None  # None: runs/<model>-<timestamp>
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: CUDA when a GPU is visible
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    launch: LaunchConfig = dataclasses.field(default_factory=LaunchConfig)
    # stage -> ranks: {text: [0], vae: [0], dit: {ranks: [1, 2], dp: 2}}; None: derived from launch.nproc;
    # "auto": chosen by the planner for launch.nproc local ranks; a path: a JSON or YAML file holding
    # that mapping, or `mmpipe plan --json`'s output (its "placement" is used, unchanged)
    placement: dict[str, Any] | str | None = None
    # stage -> sequence parallelism, applied to the stage's placed ranks (dp = ranks / (ulysses x ring))
    parallel: dict[str, StageParallelConfig] = dataclasses.field(
        default_factory=lambda: {"dit": StageParallelConfig(), "llm": StageParallelConfig()}
    )
    # stage -> activation policy of its blocks, e.g. memory.dit.policy=auto memory.dit.budget_gb=60
    memory: dict[str, StageMemoryConfig] = dataclasses.field(
        default_factory=lambda: {"dit": StageMemoryConfig(), "llm": StageMemoryConfig()}
    )
    # torch.profiler over a window of steps, e.g. profile.enabled=true profile.active=3
    profile: TraceConfig = dataclasses.field(default_factory=TraceConfig)

    def __post_init__(self) -> None:
        if self.model.kind == "t2i":
            raise ValueError(
                f"model.kind={self.model.kind!r} (model {self.model.name!r}): mmpipe does not train image "
                f"families; plan serving it with `mmpipe plan mode=serve model={self.model.name}`"
            )
        if isinstance(self.placement, str) and self.placement != "auto":
            self.placement = read_placement_file(self.placement)
        if self.train.micro_batches == 0 and self.placement != "auto":  # placement=auto: the planner's
            self.train = dataclasses.replace(self.train, micro_batches=math.gcd(2, self.train.batch_size))
        if self.profile.enabled and self.profile.window > self.train.steps:
            raise ValueError(
                f"profile.enabled=true: the window wait={self.profile.wait} + warmup={self.profile.warmup} + "
                f"active={self.profile.active} is longer than train.steps={self.train.steps}"
            )
        if self.data.val_samples < self.train.batch_size:
            raise ValueError(
                f"data.val_samples={self.data.val_samples} must be >= train.batch_size={self.train.batch_size} "
                "(validation runs whole batches through the same plan)"
            )


#: ``cache.policy`` values (:class:`mmpipe.stages.cache.CachePolicy`)
CACHE_POLICIES = ("none", "first_block", "teacache", "mag")


@dataclasses.dataclass(kw_only=True)
class StepCacheConfig:
    """``cache.*`` of ``generate`` / ``serve``: which step cache the denoiser runs with
    (:mod:`mmpipe.stages.cache`): ``none``, ``first_block`` (diffusers' First Block Cache),
    ``teacache`` (TeaCache, published fits where the architecture matches) or ``mag`` (diffusers'
    MagCache; published ratios for Wan 2.1 1.3B / 14B and FLUX.1, else measured on the first request
    of each step count, which runs uncached). ``threshold``: None for the policy's default."""

    policy: str = "none"
    threshold: float | None = None
    mag_ratios: list[float] | None = None  # MagCache's per-step ratios for this checkpoint

    def __post_init__(self) -> None:
        if self.policy not in CACHE_POLICIES:
            raise ValueError(f"cache.policy={self.policy!r}: expected one of {list(CACHE_POLICIES)}")
        if self.threshold is not None and not self.threshold > 0:
            raise ValueError(f"cache.threshold={self.threshold!r}: expected a number > 0")


@dataclasses.dataclass(kw_only=True)
class GenerateConfig:
    """Root config of ``mmpipe generate``: a trained run directory (``ckpt``) or a local diffusers
    pipeline directory of any supported family (``pipeline``), and what to render."""

    ckpt: str | None = None
    pipeline: str | None = None  # a diffusers directory (Wan, HunyuanVideo, CogVideoX, LTX, Flux, ...)
    image: str | None = None  # the input image of image-to-video pipelines (a PNG / JPEG file)
    last_image: str | None = None  # and the last frame of first-last-frame ones (Wan 2.1 FLF2V)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: CUDA when a GPU is visible (bf16 there)
    prompt: str = "a red circle moving left"
    negative_prompt: str = ""
    steps: int = 20
    guidance: float = 3.0
    seed: int = 0
    frames: int | None = None  # None: the run's training size
    height: int | None = None
    width: int | None = None
    fps: int = 8
    out: str | None = None  # None: <ckpt>/samples
    # Processes one request runs on (CPU ranks, gloo), and where its stages run among them, e.g.
    # {text: [0], denoise: {ranks: [0, 1], ulysses: 2}, decode: [0]}; None: the guidance branches
    # on two halves of the ranks (cfg: 2) when guidance is on, Ulysses over the rest
    nproc: int = 1
    placement: dict[str, Any] | None = None
    threads: int = 0  # torch threads per rank; 0: the machine's cores / nproc
    cache: StepCacheConfig = dataclasses.field(default_factory=StepCacheConfig)
    compile: bool = False  # torch.compile the denoiser's repeated blocks (regional compilation)

    def __post_init__(self) -> None:
        if self.nproc < 1 or self.threads < 0:
            raise ValueError(
                f"generate: nproc must be >= 1 and threads >= 0 (got nproc={self.nproc}, threads={self.threads})"
            )
        if self.placement is not None and not isinstance(self.placement, dict):
            raise ValueError(f"placement={self.placement!r}: expected a mapping of text / denoise / decode")
        if bool(self.ckpt) == bool(self.pipeline):
            raise ValueError(
                "give exactly one of ckpt and pipeline: mmpipe generate ckpt=RUN_DIR or pipeline=DIFFUSERS_DIR "
                f"(got ckpt={self.ckpt!r} pipeline={self.pipeline!r})"
            )
        if self.ckpt and not Path(self.ckpt).is_dir():
            raise ValueError(f"ckpt={self.ckpt!r} is not a run directory")
        for key in ("image", "last_image"):
            value = getattr(self, key)
            if value is not None and not Path(value).is_file():
                raise ValueError(f"{key}={value!r} is not a file")
        if self.last_image is not None and self.image is None:
            raise ValueError(f"last_image={self.last_image!r} without image=FILE: give the first frame too")
        if not self.prompt.strip():
            raise ValueError("prompt must not be empty")
        _positive("generate", self, "steps", "fps")
        for key in ("frames", "height", "width"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ValueError(f"{key} must be positive, got {value}")


STAGE_NAMES_SERVE = ("text", "denoise", "decode")  # the stages of the inference graph (from_diffusers)


@dataclasses.dataclass(kw_only=True)
class ServeConfig:
    """Root config of ``mmpipe serve``: an inference graph placed on device groups behind an
    OpenAI-compatible HTTP API.

    The graph comes from ``pipeline`` (a local diffusers WanPipeline directory), else from ``ckpt`` (a
    trained run directory: its pipeline with the latest DiT weights), else from the ``model`` preset
    (the tiny random-weight Wan, built locally). ``placement`` maps each stage to the device groups
    (worker processes, one rank each) that run it; a stage on several groups has one replica per
    group and requests are spread over them. Group count = 1 + the largest group index named.
    """

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    pipeline: str | None = None
    ckpt: str | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: CUDA when a GPU is visible (bf16 there)
    model_name: str = "mmpipe-wan"  # the model id clients send (GET /v1/models lists it)
    text_len: int = 0  # prompt tokens; 0: model.text_len for the preset, 512 (WanPipeline's) for pipeline=DIR
    run_dir: str | None = None  # events, memory samples and the config; None: runs/serve-<timestamp>
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port
    # clients must send "Authorization: Bearer <api_key>" (None: $MMPIPE_API_KEY, else no authentication)
    api_key: str | None = None
    # stage -> groups; None: the device's default (CPU: text on group 0, DiT and VAE on groups 0 and 1;
    # CUDA: one group per GPU running every stage)
    placement: dict[str, Any] | str | None = None  # "auto": the serving planner's choice (mmpipe plan mode=serve)
    threads: int = 0  # torch threads per group; 0: the machine's cores / groups
    max_batch: int = 4  # requests a stage runs as one batch
    max_wait_ms: float = 5.0  # how long a stage waits for a batch to fill
    max_queue: int = 64  # unfinished requests; more -> HTTP 429
    timeout_s: float = 600.0  # per request, from its creation
    keep_results: int = 64  # finished jobs (and their frames) kept for GET; older ones are forgotten (404)
    # Defaults of a request, and the limits of what one may ask for.
    height: int = 64
    width: int = 64
    frames: int = 17
    steps: int = 20
    guidance: float = 3.0
    fps: int = 8
    max_height: int = 1280
    max_width: int = 1280
    max_frames: int = 129
    max_steps: int = 100
    max_prompt_chars: int = 2000
    cache: StepCacheConfig = dataclasses.field(default_factory=StepCacheConfig)  # whole-request replicas
    compile: bool = False  # torch.compile the denoiser's repeated blocks (regional compilation)

    def __post_init__(self) -> None:
        _positive("serve", self, "max_batch", "max_queue", "keep_results", "timeout_s", "fps")
        _positive("serve", self, "height", "width", "frames", "steps")
        _positive("serve", self, "max_height", "max_width", "max_frames", "max_steps", "max_prompt_chars")
        if self.max_wait_ms < 0 or self.threads < 0 or self.text_len < 0:
            raise ValueError("serve: max_wait_ms, threads and text_len must be >= 0")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port}: expected 0..65535")
        for key in ("pipeline", "ckpt"):
            value = getattr(self, key)
            if value is not None and not Path(value).is_dir():
                raise ValueError(f"{key}={value!r} is not a directory")
        if self.pipeline and self.ckpt:
            raise ValueError("give pipeline=DIR or ckpt=RUN_DIR, not both")
        if self.placement is None or self.placement == "auto":
            return
        if isinstance(self.placement, str):
            raise ValueError(f"placement={self.placement!r}: expected auto or a mapping of text / denoise / decode")
        unknown = sorted(set(self.placement) - set(STAGE_NAMES_SERVE))
        if unknown:
            raise ValueError(f"placement.{unknown[0]}: unknown stage; stages: {list(STAGE_NAMES_SERVE)}")
        if isinstance(self.placement.get("denoise"), dict):
            # replicas of several ranks each ({ranks, cfg, ulysses, ring, dp}): the engine checks them
            # against the model, and each replica runs text and decode on its first rank
            return
        missing = [s for s in STAGE_NAMES_SERVE if s not in self.placement]
        if missing:
            raise ValueError(
                f"placement.{missing[0]} is missing: every stage of {list(STAGE_NAMES_SERVE)} needs a group"
            )
        for stage, groups in list(self.placement.items()):
            groups = [groups] if isinstance(groups, int) and not isinstance(groups, bool) else groups
            if (
                not isinstance(groups, list | tuple)
                or not groups
                or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in groups)
                or len(set(groups)) != len(groups)
            ):
                raise ValueError(f"placement.{stage}={groups!r}: expected a group index or a list of distinct ones")
            self.placement[stage] = list(groups)
        used = sorted({g for groups in self.placement.values() for g in groups})
        if used != list(range(len(used))):
            idle = sorted(set(range(used[-1] + 1)) - set(used))
            raise ValueError(f"placement: group {idle[0]} runs no stage; groups must be numbered 0..N-1")

    @property
    def groups(self) -> int:
        """How many device groups (worker processes) the placement names (once it is resolved)."""
        assert isinstance(self.placement, dict), "the serving engine resolves a missing or auto placement"
        denoise = self.placement["denoise"]
        ranks = denoise["ranks"] if isinstance(denoise, dict) else denoise
        return 1 + max([*ranks, *(g for s, groups in self.placement.items() if s != "denoise" for g in groups)])


@dataclasses.dataclass(kw_only=True)
class PlanConfig:
    """Root config of ``mmpipe plan``: a model preset on a cluster preset, planned for training
    (``mode=train``) or for serving requests of the preset's video size (``mode=serve``)."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    cluster: dict[str, Any] = dataclasses.field(default_factory=lambda: {"name": "local"})  # a configs/cluster preset
    mode: Literal["train", "serve"] = "train"
    nproc: int = 0  # cluster=local only: ranks (0: the machine's cores)
    global_batch: int = 0  # train: samples per optimizer step; 0: one per device
    micro_batches: int = 0  # train: 0: searched
    simulate: bool = True  # train: check the chosen plans with the discrete-event simulator
    steps: int = 50  # serve: denoising steps of a request
    guidance: float = 5.0  # serve: classifier-free guidance scale (> 1: two DiT forwards a step)
    objective: Literal["throughput", "latency"] = "throughput"  # serve: most requests/s, or lowest latency
    slo_s: float | None = None  # serve: a request's latency must not exceed it (seconds)
    calibration: str | None = None  # a calibration.json from `mmpipe profile`
    json: bool = False

    def __post_init__(self) -> None:
        if self.mode == "train" and self.model.kind == "t2i":
            raise ValueError(
                f"model.kind={self.model.kind!r} (model {self.model.name!r}): image families are planned with "
                f"mode=serve only (mmpipe does not train them): mmpipe plan mode=serve model={self.model.name}"
            )
        if self.nproc < 0 or self.global_batch < 0 or self.micro_batches < 0:
            raise ValueError("nproc, global_batch and micro_batches must be >= 0")
        if self.calibration is not None and not Path(self.calibration).is_file():
            raise ValueError(f"calibration={self.calibration!r} is not a file")
        _positive("plan", self, "steps")
        if self.guidance < 0:
            raise ValueError(f"guidance={self.guidance}: must be >= 0 (> 1 turns classifier-free guidance on)")
        if self.slo_s is not None and not self.slo_s > 0:
            raise ValueError(f"slo_s={self.slo_s}: must be positive (seconds)")
        # a key of the other mode would be silently ignored
        other = "serve" if self.mode == "train" else "train"
        keys = (
            ("steps", "guidance", "objective", "slo_s")
            if other == "serve"
            else ("global_batch", "micro_batches", "simulate")
        )
        fields = PlanConfig.__dataclass_fields__
        for key in keys:
            if getattr(self, key) != fields[key].default:
                raise ValueError(
                    f"{key}={getattr(self, key)!r} applies to mode={other} only (this plan is mode={self.mode})"
                )


@dataclasses.dataclass(kw_only=True)
class ProfileConfig:
    """Root config of ``mmpipe profile``."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: CUDA when a GPU is visible
    # samples per micro-batch of each single-rank run, growing: one line per neighbouring pair prices
    # the actions between them. 1, 2 and 4: the sizes a run's micro-batch (2 to 4 samples) and a
    # data-parallel replica's share of it (1 to 2) are priced at; an action's time is not one line
    # through them (the tiny VAE's encode: 126 / 100-107 / 187-191 ms for 1 / 2 / 4 clips)
    micro_sizes: list[int] = dataclasses.field(default_factory=lambda: [1, 2, 4])
    micro_batches: int = 4
    steps: int = 6
    warmup: int = 2
    threads: int = 1
    out: str | None = None

    def __post_init__(self) -> None:
        _positive("profile", self, "micro_batches", "steps")
        sizes = self.micro_sizes
        if len(sizes) < 2 or sizes[0] <= 0 or any(a >= b for a, b in itertools.pairwise(sizes)):
            raise ValueError(f"micro_sizes={sizes}: two or more growing positive micro-batch sizes, e.g. [1, 2, 4]")
        if self.warmup < 0 or self.threads < 0:
            raise ValueError("warmup and threads must be >= 0")
        if self.steps <= self.warmup + 1:
            raise ValueError(f"steps={self.steps} must exceed warmup + 1 = {self.warmup + 1}")


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, naming the dotted key of any unknown or mistyped value."""
    if not isinstance(data, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(
            f"unknown config key {prefix}{unknown[0]}; allowed under {prefix or 'top level'}: {sorted(fields)}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {key: _coerce(hints[key], value, f"{prefix}{key}") for key, value in data.items()}
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key + ".")  # type: ignore[arg-type]
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # Optional[X]: X's own error names the offending key and value
            return _coerce(options[0], value, key)
        for arg in options:
            try:
                return _coerce(arg, value, key)
            except ValueError:
                continue
        raise ValueError(f"{key}={value!r}: expected {_type_name(tp)}")
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key}={value!r}: expected a mapping")
        item: Any = args[1] if args else None
        if isinstance(item, type) and dataclasses.is_dataclass(item):
            return {k: from_dict(item, v, f"{key}.{k}.") for k, v in value.items()}
        if item in (int, float, str, bool):
            return {k: _coerce(item, v, f"{key}.{k}") for k, v in value.items()}
        return value
    if origin is list:
        if not isinstance(value, list | tuple):
            raise ValueError(f"{key}={value!r}: expected a list")
        return [_coerce(args[0], v, f"{key}[{i}]") if args else v for i, v in enumerate(value)]
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{key}={value!r}: expected one of {list(args)}")
        return value
    if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if tp in (int, str, bool) and type(value) is tp:
        return value
    raise ValueError(f"{key}={value!r}: expected {_type_name(tp)}")


def _type_name(tp: Any) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args] + (["null"] if type(None) in typing.get_args(tp) else [])
        return " or ".join(names)
    if typing.get_origin(tp) is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is dict:
        return "a mapping"
    if typing.get_origin(tp) is list:
        return "a list"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def to_dict(cfg: Any) -> dict[str, Any]:
    """The plain-dict form of a config dataclass (for saving next to a run)."""
    return dataclasses.asdict(cfg)


def compose_config(command: str, overrides: Sequence[str]) -> dict[str, Any]:
    """The composed config of ``command`` as a plain dict (Hydra compose API, struct mode)."""
    with initialize_config_module(config_module="mmpipe.configs", version_base="1.3"):
        cfg = compose(config_name=command, overrides=list(overrides))
    container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert isinstance(container, dict)
    return {str(k): v for k, v in container.items()}
