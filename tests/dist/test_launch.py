"""Launching workers: the CLI with launch.nproc, a SIGKILLed worker restarted by the elastic agent,
and a two-"node" run on localhost with torchrun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from cli_here import mmpipe_here
from diffusers import WanTransformer3DModel

from mmpipe.rundir import latest_checkpoint, read_metrics
from mmpipe.runtime.checkpoint import load_latest_weights
from mmpipe.runtime.events import read_events
from mmpipe.runtime.launch import free_port

SMALL = [
    "data.frames=9",
    "data.height=32",
    "data.width=32",
    "data.num_samples=64",
    "data.val_samples=4",
    "train.batch_size=4",
    "train.micro_batches=2",
    "train.progress=false",
    "train.threads=1",
    "train.val_every=1000",
    "launch.timeout_s=60",
]
PIPELINE = "placement={text:[0],vae:[0],dit:[1]}"


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "mmpipe.cli", *args]


def dit_params(run_dir: Path) -> dict[str, torch.Tensor]:
    model = WanTransformer3DModel.from_pretrained(run_dir / "pipeline" / "transformer")
    load_latest_weights(run_dir, {"dit": model})
    return model.state_dict()


def test_cli_launches_two_ranks_and_rejects_bad_placements(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    res = subprocess.run(
        cli("train", f"run_dir={run}", "launch.nproc=2", PIPELINE, "train.steps=2", *SMALL),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "text->dit:SEND:mb0@r1" in res.stdout  # the plan table is printed before workers start
    assert {e["rank"] for e in read_events(run)} == {0, 1}
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2]
    bad = ("train", f"run_dir={tmp_path / 'bad'}", "launch.nproc=2", "placement={text:[0],vae:[0],dit:[5]}", *SMALL)
    code, err = mmpipe_here(*bad, cwd=tmp_path, capsys=capsys)
    assert code == 2 and "placement.dit: ranks [5] outside launch.nproc=2" in err
    assert not (tmp_path / "bad").exists()


def _worker_pids(parent: int) -> list[int]:
    """The training ranks under a ``mmpipe train`` process: the children of its forkserver."""
    servers = [p for p in psutil.Process(parent).children() if "forkserver" in " ".join(p.cmdline())]
    return [w.pid for server in servers for w in server.children()]


def test_sigkilled_worker_restarts_and_finishes_identically(tmp_path: Path) -> None:
    steps = ["train.steps=24", "train.ckpt_every=4"]
    ref = tmp_path / "ref"
    subprocess.run(
        cli("train", f"run_dir={ref}", "launch.nproc=2", PIPELINE, *steps, *SMALL),
        check=True,
        timeout=300,
        capture_output=True,
    )
    run = tmp_path / "run"
    proc = subprocess.Popen(
        cli("train", f"run_dir={run}", "launch.nproc=2", "launch.max_restarts=1", PIPELINE, *steps, *SMALL),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 240
    while time.time() < deadline and (latest_checkpoint(run) is None or latest_checkpoint(run).name < "step_00000008"):
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.05)
    victims = _worker_pids(proc.pid)
    assert len(victims) == 2, victims
    os.kill(victims[-1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "resumed from" in out
    pr, pg = dit_params(ref), dit_params(run)
    assert all(torch.equal(pr[k], pg[k]) for k in pr)
    assert [r["loss"] for r in read_metrics(run)[1:]] == [r["loss"] for r in read_metrics(ref)[1:]]


def test_two_nodes_on_localhost(tmp_path: Path) -> None:
    port = free_port()
    run = tmp_path / "run"
    args = ["train.steps=2", f"run_dir={run}", "launch.nproc=2", PIPELINE, *SMALL]
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(node),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "two-nodes",
                "-m",
                "mmpipe.train.worker",
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(2)
    ]
    outs = [n.communicate(timeout=300)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(o[-2000:] for o in outs)
    assert {e["rank"] for e in read_events(run)} == {0, 1}
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2]


def test_dead_worker_without_restarts_is_a_clean_error(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = subprocess.Popen(
        cli("train", f"run_dir={run}", "launch.nproc=2", PIPELINE, "train.steps=500", *SMALL),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (run / "metrics.jsonl").is_file():
        time.sleep(0.05)
    time.sleep(0.5)
    victims = _worker_pids(proc.pid)
    assert len(victims) == 2, victims
    os.kill(victims[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "mmpipe train: training worker rank 0 failed (exit code -9): Signal 9 (SIGKILL)" in err
