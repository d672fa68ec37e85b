"""Test helpers of the serving tests: an in-process engine double, a server in a thread, raw HTTP.

:class:`FakeEngine` implements the engine API the HTTP front end uses (``submit``, ``get``,
``cancel``, ``model_id``, ``cfg``, ``metrics``, ``healthy``, ``restarting``) without any model: a job's frames are
a pure function of its request, so the HTTP layer's encoding can be checked exactly. With
``hold=True`` jobs stay queued until :meth:`FakeEngine.release`.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mmpipe.config import ServeConfig
from mmpipe.serve.metrics import ServeMetrics
from mmpipe.serve.protocol import GenerationRequest, Job, JobStatus, QueueFull
from mmpipe.serve.server import HttpServer, bind

FAIL_PROMPT = "please fail"  # the double fails requests with this prompt, like a stage that raises


def fake_frames(r: GenerationRequest) -> np.ndarray:
    """Deterministic ``(T, H, W, 3)`` uint8 frames of a request: a gradient shifted by seed and frame."""
    t, y, x = np.meshgrid(np.arange(r.frames), np.arange(r.height), np.arange(r.width), indexing="ij")
    base = (3 * x + 5 * y + 17 * t + r.seed) % 256
    return np.stack([base, (base + 85) % 256, (base + 170) % 256], axis=-1).astype(np.uint8)


class FakeEngine:
    """The engine API over in-process jobs (see the module docstring)."""

    def __init__(self, cfg: ServeConfig, *, hold: bool = False) -> None:
        self.cfg, self.model_id, self.metrics = cfg, cfg.model_name, ServeMetrics()
        self.healthy: bool = True
        self.restarting: bool = False
        self.fatal: str | None = None
        self.output = "video"
        self.image_input: str | None = None
        self.hold = hold
        self.jobs: dict[str, Job] = {}
        self.submitted: list[Job] = []
        self._lock = threading.Lock()

    def submit(self, request: GenerationRequest) -> Job:
        with self._lock:
            if sum(not j.status.done for j in self.jobs.values()) >= self.cfg.max_queue:
                self.metrics.request_finished("rejected")
                raise QueueFull(self.cfg.max_queue, retry_after=2.5)
            job = Job(request)
            self.jobs[job.id] = job
            self.submitted.append(job)
        if not self.hold:
            self._complete(job)
        return job

    def release(self) -> None:
        """Complete every queued job."""
        for job in list(self.jobs.values()):
            if not job.status.done:
                self._complete(job)

    def _complete(self, job: Job) -> None:
        if job.request.prompt == FAIL_PROMPT:
            job.finish(JobStatus.FAILED, error="stage 'denoise' failed: RuntimeError: boom")
        else:
            job.finish(JobStatus.COMPLETED, frames=fake_frames(job.request))
        self.metrics.request_finished(job.status.value)

    def get(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)

    def cancel(self, job_id: str) -> bool:
        job = self.jobs.get(job_id)
        return job is not None and job.finish(JobStatus.CANCELLED)


@contextlib.contextmanager
def running_server(engine: Any) -> Iterator[str]:
    """Serve ``engine`` on a free port of 127.0.0.1 from a background thread; yields the base URL."""
    http = HttpServer(engine, bind("127.0.0.1", 0), log_level="warning").start()
    try:
        yield http.url
    finally:
        http.stop(force=True)
        assert http.join(timeout=10), "the HTTP server thread did not stop"


def call(
    url: str, method: str = "GET", body: Any = None, *, headers: dict[str, str] | None = None, timeout: float = 30
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request (JSON body unless bytes); returns (status, headers, body) for any status."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    for key, value in (headers or {}).items():
        req.add_header(key, value)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def error_of(body: bytes) -> dict[str, Any]:
    """The ``error`` object of an OpenAI-shaped error body."""
    return json.loads(body)["error"]


def graph_failing_on_prompt(spec: dict[str, Any]) -> Any:
    """The engine's graph whose text stage raises for :data:`FAIL_PROMPT` (a ``graph_factory``, run
    in each worker process: importable, so the spawned workers can unpickle it)."""
    from mmpipe.serve.engine import default_graph

    graph = default_graph(spec)
    tokenize = graph.text.tokenize

    def tokenize_or_raise(prompts: list[str], *args: Any, **kwargs: Any) -> Any:
        if FAIL_PROMPT in prompts:
            raise RuntimeError("injected fault for this prompt")
        return tokenize(prompts, *args, **kwargs)

    graph.text.tokenize = tokenize_or_raise
    return graph


def graph_failing_to_start(spec: dict[str, Any]) -> Any:
    """A ``graph_factory`` for a world of several groups: group 0 raises while building its graph;
    the others block until the front end ends them, and record in ``exited-group{g}`` beside the
    pipeline directory that their exit handlers ran (multiprocessing's finalizers, the ones that
    unlink a process's named semaphores)."""
    import multiprocessing.util

    import torch.distributed as dist

    group = dist.get_rank()
    if group == 0:
        raise RuntimeError("injected fault while building the graph")
    marker = Path(spec["pipeline"]).parent / f"exited-group{group}"
    multiprocessing.util.Finalize(None, marker.write_text, ("exit handlers ran",), exitpriority=0)
    time.sleep(600)
