"""The serving engine: the inference graph's stages on device groups, pipelined across requests.

One worker process per device group (one rank of a gloo process group, as in training). The
front end (this process: the HTTP server's engine object) sends each request's parameters to the
groups on its route (text group -> denoise group -> decode group) over a control queue; the
tensors between stages travel rank to rank with the runtime's point-to-point transport
(``mmpipe.runtime.transport``), never through the front end. So while group 1's DiT denoises one
request, group 0 encodes the next prompt and a decode group decodes the previous video.

Per group, one loop (:class:`_GroupWorker`) interleaves its stages:

* text: each ready request's prompt (and negative prompt) encoded, exactly as ``graph.generate``
  calls the stage, then sent to the request's denoise group;
* denoise: *continuous batching at step granularity*: one DiT forward per iteration over up to
  ``serve.max_batch`` active requests of one shape, conditional and unconditional rows in the
  same batch, each row at its own timestep; every request keeps its own scheduler, so its
  trajectory is the one it would have alone. The DiT is made row-exact
  (:func:`mmpipe.serve.batching.make_row_exact`), so the outputs are bitwise those of
  ``graph.generate`` with the same seed, whatever the batching;
* decode: the VAE decodes each finished latent and the frames go back to the front end.

Every other family (a ``pipeline`` directory of Wan 2.2, Wan I2V, HunyuanVideo, CogVideoX, LTX,
Flux, Qwen-Image: :mod:`mmpipe.models.pipeline_graph`) is served *whole-request*: each group of the
placement runs all three stages of a request (``graph.generate``), one request at a time, so its
output is bitwise what ``graph.generate`` gives for the seed; the groups are replicas, and a request
goes to the least loaded one. Its placement must give every stage the same groups.

A stage that raises fails only the request it ran for (a batch that raises is re-run request by
request to find it); the front end then tells the other groups to drop it. Cancelling, a client
disconnect or a timeout drops a request the same way.

A group whose worker dies (or whose loop raises) is restarted by the front end (:meth:`Engine._recover`,
run by the reader thread that notices it), and so is *every other group*: the live groups do not keep
their loaded weights. The groups are the ranks of one gloo process group, and gloo can neither shrink
nor abort one: the survivors' receiver threads stay blocked in receives on the old group (nothing
cancels them), a send to the dead rank blocks until gloo's timeout, and destroying a group with work
outstanding can hang. Re-forming the group inside the live processes would leak a blocked thread per
peer and restart and risk a hang at exit; fresh workers, forked from the preloading forkserver and
meeting on a new port with new queues, are always clean, for the price of loading the graph again
(a second or two for the tiny preset; a large pipeline reloads from the page cache). So a death
fails every unfinished request with error code ``worker_restarted`` and a message naming the dead
group; ``/health`` answers 503 ("restarting") until the new groups are ready, then 200 again. At most
``MAX_RESTARTS`` restarts within ``RESTART_WINDOW_S``: the next failure leaves the groups down and
``/health`` 503 with the cause, as does a failure while the engine closes.

On CUDA (``device=cuda``, or ``auto`` with a GPU visible) each group's worker computes on
``rank_device(CUDA, group)``, so groups share a GPU when there are fewer GPUs than groups; its
stages' modules are placed there in serving precision (text encoder and DiT bf16, VAE float32:
:mod:`mmpipe.serve.placement`), and with no placement given a GPU machine gets one group per GPU
running every stage. Tensors between groups are staged through host memory over the same gloo
transport (copied to the host before they are sent, to the device after they arrive); NCCL between
groups on distinct GPUs is not built. bf16 GEMMs and attention may pick another kernel, hence another
reduction order, for another batch size, so on CUDA batching keeps outputs close to, not bitwise,
those of a request alone (``tests/serve/test_engine_cuda.py`` bounds the difference). On CPU nothing
changes: float32, and bitwise outputs whatever the batching.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import io
import json
import logging
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml
from PIL import Image

from mmpipe.assemble.inference import (
    InferencePlacement,
    check_placement_for_model,
    latent_frames_of,
    parse_denoise_replicas,
)
from mmpipe.assemble.serve_planning import serving_placement
from mmpipe.config import DataConfig, ServeConfig, StepCacheConfig, to_dict
from mmpipe.data import caption_vocabulary, frames_to_uint8
from mmpipe.devices import DeviceType, rank_device, resolve_device
from mmpipe.errors import ServeStartError, cause, loading_errors
from mmpipe.models.loading import from_diffusers
from mmpipe.models.pipeline_graph import FAMILY_MODULES, PipelineGraph, check_family_dir, family_class
from mmpipe.models.wan import check_pipeline_dir, is_wan21_t2v, save_tiny_wan_pipeline
from mmpipe.parallel.denoise import DenoiseGroup, DenoiseLayout
from mmpipe.report.recording import MemorySampler
from mmpipe.rundir import load_run_config, pipeline_dir
from mmpipe.runtime import procs
from mmpipe.runtime.events import EventRecorder
from mmpipe.runtime.inference import configure_denoiser, place_replica
from mmpipe.runtime.launch import free_port
from mmpipe.runtime.trained import check_trained_run, load_trained_graph
from mmpipe.runtime.transport import HEADER_LEN, isend_tensors, nbytes, parse_header
from mmpipe.sched.plan import Action, ActionKind
from mmpipe.serve.batching import make_row_exact
from mmpipe.serve.metrics import ServeMetrics
from mmpipe.serve.placement import load_wan_pipeline, place_stages, resolve_placement
from mmpipe.serve.protocol import WORKER_RESTARTED, GenerationRequest, Job, JobStatus, QueueFull
from mmpipe.stages.sampler import guidance_on, guide, initial_noise

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0
EXIT_GRACE_S = 10.0  # how long an ending worker gets before the next, harder signal
# A restart ends the surviving workers quickly: their requests have failed already, and a worker
# blocked in a gloo call to the dead peer runs no signal handler until SIGKILL.
RESTART_GRACE_S = 2.0
MAX_RESTARTS = 3  # restarts within RESTART_WINDOW_S; one more failure and the engine stays down (503)
RESTART_WINDOW_S = 600.0
_TAG = 7  # the p2p tag of serving messages
_CONTEXT, _LATENTS = 1, 2  # message kinds between groups


GraphFactory = Callable[[dict[str, Any]], Any]  # (source spec) -> T2VGraph, run in each worker


def default_graph(spec: dict[str, Any]) -> Any:
    """The inference graph of a source spec: a trained run (``ckpt``), or a pipeline directory (on
    CUDA loaded in serving precision, as diffusers loads it; see :mod:`mmpipe.serve.placement`)."""

    if spec.get("ckpt"):
        return load_trained_graph(Path(spec["ckpt"]))
    with loading_errors(f"pipeline={str(spec['pipeline'])!r}"):
        if spec.get("family"):  # whole-request serving; place_stages moves its modules
            return from_diffusers(spec["pipeline"], max_sequence_length=spec.get("text_len"))
        if spec.get("device", "cpu") == DeviceType.CUDA:
            pipe = load_wan_pipeline(spec["pipeline"])
            return from_diffusers(pipe, max_sequence_length=spec["text_len"])
        return from_diffusers(spec["pipeline"], max_sequence_length=spec["text_len"])


@dataclasses.dataclass
class _Route:
    text: int
    denoise: int
    decode: int

    @property
    def groups(self) -> set[int]:
        return {self.text, self.denoise, self.decode}


@dataclasses.dataclass
class _Tracked:
    job: Job
    number: int
    route: _Route
    deadline: float


class Engine:
    """The front end's handle on the worker groups (see the module docstring)."""

    def __init__(
        self, cfg: ServeConfig, *, metrics: Any | None = None, graph_factory: GraphFactory | None = None
    ) -> None:
        if metrics is None:
            metrics = ServeMetrics()
        self.device = resolve_device(cfg.device, key="device")  # before anything is written or started
        #: the pipeline class of a family served whole-request (None: Wan 2.1, pipelined by stage)
        self.family = _whole_request_family(cfg)
        #: what a request renders: "image" for image families, else "video"
        self.output = family_class(self.family).output if self.family else "video"
        #: whether requests may / must carry an input image (image-to-video families)
        self.image_input = family_class(self.family).image_argument() if self.family else None
        #: replicas of several ranks running whole requests together (placement.denoise as a
        #: mapping): each replica's ranks, and the layout of one
        self.replicas: list[tuple[int, ...]] = []
        self.layout: DenoiseLayout | None = None
        self.parallel_decode = False  # placement.decode names every replica rank
        cfg = self._placed(cfg)
        self.cfg = cfg
        self.world = max(cfg.groups, 1 + max((r for ranks in self.replicas for r in ranks), default=0))
        self.model_id = cfg.model_name
        self.metrics = metrics
        self._tmp: str | None = None
        self._spec = self._source_spec(cfg) | {"device": self.device.value}
        self._check_whole_request(cfg)
        self.run_dir = Path(cfg.run_dir or f"runs/serve-{time.strftime('%Y%m%d-%H%M%S')}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        saved = dataclasses.replace(cfg, api_key="<redacted>" if cfg.api_key else None)  # never written down
        (self.run_dir / "serve.yaml").write_text(yaml.safe_dump(to_dict(saved), sort_keys=False))
        self._lock = threading.Lock()
        self._jobs: dict[str, _Tracked] = {}
        self._by_number: dict[int, _Tracked] = {}
        self._numbers = iter(range(1, 1 << 62))
        self._load = collections.Counter[tuple[str, int]]()  # (stage, group) -> unfinished requests
        self._closing = False
        self._closed = False
        self.healthy = True
        self.restarting = False  # the groups are being restarted (healthy is False meanwhile)
        self.fatal: str | None = None
        self._gave_up = False  # MAX_RESTARTS were used up: the engine stays unhealthy
        self._restarts = collections.deque[float]()  # monotonic times of the recent restarts
        self._graph_factory = graph_factory
        self._procs: list[Any] = []
        self._inboxes: list[Any] = []
        self._outbox: Any = None
        try:
            self._start_groups()
        except BaseException as err:
            self._kill(exiting=[err.group] if isinstance(err, ServeStartError) and err.group is not None else [])
            self._remove_tmp()
            raise
        self._reader = threading.Thread(target=self._read_loop, name="mmpipe-serve-reader", daemon=True)
        self._reader.start()
        self._watcher = threading.Thread(target=self._watch_loop, name="mmpipe-serve-timeouts", daemon=True)
        self._watcher.start()

    # ---- set-up ------------------------------------------------------------------------------
    def _placed(self, cfg: ServeConfig) -> ServeConfig:
        """``cfg`` with the placement to run: the device's default when none was given."""

        gpus = torch.cuda.device_count() if self.device is DeviceType.CUDA else 0
        if cfg.placement == "auto":
            cfg = dataclasses.replace(cfg, placement=self._planned(cfg))
        assert not isinstance(cfg.placement, str)
        den = cfg.placement.get("denoise") if cfg.placement is not None else None
        if isinstance(den, dict):  # replicas of parallel ranks, each running whole requests
            self.layout, self.replicas = parse_denoise_replicas(den)
            leaders = [ranks[0] for ranks in self.replicas]
            assert cfg.placement is not None
            every = sorted(r for ranks in self.replicas for r in ranks)
            for stage in ("text", "decode"):
                given = cfg.placement.get(stage)
                given = [given] if isinstance(given, int) else given
                if stage == "decode" and given is not None and sorted(given) == every and len(every) > len(leaders):
                    self.parallel_decode = True  # each replica's ranks decode its videos by row bands
                elif given is not None and sorted(given) != sorted(leaders):
                    also = f", or every denoise rank {every} (a decode split by rows)" if stage == "decode" else ""
                    raise ValueError(
                        f"placement.{stage}={given}: each replica of placement.denoise runs its requests' "
                        f"{stage} on its first rank: {leaders}{also} (or leave placement.{stage} out)"
                    )
            return dataclasses.replace(cfg, placement={s: list(leaders) for s in ("text", "denoise", "decode")})
        if self.cfg_needs_whole(cfg):
            raise ValueError(
                f"cache.policy={cfg.cache.policy!r} / compile=true: the Wan 2.1 graph's step-batched serving "
                "calls the DiT on mixed requests; serve whole requests with a replica placement, e.g. "
                "placement={denoise: {ranks: [0, 1], dp: 2}}"
            )
        if self.family is None:
            return dataclasses.replace(cfg, placement=resolve_placement(cfg.placement, self.device, gpus))
        if cfg.placement is None:  # replicas: every group runs every stage
            groups = list(range(2 if self.device is DeviceType.CPU else max(1, gpus)))
            return dataclasses.replace(cfg, placement={s: list(groups) for s in ("text", "denoise", "decode")})
        for stage in ("text", "decode"):
            if sorted(cfg.placement[stage]) != sorted(cfg.placement["denoise"]):
                raise ValueError(
                    f"placement.{stage}={cfg.placement[stage]}: {self.family} is served whole-request, so every "
                    f"stage needs the groups of placement.denoise={cfg.placement['denoise']}"
                )
        return cfg

    def _planned(self, cfg: ServeConfig) -> dict[str, Any]:
        """``placement=auto``: the serving planner's choice for the default request on this machine's
        cores (``mmpipe plan mode=serve cluster=local``), logged with its prediction."""
        if self.device is not DeviceType.CPU:
            raise ValueError("placement=auto plans CPU ranks today; name a placement on CUDA")
        if cfg.pipeline or cfg.ckpt:
            raise ValueError(
                "placement=auto plans the model preset (model=...); for pipeline= / ckpt= run "
                "mmpipe plan mode=serve model=... cluster=local and pass its placement"
            )
        sizes = DataConfig(frames=cfg.frames, height=cfg.height, width=cfg.width)
        model = dataclasses.replace(cfg.model, video=None)
        placement, plan = serving_placement(
            model, sizes, nproc=os.cpu_count() or 1, steps=cfg.steps, guidance=cfg.guidance
        )
        logger.info(
            "placement=auto: %s (predicted %.3f s a request, %.2f requests/s)",
            placement,
            plan.latency_s,
            plan.requests_per_s,
        )
        return placement

    def cfg_needs_whole(self, cfg: ServeConfig) -> bool:
        """Whether ``cfg`` asks for something only whole-request serving runs (a step cache and
        compilation wrap one request's loop) while the Wan 2.1 graph would batch steps."""
        return self.family is None and (cfg.cache.policy != "none" or cfg.compile)

    def _check_whole_request(self, cfg: ServeConfig) -> None:
        """A replica placement and the step cache checked against the model's config files (heads,
        whole-frame patches, the family's hooks, the default frame count) before any worker starts."""
        if self.layout is None:
            return
        if self.device is not DeviceType.CPU and self.layout.size > 1:
            raise ValueError(
                "placement.denoise: replicas of several ranks run on CPU ranks (gloo) today; use device=cpu"
            )
        if "ckpt" in self._spec:
            root = pipeline_dir(load_run_config(Path(self._spec["ckpt"])).model, Path(self._spec["ckpt"]))
        else:
            root = Path(self._spec["pipeline"])
        decode = self.replicas[0] if self.parallel_decode else self.replicas[0][:1]
        placement = InferencePlacement(self.world, self.replicas[0][0], self.replicas[0], self.layout, decode)
        check_placement_for_model(placement, root, latent_frames_of(root, cfg.frames), cache_policy=cfg.cache.policy)

    @property
    def _placement(self) -> dict[str, Any]:
        """stage -> the groups that run it (resolved by _placed: never None)."""
        assert isinstance(self.cfg.placement, dict)
        return self.cfg.placement

    def _source_spec(self, cfg: ServeConfig) -> dict[str, Any]:
        """What each worker builds its graph from, checked here so that a bad directory is refused
        before any worker starts."""

        if cfg.ckpt:
            check_trained_run(Path(cfg.ckpt))
            if load_run_config(Path(cfg.ckpt)).model.kind == "u2g":
                raise ValueError(
                    f"ckpt={cfg.ckpt!r} is an understand-then-generate run (an image and an instruction in): "
                    "serving takes text-to-video runs; render it with mmpipe generate image=FILE"
                )
            return {"ckpt": cfg.ckpt}
        if cfg.pipeline:
            if self.family is not None:  # text_len unset: the pipeline's own default
                return {"pipeline": cfg.pipeline, "family": self.family, "text_len": cfg.text_len or None}
            check_pipeline_dir(cfg.pipeline)
            return {"pipeline": cfg.pipeline, "text_len": cfg.text_len or 512}  # WanPipeline.__call__'s default

        family = {"family": self.family} if self.family else {}
        if cfg.model.path is not None:
            check_pipeline_dir(cfg.model.path, key="model.path")
            return {"pipeline": cfg.model.path, "text_len": cfg.text_len or cfg.model.text_len} | family
        if cfg.model.kind != "t2v":
            raise ValueError(f"model.kind={cfg.model.kind!r}: mmpipe serve serves text-to-video graphs (t2v)")
        self._tmp = tempfile.mkdtemp(prefix="mmpipe-serve-")
        path = save_tiny_wan_pipeline(cfg.model, [*caption_vocabulary(), "blurry static"], self._tmp, seed=0)
        return {"pipeline": str(path), "text_len": cfg.text_len or cfg.model.text_len} | family

    def _start_groups(self) -> None:
        """Start one worker per group and wait until each is ready. Every start (the first, and each
        restart) gets a fresh rendezvous port and fresh queues, so nothing a previous generation of
        workers left behind (a half-formed gloo group, unread messages) reaches the new one."""

        cfg = self.cfg
        ctx = procs.context([__name__])
        world = self.world
        init = {
            "port": free_port(),
            "world": world,
            "threads": cfg.threads or max(1, (os.cpu_count() or 1) // world),
            "run_dir": str(self.run_dir),
            "env": procs.environment(),
            "device": self.device.value,
        }
        options = {k: getattr(cfg, k) for k in ("max_batch", "max_wait_ms", "compile")} | {
            "placement": cfg.placement,
            "cache": dataclasses.asdict(cfg.cache),
            "replicas": [list(r) for r in self.replicas],
            "layout": dataclasses.asdict(self.layout) if self.layout is not None else None,
            "parallel_decode": self.parallel_decode,
        }
        outbox, inboxes = ctx.Queue(), [ctx.Queue() for _ in range(world)]
        workers = [
            ctx.Process(
                target=_worker_main,
                args=(g, init, self._spec, options, self._graph_factory, inboxes[g], outbox),
                name=f"mmpipe-serve-group{g}",
                daemon=True,
            )
            for g in range(world)
        ]
        with self._lock:  # submit and _finish put into the inboxes under the lock: never into retired ones
            retired = [*self._inboxes, *([self._outbox] if self._outbox is not None else [])]
            self._procs, self._inboxes, self._outbox = workers, inboxes, outbox
        for q in retired:
            q.cancel_join_thread()  # its reader is gone: exiting must not wait to flush it
            q.close()
        for p in workers:
            p.start()
        self._wait_ready()

    def _wait_ready(self) -> None:
        ready: set[int] = set()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(ready) < len(self._procs):
            if self._closing:  # only a restart can see this: close() needs a started engine
                raise ServeStartError("the engine closed while its serving groups were restarting")
            try:
                msg = self._outbox.get(timeout=0.2)
            except queue.Empty:
                dead = [g for g, p in enumerate(self._procs) if not p.is_alive()]
                if dead and self._outbox.empty():
                    raise ServeStartError(
                        f"serving group {dead[0]} exited while starting (exit code {self._procs[dead[0]].exitcode})"
                    ) from None
                if time.monotonic() > deadline:
                    raise ServeStartError(f"serving groups not ready after {READY_TIMEOUT_S:.0f} s") from None
                continue
            if msg[0] == "ready":
                ready.add(msg[1])
            elif msg[0] == "fatal":
                raise ServeStartError(f"serving group {msg[1]} failed to start: {msg[2]}", group=msg[1])

    def placement_text(self) -> str:
        """Which stages each device group (worker process, rank) runs, and on which GPU."""
        lines = []
        for g in range(self.world):
            stages = [s for s, groups in self._placement.items() if g in groups]
            replica = next((r for r in self.replicas if g in r), None)
            if replica is not None and len(replica) > 1 and self.layout is not None:
                lay = self.layout
                degrees = ", ".join(f"{k}={getattr(lay, k)}" for k in ("cfg", "ring", "ulysses") if getattr(lay, k) > 1)
                role = "leader: text, decode; " if g == replica[0] else ""
                stages = [f"{role}denoise over ranks {list(replica)} ({degrees})"]
            gpu = f", {rank_device(self.device, g)}" if self.device is DeviceType.CUDA else ""
            lines.append(f"group {g} (rank {g}, pid {self._procs[g].pid}{gpu}): {', '.join(stages)}")
        return "\n".join(lines)

    # ---- requests ----------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> Job:
        """Queue ``request``; raises :class:`QueueFull` when ``serve.max_queue`` jobs are unfinished."""
        with self._lock:
            if self._closing or not self.healthy:
                raise RuntimeError(self.fatal or "the server is shutting down")
            unfinished = sum(1 for t in self._jobs.values() if not t.job.status.done)
            if unfinished >= self.cfg.max_queue:
                self.metrics.request_finished("rejected")
                raise QueueFull(self.cfg.max_queue, retry_after=self._retry_after(unfinished))
            if self.family is not None or self.replicas:  # whole-request: one group (replica) runs every stage
                group = self._least_loaded("denoise", None)
                route = _Route(group, group, group)
            else:
                text = self._least_loaded("text", None)
                denoise = self._least_loaded("denoise", text)
                route = _Route(text, denoise, self._least_loaded("decode", denoise))
            job = Job(request)
            number = next(self._numbers)
            timeout = request.timeout_s or self.cfg.timeout_s
            tracked = _Tracked(job, number, route, time.monotonic() + timeout)
            self._jobs[job.id] = tracked
            self._by_number[number] = tracked
            for stage in ("text", "denoise", "decode"):
                self._load[(stage, getattr(route, stage))] += 1
            self.metrics.set_queue_depth(unfinished + 1)
            payload = ("submit", number, dataclasses.asdict(request), dataclasses.asdict(route))
            for g in sorted(route.groups):  # under the lock: a restart swaps the inboxes under it
                self._inboxes[g].put(payload)
        return job

    def _least_loaded(self, stage: str, previous: int | None) -> int:
        """The group of ``stage`` with the fewest unfinished requests; among equals, the group of the
        request's previous stage (its tensors then stay in the process), then the lowest index."""
        groups = self._placement[stage]
        return min(groups, key=lambda g: (self._load[(stage, g)], g != previous, g))

    def _retry_after(self, unfinished: int) -> float:
        done = [t.job for t in self._jobs.values() if t.job.status is JobStatus.COMPLETED and t.job.started_at]
        recent = sorted(done, key=lambda j: j.completed_at or 0)[-16:]
        if not recent:
            return 1.0
        per_job = float(np.mean([(j.completed_at or 0) - (j.started_at or 0) for j in recent]))
        return max(1.0, per_job * unfinished / max(1, len(self._placement["denoise"]) * self.cfg.max_batch))

    def get(self, job_id: str) -> Job | None:
        tracked = self._jobs.get(job_id)
        return tracked.job if tracked else None

    def cancel(self, job_id: str) -> bool:
        """Cancel a job (its work is dropped in every group); False when unknown or already final."""
        tracked = self._jobs.get(job_id)
        if tracked is None:
            return False
        return self._finish(tracked, JobStatus.CANCELLED)

    def _finish(self, tracked: _Tracked, status: JobStatus, *, drop: bool = True, **kw: Any) -> bool:
        """Move a job to its final status; unless it completed (or not ``drop``), its groups drop its work."""
        with self._lock:
            if not tracked.job.finish(status, **kw):
                return False
            for stage in ("text", "denoise", "decode"):
                self._load[(stage, getattr(tracked.route, stage))] -= 1
            self.metrics.request_finished(status.value)
            self.metrics.set_queue_depth(sum(1 for t in self._jobs.values() if not t.job.status.done))
            if drop and status is not JobStatus.COMPLETED:
                for g in sorted(tracked.route.groups):
                    self._inboxes[g].put(("drop", tracked.number))
        self._forget_old()
        return True

    def _forget_old(self) -> None:
        """Keep the newest ``serve.keep_results`` finished jobs (their frames can be large)."""
        with self._lock:
            finished = [t for t in self._jobs.values() if t.job.status.done]
            for t in sorted(finished, key=lambda t: t.job.completed_at or 0)[: -self.cfg.keep_results]:
                del self._jobs[t.job.id]
                del self._by_number[t.number]

    # ---- messages from the groups ------------------------------------------------------------
    def _read_loop(self) -> None:
        """Messages from the groups until the engine closes; a group that dies or fails restarts them."""
        while not self._closed:
            try:
                msg = self._outbox.get(timeout=0.2)
            except queue.Empty:
                dead = [g for g, p in enumerate(self._procs) if not p.is_alive()]
                if dead and not self._closing and not self._gave_up:
                    self._recover(f"serving group {dead[0]} died (exit code {self._procs[dead[0]].exitcode})")
                continue
            except (EOFError, OSError):
                return
            if msg[0] == "fatal":
                if self._gave_up:  # a dying survivor's last word: the engine is down for a known cause
                    continue
                cause = self._cause(msg[1], msg[2])
                if self._closing:
                    self._fail_all(cause)
                else:
                    self._recover(cause)
            else:
                self._on_message(msg)

    def _on_message(self, msg: tuple[Any, ...]) -> None:
        """Metrics, and the progress and end of the requests."""
        kind = msg[0]
        if kind == "stage":
            self.metrics.observe_stage(*msg[1:])
            return
        if kind == "edge":
            self.metrics.edge_bytes(*msg[1:])
            return
        tracked = self._by_number.get(msg[1])
        if tracked is None or tracked.job.status.done:
            return
        if kind == "started":
            tracked.job.status = JobStatus.IN_PROGRESS
            tracked.job.started_at = tracked.job.started_at or time.time()
        elif kind == "progress":
            tracked.job.progress = max(tracked.job.progress, int(msg[2]))
        elif kind == "done":
            self._finish(tracked, JobStatus.COMPLETED, frames=msg[2])
        elif kind == "failed":
            self._finish(tracked, JobStatus.FAILED, error=msg[2])

    def _cause(self, group: int, message: str) -> str:
        """What to report for a group's fatal error: a peer that died makes the survivors' transport
        fail too, so the dead group (if one dies within a second) is the cause, not the reporter."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            dead = [g for g, p in enumerate(self._procs) if g != group and not p.is_alive()]
            if dead:
                return f"serving group {dead[0]} died (exit code {self._procs[dead[0]].exitcode})"
            time.sleep(0.05)
        return f"serving group {group} failed: {message}"

    def _fail_all(self, message: str, code: str | None = None) -> None:
        """Stay unhealthy with ``message`` as the cause, and fail every unfinished request with it."""
        logger.error(message)
        with self._lock:
            self.healthy, self.fatal = False, message
        self._fail_unfinished(message, code)

    def _fail_unfinished(self, message: str, code: str | None) -> None:
        # The groups that held these requests are ending: no drop messages to them.
        for tracked in list(self._jobs.values()):
            self._finish(tracked, JobStatus.FAILED, drop=False, error=message, code=code)

    def _recover(self, cause: str) -> None:
        """Restart every group after one died or failed (the module docstring says why every group):
        each unfinished request fails with ``worker_restarted``; new requests are refused (503) until
        the new groups are ready. After MAX_RESTARTS restarts within RESTART_WINDOW_S, or when the
        engine is closing, the groups stay down and the engine unhealthy, with the cause."""
        while True:
            logger.error("%s: restarting the serving groups", cause)
            with self._lock:
                self.healthy, self.restarting, self.fatal = False, True, f"{cause}; restarting the serving groups"
            self._fail_unfinished(f"{cause} while this request was in flight; retry it", WORKER_RESTARTED)
            self._kill(exiting=range(len(self._procs)), grace=RESTART_GRACE_S, stop=True)
            now = time.monotonic()
            while self._restarts and now - self._restarts[0] > RESTART_WINDOW_S:
                self._restarts.popleft()
            if len(self._restarts) >= MAX_RESTARTS or self._closing:
                why = "the engine is closing" if self._closing else self._restart_limit_text()
                with self._lock:
                    self._gave_up, self.restarting = True, False
                self._fail_all(f"{cause}; not restarted: {why}")
                return
            self._restarts.append(now)
            self.metrics.worker_restarted()
            try:
                self._start_groups()
            except ServeStartError as err:
                cause = f"restarting the serving groups failed: {err}"
                continue
            logger.warning("serving groups restarted after: %s", cause)
            with self._lock:
                self.healthy, self.restarting, self.fatal = True, False, None
            return

    def _restart_limit_text(self) -> str:
        return f"{MAX_RESTARTS} restarts within {RESTART_WINDOW_S:.0f} s already (the limit)"

    def _watch_loop(self) -> None:
        while not self._closed:
            now = time.monotonic()
            for tracked in list(self._jobs.values()):
                if not tracked.job.status.done and now > tracked.deadline:
                    timeout = tracked.job.request.timeout_s or self.cfg.timeout_s
                    self._finish(tracked, JobStatus.FAILED, error=f"timed out after {timeout:g} s")
            time.sleep(0.05)

    # ---- shutdown ----------------------------------------------------------------------------
    def close(self, drain: bool = True) -> None:
        """Stop: with ``drain``, new requests are refused and in-flight ones finish first."""
        if self._closed:
            return
        with self._lock:
            self._closing = True
        if drain:
            for tracked in list(self._jobs.values()):
                remaining = tracked.deadline - time.monotonic()
                tracked.job.wait(max(0.0, remaining) + 1.0)
        for tracked in list(self._jobs.values()):
            self._finish(tracked, JobStatus.CANCELLED)
        self._closed = True
        # A restart under way sees _closing and stops within its kill's grace: then _procs is final.
        self._reader.join(timeout=3 * EXIT_GRACE_S)
        self._kill(exiting=range(len(self._procs)), stop=True)
        self._remove_tmp()

    def _kill(self, exiting: Sequence[int] = (), *, grace: float = EXIT_GRACE_S, stop: bool = False) -> None:
        """End the workers. Those in ``exiting`` have announced that they are ending (with ``stop``:
        are told to now) and get ``grace`` seconds to do so; the others get SIGTERM, which a worker
        turns into an orderly exit, then SIGKILL. An orderly exit runs the worker's exit handlers,
        which unlink the named semaphores it created (tqdm's lock, for one); killed mid-way, it leaves
        them to the resource tracker, which warns about leaked semaphores on the user's terminal when
        the front end exits."""
        with self._lock:
            workers, inboxes = list(self._procs), list(self._inboxes)
        if stop:
            for inbox in inboxes:
                inbox.put(("stop",))
        deadline = time.monotonic() + grace
        for g in exiting:
            workers[g].join(timeout=max(0.0, deadline - time.monotonic()))
        for p in workers:
            if p.is_alive():
                p.terminate()
        for p in workers:
            p.join(timeout=grace)
            if p.is_alive():
                p.kill()
                p.join()

    def _remove_tmp(self) -> None:
        """Remove the tiny preset's pipeline directory, if this engine wrote one."""
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(drain=False)


# ==== the worker side =========================================================================
def _worker_main(
    group: int,
    init: dict[str, Any],
    spec: dict[str, Any],
    options: dict[str, Any],
    graph_factory: GraphFactory | None,
    inbox: Any,
    outbox: Any,
) -> None:
    """Entry point of one group's process."""

    procs.adopt_environment(init["env"])

    # A terminal's Ctrl-C reaches the whole process group: the front end drains, then sends "stop".
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM (the front end ending a worker, see Engine._kill) exits through the exit handlers.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    logging.basicConfig(level=logging.INFO, format=f"[serve group {group}] %(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(init["threads"])
    try:
        if init["world"] > 1:
            torch.distributed.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{init['port']}",
                rank=group,
                world_size=init["world"],
                timeout=datetime.timedelta(seconds=600),
            )
        device = _group_device(DeviceType(init["device"]), group)
        graph = (graph_factory or default_graph)(spec)
        place_stages(graph, device, {s for s, groups in options["placement"].items() if group in groups})
        replica = None
        if options["layout"] is not None and options["layout"] != dataclasses.asdict(DenoiseLayout()):
            layout = DenoiseLayout(**options["layout"])
            for ranks in options["replicas"]:  # collective: every rank creates every replica's groups, in order
                made = DenoiseGroup(layout, ranks)
                if made.member:
                    replica = made
            assert replica is not None
            place_replica(graph, replica, parallel_decode=options["parallel_decode"])
        configure_denoiser(graph, StepCacheConfig(**options["cache"]), compile=options["compile"])
        worker = _GroupWorker(
            group, init["world"], graph, options, inbox, outbox, Path(init["run_dir"]), device, replica=replica
        )
    except Exception as err:
        # The cause goes to the front end (one line); the traceback to a file it names, not the terminal.
        log = Path(init["run_dir"]) / f"serve-group{group}-start-error.txt"
        log.write_text(traceback.format_exc())
        outbox.put(("fatal", group, f"{cause(err)} (traceback: {log})"))
        sys.exit(1)  # the queue's feeder thread is joined at exit: the message is sent before this process ends
    outbox.put(("ready", group))
    try:
        worker.loop()
    except Exception as err:
        outbox.put(("fatal", group, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        raise
    finally:
        worker.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _group_device(device: DeviceType, group: int) -> torch.device:
    """The device of a group's worker, made current (kernels launched without a device run there)."""
    placed = rank_device(device, group)
    if placed.type == "cuda":
        torch.cuda.set_device(placed)
    return placed


@dataclasses.dataclass
class _Request:
    number: int
    request: GenerationRequest
    route: _Route
    arrived: float = dataclasses.field(default_factory=time.perf_counter)


@dataclasses.dataclass
class _Denoising:
    number: int
    cond: torch.Tensor
    uncond: torch.Tensor | None
    latents: torch.Tensor
    scheduler: Any
    guidance: float
    key: tuple[Any, ...]
    ready: float
    step: int = 0
    last_run: float = 0.0


class _GroupWorker:
    """One group's loop: control messages, p2p messages, then at most one batch per stage."""

    def __init__(
        self,
        group: int,
        world: int,
        graph: Any,
        options: dict[str, Any],
        inbox: Any,
        outbox: Any,
        run_dir: Path,
        device: torch.device,
        *,
        replica: DenoiseGroup | None = None,
    ) -> None:

        self.group, self.world, self.graph, self.device = group, world, graph, device
        #: the parallel replica this group is a rank of (None: it runs requests alone)
        self.replica = replica
        self.parallel_decode: bool = options.get("parallel_decode", False)
        self.inbox, self.outbox = inbox, outbox
        self.max_batch: int = options["max_batch"]
        self.max_wait = options["max_wait_ms"] / 1e3
        placement = options["placement"]
        self.stages = {s for s, groups in placement.items() if group in groups}
        # a family, or a replica placement: served whole-request
        self.whole = isinstance(graph, PipelineGraph) or bool(options["replicas"])
        self.whole_queue: collections.deque[int] = collections.deque()
        if not self.whole:
            self.dit_dtype: torch.dtype = graph.denoise.module.dtype
            if "denoise" in self.stages:
                make_row_exact(graph.denoise.module)
        self.requests: dict[int, _Request] = {}
        self.dropped: set[int] = set()
        self.text_queue: collections.deque[int] = collections.deque()
        self.contexts: dict[int, tuple[list[torch.Tensor], float]] = {}  # arrived before the request
        self.latents_in: dict[int, tuple[torch.Tensor, float]] = {}
        self.active: dict[int, _Denoising] = {}
        self.decode_queue: collections.deque[tuple[int, torch.Tensor, float]] = collections.deque()
        # Every batch and transfer as an action event (phase "serve", mb = the request's number), and
        # memory samples: what `mmpipe report RUN_DIR` reads, as for a training run.
        self.recorder = EventRecorder(run_dir, group)
        self.recorder.phase = "serve"
        self.record_lock = threading.Lock()
        self.memory = MemorySampler(run_dir, group, lambda: 0)
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()  # ("control" | "p2p", message)
        self.stopping = False
        threading.Thread(target=self._forward_inbox, name="inbox", daemon=True).start()
        for peer in range(world):
            if peer != group:
                threading.Thread(target=self._receive_from, args=(peer,), name=f"recv{peer}", daemon=True).start()

    def _record(self, stage: str, kind: str, number: int, start: float, nbytes: int = 0, **extra: Any) -> None:

        action = Action(stage, ActionKind(kind), number, extra.pop("dst", None), extra.pop("peer", None))
        with self.record_lock:
            self.recorder.record(action, start, time.perf_counter(), nbytes, **extra)

    def close(self) -> None:
        """Flush the events and stop the memory sampler."""
        with self.record_lock:
            self.recorder.close()
        self.memory.close()

    # ---- transport ---------------------------------------------------------------------------
    def _receive_from(self, peer: int) -> None:
        """Receiver thread of one peer: whole messages, in order, into the loop's event queue. (Gloo's
        point-to-point works report completion only from ``wait()``, so a thread blocks on them.)"""

        try:
            while True:
                header = torch.empty(HEADER_LEN, dtype=torch.int64)
                torch.distributed.recv(header, src=peer, tag=_TAG)
                start = time.perf_counter()  # the message has begun to arrive (waiting is idle, not transfer)
                tensors = []
                for dtype, shape in parse_header(header):
                    t = torch.empty(shape, dtype=dtype)
                    if t.numel():
                        torch.distributed.recv(t, src=peer, tag=_TAG)
                    tensors.append(t)
                kind, number = (int(v) for v in tensors[0].tolist())
                src, dst = ("text", "denoise") if kind == _CONTEXT else ("denoise", "decode")
                self._record(src, "RECV", number, start, nbytes(tensors[1:]), dst=dst, peer=peer)
                self.events.put(("p2p", tensors))
        except Exception as err:  # the peer is gone: the front end sees the dead process
            if not self.stopping:
                logger.warning("receiving from group %d stopped: %s", peer, err)

    def _send(self, dst: int, kind: int, number: int, tensors: list[torch.Tensor], edge: str) -> None:

        self.outbox.put(("edge", edge, nbytes(tensors)))
        if dst == self.group:
            self._deliver(kind, number, tensors)
            return
        start = time.perf_counter()
        # gloo moves host tensors only: a device tensor is staged through host memory (no NCCL here).
        message = [torch.tensor([kind, number], dtype=torch.int64), *(t.cpu() for t in tensors)]
        for work in isend_tensors(message, dst=dst, tag=_TAG):
            work.wait()  # the peer's receiver thread is always posted: this returns at once
        src_stage, dst_stage = edge.split("->")
        self._record(src_stage, "SEND", number, start, nbytes(tensors), dst=dst_stage, peer=dst)

    def _deliver(self, kind: int, number: int, tensors: list[torch.Tensor]) -> None:
        if number in self.dropped:
            return
        if kind == _CONTEXT:
            self.contexts[number] = (tensors, time.perf_counter())
        else:
            self.latents_in[number] = (tensors[0], time.perf_counter())
        self._admit(number)

    def _admit(self, number: int) -> None:
        """Move a request whose inputs and parameters have both arrived into its stage's queue."""
        req = self.requests.get(number)
        if req is None:
            return
        if number in self.contexts and req.route.denoise == self.group:
            tensors, ready = self.contexts.pop(number)
            self.active[number] = self._start_denoising(req, tensors, ready)
        if number in self.latents_in and req.route.decode == self.group:
            latents, ready = self.latents_in.pop(number)
            self.decode_queue.append((number, latents, ready))

    # ---- control -----------------------------------------------------------------------------
    def _forward_inbox(self) -> None:
        """Control messages from the front end, into the loop's event queue."""
        while True:
            try:
                msg = self.inbox.get()
            except (EOFError, OSError):  # the front end is gone
                msg = ("stop",)
            self.events.put(("control", msg))
            if msg[0] == "stop":
                return

    def _handle(self, event: tuple[str, Any]) -> None:
        source, msg = event
        if source == "p2p":
            kind, number = (int(v) for v in msg[0].tolist())
            self._deliver(kind, number, [t.to(self.device) for t in msg[1:]])  # arrived on the host
        elif msg[0] == "submit":
            _, number, request, route = msg
            req = _Request(number, GenerationRequest(**request), _Route(**route))
            self.requests[number] = req
            if self.whole:
                if req.route.denoise == self.group:
                    self.whole_queue.append(number)
            elif req.route.text == self.group:
                self.text_queue.append(number)
            self._admit(number)
        elif msg[0] == "drop":
            self._drop(msg[1])
        elif msg[0] == "stop":
            self.stopping = True

    def _drop(self, number: int) -> None:
        self.dropped.add(number)
        self.requests.pop(number, None)
        self.contexts.pop(number, None)
        self.latents_in.pop(number, None)
        self.active.pop(number, None)
        if number in self.text_queue:
            self.text_queue.remove(number)
        if number in self.whole_queue:
            self.whole_queue.remove(number)
        self.decode_queue = collections.deque(e for e in self.decode_queue if e[0] != number)

    def _fail(self, number: int, stage: str, err: BaseException) -> None:
        logger.warning("request %d failed in stage %s: %s", number, stage, err)
        self.outbox.put(("failed", number, f"stage {stage!r} failed: {type(err).__name__}: {err}"))
        self._drop(number)

    # ---- the loop ----------------------------------------------------------------------------
    @property
    def _leads(self) -> bool:
        """Whether this group leads a replica of several ranks (it tells the others what to run)."""
        return self.replica is not None and len(self.replica.ranks) > 1 and self.replica.ranks[0] == self.group

    def loop(self) -> None:
        """Handle every waiting event, run at most one batch per stage; block while there is no work.
        A replica's other ranks follow its leader instead (:meth:`_follow`)."""
        if self.replica is not None and self.replica.ranks[0] != self.group:
            self._follow()
            return
        try:
            self._loop()
        finally:
            if self._leads and self.stopping:
                self._command(("stop",))

    def _command(self, command: tuple[Any, ...]) -> None:
        assert self.replica is not None
        dist.broadcast_object_list([command], src=self.replica.ranks[0], group=self.replica.group)

    def _follow(self) -> None:
        """A replica rank that is not its leader: run each request the leader broadcasts, as its
        share of the parallel denoiser (text arrives from the leader; the leader decodes)."""
        assert self.replica is not None
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=self.replica.ranks[0], group=self.replica.group)
            if box[0][0] == "stop":
                return
            _, call, seed = box[0]
            output = "np" if self.parallel_decode else "latent"  # decode bands with the leader, or stop before
            try:
                with torch.no_grad():
                    self.graph.generate(**call, seed=seed, output_type=output, progress=False)
            except Exception as err:  # the leader fails the request (it raised the same there)
                logger.warning("replica request failed: %s", err)

    def _loop(self) -> None:
        timeout: float | None = 0.0
        while not self.stopping:
            try:
                event = self.events.get(timeout=timeout) if timeout != 0.0 else self.events.get_nowait()
                while True:
                    self._handle(event)
                    event = self.events.get_nowait()
            except queue.Empty:
                pass
            if self.stopping:
                return
            ran = self._run_whole()
            ran |= self._run_text()
            ran |= self._run_denoise_step()
            ran |= self._run_decode()
            if not ran:
                with self.record_lock:
                    self.recorder.flush()  # before blocking: the run directory is current when idle
            timeout = 0.0 if ran else self._idle_timeout()

    def _idle_timeout(self) -> float | None:
        """How long to block for events: until a waiting DiT batch's ``max_wait_ms`` runs out, or for
        as long as nothing arrives."""
        if not self.active:
            return None
        first = min(d.ready for d in self.active.values())
        return max(0.0005, first + self.max_wait - time.perf_counter())

    def _take(self, q: collections.deque[Any]) -> list[Any]:
        return [q.popleft() for _ in range(min(self.max_batch, len(q)))]

    def _run_whole(self) -> bool:
        """One request of a family served whole-request: ``graph.generate`` with its parameters."""
        if not self.whole_queue:
            return False
        number = self.whole_queue.popleft()
        req = self.requests[number]
        r = req.request
        self.outbox.put(("started", number))
        start = time.perf_counter()
        family = self.graph.family if isinstance(self.graph, PipelineGraph) else None
        output = family.output if family is not None else "video"
        call: dict[str, Any] = {
            "prompt": r.prompt,
            "negative_prompt": r.negative_prompt or None,
            "height": r.height,
            "width": r.width,
            "num_inference_steps": r.steps,
            # classifier-free guidance's scale, whatever the family names it
            (family.cfg_argument if family is not None else "guidance_scale"): r.guidance,
        }
        if output == "video":
            call["num_frames"] = r.frames
        try:
            if r.image is not None:
                call["image"] = Image.open(io.BytesIO(r.image)).convert("RGB")
            if self._leads:
                if family is not None:
                    self.graph.bind(**call)  # refused here, before the other ranks start on it
                self._command(("run", call, r.seed))
            with torch.no_grad():
                out = self.graph.generate(**call, seed=r.seed, output_type="np", progress=False)
            frames = frames_to_uint8(out[0] if output == "video" else out[0][None])
        except Exception as err:
            self._fail(number, "denoise", err)
            return True
        self.outbox.put(("done", number, frames))
        self.requests.pop(number, None)
        self.outbox.put(("stage", "denoise", start - req.arrived, time.perf_counter() - start, 1))
        self._record("denoise", "F", number, start, batch=1)
        return True

    def _run_text(self) -> bool:
        if not self.text_queue:
            return False
        batch = self._take(self.text_queue)
        start = time.perf_counter()
        text = self.graph.text
        for number in batch:
            req = self.requests[number]
            r = req.request
            self.outbox.put(("started", number))
            try:
                # Exactly graph.generate's call: the prompt, then the negative prompt when guided.
                inputs = self.graph.prompt_inputs([r.prompt], r.negative_prompt, r.guidance)
                with torch.no_grad():
                    out = text(inputs)
            except Exception as err:
                self._fail(number, "text", err)
                continue
            tensors = [out["context"]] + ([out["negative_context"]] if "negative_context" in out else [])
            self.outbox.put(("progress", number, 5))
            self._send(req.route.denoise, _CONTEXT, number, tensors, "text->denoise")
        ready = min((self.requests[n].arrived for n in batch if n in self.requests), default=start)
        self.outbox.put(("stage", "text", start - ready, time.perf_counter() - start, len(batch)))
        self._record("text", "F", batch[0], start, batch=len(batch))
        return True

    def _start_denoising(self, req: _Request, tensors: list[torch.Tensor], ready: float) -> _Denoising:
        g, r = self.graph, req.request
        shape = g.latent_shape(1, r.frames, r.height, r.width)
        noise = initial_noise(shape, r.seed).to(self.device)  # graph.generate's noise for the seed
        scheduler = g.denoise.scheduler_for(r.steps, noise.device)
        dtype = self.dit_dtype
        uncond = tensors[1].to(dtype) if guidance_on(r.guidance) else None
        key = (shape, uncond is not None, tuple(tensors[0].shape))
        return _Denoising(req.number, tensors[0].to(dtype), uncond, noise, scheduler, r.guidance, key, ready)

    def _run_denoise_step(self) -> bool:
        if not self.active:
            return False
        now = time.perf_counter()
        first = min(self.active.values(), key=lambda d: (d.last_run, d.ready))
        peers = [d for d in self.active.values() if d.key == first.key]
        if first.step == 0 and len(peers) < self.max_batch and now - first.ready < self.max_wait:
            if not any(d.step > 0 for d in self.active.values()):
                return False  # nothing running yet: give the batch max_wait_ms to fill
        batch = sorted(peers, key=lambda d: (d.last_run, d.ready))[: self.max_batch]
        start = time.perf_counter()
        try:
            preds = self._dit(batch)
        except Exception:
            preds = []
            for d in list(batch):  # find the request that fails; the others go on
                try:
                    preds += self._dit([d])
                except Exception as err:
                    batch.remove(d)
                    self._fail(d.number, "denoise", err)
        for d, pred in zip(batch, preds, strict=True):
            t = d.scheduler.timesteps[d.step]
            try:
                d.latents = d.scheduler.step(pred, t, d.latents, return_dict=False)[0]
            except Exception as err:
                self._fail(d.number, "denoise", err)
                continue
            d.step += 1
            d.last_run = time.perf_counter()
            total = len(d.scheduler.timesteps)
            self.outbox.put(("progress", d.number, 5 + int(85 * d.step / total)))
            if d.step == total:
                del self.active[d.number]
                req = self.requests[d.number]
                self._send(req.route.decode, _LATENTS, d.number, [d.latents], "denoise->decode")
        queue_s = start - first.ready if first.step == 0 else 0.0
        self.outbox.put(("stage", "denoise", queue_s, time.perf_counter() - start, len(batch)))
        if batch:
            self._record("denoise", "F", batch[0].number, start, batch=len(batch))
        return True

    def _dit(self, batch: list[_Denoising]) -> list[torch.Tensor]:
        """One DiT forward over the batch's conditional rows then unconditional rows."""
        module = self.graph.denoise.module
        dtype = self.dit_dtype
        x = torch.cat([d.latents.to(dtype) for d in batch])
        ts = torch.cat([d.scheduler.timesteps[d.step].expand(1) for d in batch])
        ctx = torch.cat([d.cond for d in batch])
        guided = batch[0].uncond is not None
        if guided:
            x, ts = torch.cat([x, x]), torch.cat([ts, ts])
            ctx = torch.cat([ctx, torch.cat([d.uncond for d in batch if d.uncond is not None])])
        with torch.no_grad():
            out = module(hidden_states=x, timestep=ts, encoder_hidden_states=ctx, return_dict=False)[0]
        n = len(batch)
        preds = []
        for i, d in enumerate(batch):
            pred = out[i : i + 1]
            if guided:
                pred_u = out[n + i : n + i + 1]
                pred = guide(pred, pred_u, d.guidance)
            preds.append(pred)
        return preds

    def _run_decode(self) -> bool:
        if not self.decode_queue:
            return False

        batch = self._take(self.decode_queue)
        start = time.perf_counter()
        g = self.graph
        for number, latents, _ in batch:
            try:
                with torch.no_grad():
                    video = g.decode({"latents": latents})["video"]
                frames = g.video_processor.postprocess_video(video, output_type="np")[0]
                self.outbox.put(("done", number, frames_to_uint8(frames)))
            except Exception as err:
                self._fail(number, "decode", err)
                continue
            self.requests.pop(number, None)
        self.outbox.put(("stage", "decode", start - min(e[2] for e in batch), time.perf_counter() - start, len(batch)))
        self._record("decode", "F", batch[0][0], start, batch=len(batch))
        return True


def _whole_request_family(cfg: ServeConfig) -> str | None:
    """The pipeline class of the served pipeline when it is a family served whole-request (anything
    but Wan 2.1 text-to-video: a ``pipeline`` directory's, a trained run's or ``model``'s, a
    two-expert tiny preset included), checked from its ``model_index.json`` before anything starts."""
    if cfg.ckpt:
        if not (Path(cfg.ckpt) / "config.yaml").is_file():
            return None  # check_trained_run names what is wrong
        model = load_run_config(Path(cfg.ckpt)).model
        source = str(pipeline_dir(model, Path(cfg.ckpt)))
    elif cfg.pipeline:
        source = cfg.pipeline
    elif cfg.model.path is not None:
        source = cfg.model.path
    else:
        return "WanPipeline" if cfg.model.boundary_ratio is not None else None
    if not (Path(source) / "model_index.json").is_file():
        return None  # the source's own check names what is wrong
    root = check_family_dir(source)
    meta = json.loads((root / "model_index.json").read_text())
    name = str(meta["_class_name"])
    assert name in FAMILY_MODULES  # check_family_dir refuses the others
    return None if is_wan21_t2v(meta) else name
