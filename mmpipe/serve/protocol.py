"""What the HTTP front end and the serving engine exchange: requests, jobs and their states.

The front end (``mmpipe.serve.app``) turns an OpenAI-shaped request into a validated
:class:`GenerationRequest` and hands it to :class:`mmpipe.serve.engine.Engine`; the engine owns the
:class:`Job` (status, progress, result frames) until the front end reads it.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
import uuid

import numpy as np

# The error code of a request that failed because its serving group died (the engine restarted the
# groups): nothing is wrong with the request, and the client may retry it.
WORKER_RESTARTED = "worker_restarted"


class JobStatus(enum.StrEnum):
    """A job's life: queued -> in_progress -> completed | failed | cancelled (OpenAI's video statuses,
    plus ``cancelled``)."""

    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def done(self) -> bool:
        return self in (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One video (``frames`` > 1) or image (``frames`` == 1) to render; every field already validated."""

    prompt: str
    negative_prompt: str = ""
    height: int = 64
    width: int = 64
    frames: int = 17
    steps: int = 20
    guidance: float = 3.0
    seed: int = 0
    timeout_s: float | None = None  # None: the engine's serve.timeout_s
    image: bytes | None = None  # image-to-video: the input image (``input_reference``) as PNG bytes


class QueueFull(RuntimeError):
    """The engine holds ``serve.max_queue`` unfinished jobs; retry after ``retry_after`` seconds."""

    def __init__(self, limit: int, retry_after: float) -> None:
        super().__init__(f"the server holds {limit} unfinished requests (serve.max_queue); retry later")
        self.retry_after = retry_after


@dataclasses.dataclass
class Job:
    """A request's state as the engine tracks it; ``frames`` is ``(T, H, W, 3)`` uint8 once completed."""

    request: GenerationRequest
    id: str = dataclasses.field(default_factory=lambda: f"video_{uuid.uuid4().hex}")
    status: JobStatus = JobStatus.QUEUED
    progress: int = 0  # percent, 0..100
    created_at: float = dataclasses.field(default_factory=time.time)
    started_at: float | None = None
    completed_at: float | None = None
    error: str | None = None
    error_code: str | None = None  # why it failed, for clients (e.g. WORKER_RESTARTED); None: a stage's error
    frames: np.ndarray | None = None
    _done: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job is completed, failed or cancelled; False on timeout."""
        return self._done.wait(timeout)

    def finish(
        self,
        status: JobStatus,
        *,
        frames: np.ndarray | None = None,
        error: str | None = None,
        code: str | None = None,
    ) -> bool:
        """Move to a final status (once; later calls are ignored and return False)."""
        if self.status.done:
            return False
        self.status, self.frames, self.error, self.error_code = status, frames, error, code
        if status is JobStatus.COMPLETED:
            self.progress = 100
        self.completed_at = time.time()
        self._done.set()
        return True
