"""Self-healing serving: a serving group's worker SIGKILLed mid-request is restarted by the engine.

The tiny Wan pipeline (``tiny_wan_dir``) on two groups with group 1 on every request's route
(``text: [0], denoise: [1], decode: [0]``), behind the HTTP front end. The in-flight request fails
with ``worker_restarted``, ``/health`` is 503 while the groups restart and 200 again within 60 s,
and the same request gives bitwise the same frames after the restart as before it. Then, with the
restart budget spent, a second death leaves the engine down with the cause in ``/health``. No
worker process outlives ``Engine.close``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil
import pytest
from serve_doubles import call, running_server

from mmpipe.config import ServeConfig
from mmpipe.serve import engine as engine_module
from mmpipe.serve.engine import Engine
from mmpipe.serve.protocol import WORKER_RESTARTED, GenerationRequest, Job, JobStatus

QUICK = GenerationRequest(prompt="a red circle moving left", height=32, width=32, frames=5, steps=4, seed=7)
SLOW = GenerationRequest(prompt="a blue square moving up", height=64, width=64, frames=17, steps=100, seed=1)


def until(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def completed_frames(engine: Engine, request: GenerationRequest) -> np.ndarray:
    job = engine.submit(request)
    assert job.wait(60), "the request did not finish"
    assert job.status is JobStatus.COMPLETED, job.error
    assert job.frames is not None
    return job.frames


def kill_mid_denoise(engine: Engine, group: int) -> tuple[Job, int]:
    """Submit SLOW, wait until its DiT (group 1) has run a step, SIGKILL ``group``'s worker."""
    job = engine.submit(SLOW)
    assert until(lambda: job.progress > 5, 30), "the slow request never reached the DiT"
    pid = engine._procs[group].pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    return job, pid


def gone(pid: int) -> bool:
    """The process has ended (a zombie not yet reaped by its parent, the forkserver, counts)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_killed_group_is_restarted_and_serves_the_same_frames(
    tiny_wan_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = ServeConfig(
        pipeline=str(tiny_wan_dir),
        run_dir=str(tmp_path / "run"),
        text_len=16,
        placement={"text": [0], "denoise": [1], "decode": [0]},
        threads=1,
        max_batch=4,
    )
    engine = Engine(cfg)
    pids = {p.pid for p in engine._procs}
    try:
        with running_server(engine) as url:
            before = completed_frames(engine, QUICK)
            job, _ = kill_mid_denoise(engine, 1)
            killed = time.monotonic()
            assert job.wait(30), "the in-flight request was not failed"
            failed_s = time.monotonic() - killed
            assert job.status is JobStatus.FAILED and job.error_code == WORKER_RESTARTED
            assert "serving group 1 died" in (job.error or "")
            code, _, body = call(url + "/health")
            assert code == 503 and json.loads(body)["status"] == "restarting", body
            video = json.loads(call(f"{url}/v1/videos/{job.id}")[2])
            assert video["status"] == "failed" and video["error"]["code"] == WORKER_RESTARTED
            assert until(lambda: call(url + "/health")[0] == 200, 60), engine.fatal
            print(
                f"restart: request failed {failed_s:.2f} s, /health 200 {time.monotonic() - killed:.2f} s after the kill"
            )
            pids |= {p.pid for p in engine._procs}
            assert len(pids) == 2 * cfg.groups  # every group is a new process
            assert np.array_equal(completed_frames(engine, QUICK), before)  # bitwise, as before the kill
            assert b"mmpipe_serve_worker_restarts_total 1.0" in engine.metrics.render()[0]

            # The budget spent, the next death leaves the engine down, with the cause.
            monkeypatch.setattr(engine_module, "MAX_RESTARTS", 1)
            job, _ = kill_mid_denoise(engine, 0)
            assert job.wait(30) and job.error_code == WORKER_RESTARTED
            assert until(lambda: engine._gave_up, 30)
            code, _, body = call(url + "/health")
            health = json.loads(body)
            assert code == 503 and health["status"] == "unhealthy"
            assert "serving group 0 died" in health["error"] and "not restarted" in health["error"], health
            with pytest.raises(RuntimeError, match="not restarted"):
                engine.submit(QUICK)
    finally:
        engine.close(drain=False)
    assert all(gone(pid) for pid in pids if pid is not None), "a serving worker outlived Engine.close"
