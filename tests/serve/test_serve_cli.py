"""``mmpipe serve`` end to end in a subprocess: prints its URL and placement, serves, and on Ctrl-C
(SIGINT to its whole process group, as a terminal sends it) finishes the in-flight request, then
exits with status 0."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from serve_doubles import call

SMALL = ["port=0", "text_len=16", "threads=1", "height=32", "width=32", "frames=5", "steps=4"]


def test_serve_prints_url_and_drains_on_ctrl_c(tiny_wan_dir: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "mmpipe.cli", "serve", f"pipeline={tiny_wan_dir}", *SMALL]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True
    )
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in proc.stdout or []:
            lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        url = _wait_for_url(lines)
        assert re.match(r"group 0 \(rank 0.*\): text", lines.get(timeout=10))
        assert call(url + "/health")[0] == 200
        # An image request in flight when Ctrl-C arrives is answered before the server exits.
        answer: list[tuple[int, dict[str, str], bytes]] = []
        body = {"prompt": "in flight", "size": "64x64", "steps": 40, "seed": 1}
        client = threading.Thread(target=lambda: answer.append(call(url + "/v1/images/generations", "POST", body)))
        client.start()
        assert _until(lambda: _queue_depth(url) == 1), "the image request never reached the engine"
        os.killpg(proc.pid, signal.SIGINT)
        client.join(timeout=120)
        proc.wait(timeout=120)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert answer and answer[0][0] == 200, answer
    assert json.loads(answer[0][2])["data"][0]["b64_json"]
    assert proc.returncode == 0
    rest = [lines.get_nowait() for _ in range(lines.qsize())]
    ours = [line for line in rest if line.startswith("mmpipe serve:")]  # uvicorn's access log is interleaved
    assert ours[-1] == "mmpipe serve: stopped\n" and ours[-2].startswith("mmpipe serve: stopping: finishing"), rest


def _wait_for_url(lines: queue.Queue[str], timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = lines.get(timeout=deadline - time.monotonic())
        match = re.fullmatch(r"mmpipe serve: (http://127\.0\.0\.1:\d+)\n", line)
        if match:
            return match[1]
    raise AssertionError("mmpipe serve printed no URL")


def _queue_depth(url: str) -> float:
    text = call(url + "/metrics")[2].decode()
    for family in text_string_to_metric_families(text):
        if family.name == "mmpipe_serve_queue_depth":
            return family.samples[0].value
    return 0.0


def _until(predicate: object, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


def _serve(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "mmpipe.cli", "serve", *args, *SMALL]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_bad_pipeline_dir_is_refused_before_any_worker_starts(tiny_wan_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_wan_dir, broken, ignore=shutil.ignore_patterns("transformer"))
    res = _serve(f"pipeline={broken}", f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert f"mmpipe serve: error: pipeline={str(broken)!r}: the transformer folder is missing" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "run").exists()  # nothing was started or written


def test_a_group_that_fails_to_load_is_one_clear_error(tiny_wan_dir: Path, tmp_path: Path) -> None:
    """Weights that pass the directory check but do not fit their config: the group's cause in one
    line, exit status 1, and its traceback in the file the message names, not on the terminal."""
    mismatched = tmp_path / "mismatched"
    shutil.copytree(tiny_wan_dir, mismatched)
    config = mismatched / "transformer" / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"ffn_dim": 2048}))  # the weights' is 1024
    placement = "placement={text:[0],denoise:[0],decode:[0]}"
    res = _serve(f"pipeline={mismatched}", f"run_dir={tmp_path / 'run'}", placement, cwd=tmp_path)
    assert res.returncode == 1, res.stderr
    # The cause is the last line: nothing after it, such as the resource tracker's warning about the
    # semaphores of a worker killed before its exit handlers ran.
    assert "leaked semaphore" not in res.stderr
    line = res.stderr.strip().splitlines()[-1]
    cause = f"ValueError: pipeline={str(mismatched)!r}: cannot load it: ValueError: Cannot load"
    assert line.startswith(f"mmpipe serve: serving group 0 failed to start: {cause}"), res.stderr
    assert "Traceback" not in res.stderr
    log = tmp_path / "run" / "serve-group0-start-error.txt"
    assert line.endswith(f"(traceback: {log})")
    assert log.read_text().startswith("Traceback")
