"""The ``mmpipe`` console script end to end, in subprocesses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from cli_here import mmpipe_here
from PIL import Image

from mmpipe.data import read_video
from mmpipe.rundir import read_metrics
from mmpipe.runtime.events import read_events

SMALL = [
    "data.frames=9",
    "data.height=32",
    "data.width=32",
    "data.val_samples=2",
    "train.batch_size=2",
    "train.micro_batches=2",
    "train.progress=false",
]


def mmpipe(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "mmpipe.cli", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_train_then_generate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    res = mmpipe("train", f"run_dir={run}", "train.steps=3", "train.ckpt_every=2", *SMALL, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "validation loss:" in res.stdout and "[dit] dit (trainable" in res.stdout
    assert (run / "metrics.jsonl").is_file() and (run / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    res = mmpipe("generate", f"ckpt={run}", "prompt=a green square moving up", "steps=2", "seed=3", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    gif = run / "samples" / "a-green-square-moving-up-seed3.gif"
    mp4 = gif.with_suffix(".mp4")
    assert f"gif: {gif}" in res.stdout and f"mp4: {mp4}" in res.stdout
    assert read_video(mp4).shape == (9, 32, 32, 3)
    assert read_video(gif).shape[1:] == (32, 32, 3)
    # the generation is a run of its own: one event per stage call and per denoiser call (2 steps,
    # guidance on: 2 branches each), memory samples and the trace, which `mmpipe report` reads
    record = run / "samples" / "a-green-square-moving-up-seed3-run"
    assert f"run: {record}" in res.stdout
    events = read_events(record)
    calls = Counter(e["stage"] for e in events)
    assert {e["phase"] for e in events} == {"generate"} and {e["kind"] for e in events} == {"F"}
    assert calls["denoise"] == 4 and calls["decode"] == 1 and calls["text"] >= 1, calls
    assert all(e["end"] >= e["start"] for e in events) and (record / "memory" / "rank0.jsonl").is_file()
    assert (record / "trace.json").is_file()
    res = mmpipe("report", str(record), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    html = (record / "report.html").read_text()
    assert "generation run (mmpipe generate)" in html and "denoise" in html
    check_eval(run, tmp_path, capsys)


def check_eval(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``mmpipe eval`` on a trained run: the table, one JSON line, eval.json, the contact sheet, the
    report's section; bad arguments exit 2 naming them, before anything is written."""
    res = mmpipe("eval", str(run), "--clips", "4", "--batch", "2", "--steps", "2", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["n"] == 4 and set(summary) >= {"color_acc", "direction_acc", "shape_acc", "vae_psnr_db"}
    assert "colour accuracy" in res.stdout and f"contact sheet: {run / 'eval' / 'contact_sheet.png'}" in res.stdout
    saved = json.loads((run / "eval" / "eval.json").read_text())
    assert [c["caption"] for c in saved["clips"]] == [
        "a red circle moving left",
        "a red circle moving right",
        "a red circle moving up",
        "a red circle moving down",
    ]
    assert all(isinstance(c["color_ok"], bool) for c in saved["clips"])
    # the packaged VAE on held-out 9 x 32 x 32 clips (19.3 dB measured; a random one 7.6 dB)
    assert summary["vae_psnr_db"] > 17, summary
    with Image.open(run / "eval" / "contact_sheet.png") as sheet:
        assert sheet.size[0] > 4 * 32 and sheet.size[1] > 32
    res = mmpipe("report", str(run), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    html = (run / "report.html").read_text()
    assert "Evaluation (mmpipe eval)" in html and "data:image/png;base64," in html
    no_ckpt = tmp_path / "no-ckpt"
    shutil.copytree(run, no_ckpt, ignore=shutil.ignore_patterns("checkpoints", "eval"))
    res = mmpipe("eval", str(tmp_path / "nope"), cwd=tmp_path)  # the console script's exit status
    assert res.returncode == 2 and f"run directory {str(tmp_path / 'nope')!r} does not exist" in res.stderr
    for args, message in [
        ([str(no_ckpt)], "the run has no checkpoint yet"),
        ([str(run), "--clips", "0"], "clips must be a positive integer, got 0"),
        ([str(run), "--steps", "x"], "argument --steps: invalid int value: 'x'"),
    ]:
        code, err = mmpipe_here("eval", *args, cwd=tmp_path, capsys=capsys)
        assert code == 2 and message in err, (args, err)
    assert not (no_ckpt / "eval").exists()


def test_u2g_run_generates_from_a_still_and_an_instruction(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Understand-then-generate, visible: a u2g run trains on stills + instructions, ``mmpipe eval``
    shows it each colour and shape's still with the four instructions, ``mmpipe generate`` takes a
    still (image=FILE) and an instruction, and the generation graph carries the run's trained LLM,
    connector and DiT (not the pipeline's initial weights)."""
    import torch

    from mmpipe.runtime.trained import load_trained_graph
    from mmpipe.stages.multimodal import Connector, ImageTextLM

    run = tmp_path / "u2g"
    res = mmpipe(
        "train",
        "model=u2g_tiny",
        f"run_dir={run}",
        "train.steps=2",
        "train.ckpt_every=2",
        "train.log_every=1",
        "train.lr_scale={llm:0.1}",
        *SMALL,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    last = read_metrics(run)[-1]  # train.lr_scale: the LLM's optimizer at a tenth of the others' rate
    assert last["lr/llm"] == pytest.approx(0.1 * last["lr/dit"]) and last["lr/connector"] == last["lr/dit"] > 0
    res = mmpipe("eval", str(run), "--clips", "8", "--batch", "4", "--steps", "2", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    saved = json.loads((run / "eval" / "eval.json").read_text())
    assert saved["task"] == "instruct" and saved["n"] == 8
    assert [(c["image"], c["caption"]) for c in saved["clips"][:4]] == [
        ("red circle", f"make it move {d}") for d in ("left", "right", "up", "down")
    ]
    assert {c["image"] for c in saved["clips"][4:]} == {"red square"}
    assert len({c["image_seed"] for c in saved["clips"]}) == 2  # one still per colour and shape
    still = tmp_path / "still.png"
    Image.new("RGB", (32, 32), (20, 20, 20)).save(still)
    res = mmpipe("generate", f"ckpt={run}", f"image={still}", "prompt=make it move up", "steps=2", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert read_video(run / "samples" / "make-it-move-up-seed0.mp4").shape == (9, 32, 32, 3)
    code, err = mmpipe_here("generate", f"ckpt={run}", "prompt=make it move up", cwd=tmp_path, capsys=capsys)
    assert code == 2 and "give the still it reads, image=FILE" in err, err
    code, err = mmpipe_here("serve", f"ckpt={run}", cwd=tmp_path, capsys=capsys)
    assert code == 2 and "serving takes text-to-video runs" in err, err

    graph = load_trained_graph(run)
    instruct = graph.instruct.module
    initial = {
        "llm": ImageTextLM.load(run / "pipeline" / "llm", graph.vision.source.config.hidden_size),
        "connector": Connector.load(run / "pipeline" / "connector"),
    }
    for name, module in initial.items():
        trained = dict(instruct[name].named_parameters())
        changed = [k for k, p in module.named_parameters() if not torch.equal(p, trained[k])]
        assert changed, f"{name}: the generation graph has the pipeline's initial weights"
    dit = graph.denoise.module
    dit_initial = type(dit).from_pretrained(run / "pipeline" / "transformer")
    assert any(not torch.equal(p, q) for p, q in zip(dit_initial.parameters(), dit.parameters(), strict=True))


def test_qwen_text_encoder_preset_trains(tmp_path: Path) -> None:
    res = mmpipe("train", f"run_dir={tmp_path / 'q'}", "model=t2v_tiny_qwen", "train.steps=2", *SMALL, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "Qwen2Model" in (tmp_path / "q" / "pipeline" / "model_index.json").read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "train.stepz=3"], "train.stepz"),
        (["train", "+train.stepz=3"], "unknown config key train.stepz"),
        (["train", "train.steps=abc"], "train.steps='abc': expected int"),
        (["train", "model=nope"], "Could not find 'model/nope'"),
        (["train", "data.frames=8"], "data.frames must be 4k+1"),
        (["generate", "ckpt=/nope"], "ckpt='/nope' is not a run directory"),
        (["fly"], "unknown command 'fly'"),
        (["train", "steps"], "override 'steps' is not key=value"),
        # checks that need the model's config (head and block counts) run before the run directory exists
        (["train", "launch.nproc=4", "parallel.dit.ulysses=3"], "ulysses=3"),
        (["train", "memory.dit.blocks=[keep]"], "memory.dit.blocks names 1 policies"),
        (
            ["train", "train.lr_scale={llm:0.1}"],
            "train.lr_scale.llm: no trainable stage 'llm'; trainable stages: ['dit']",
        ),
        (
            ["train", "launch.nproc=2", "placement={text:[0],vae:{ranks:[0,1],replicate:true},dit:[1]}"],
            "placement.vae.replicate=true: only a trainable stage over several ranks",
        ),
        (
            [
                "train",
                "launch.nproc=2",
                "placement={text:[0],vae:[0],dit:{ranks:[0,1],replicate:true,gather_once:true}}",
            ],
            "placement.dit: replicate=true keeps whole parameters on every rank; gather_once=true",
        ),
        (
            [
                "train",
                "data.frames=5",
                "launch.nproc=4",
                "placement={text:[0],vae:[0],dit:[0,1,2,3]}",
                "parallel.dit.ulysses=4",
            ],
            "gives 2 latent frames",
        ),
    ],
)
def test_bad_input_is_rejected_before_any_work(
    tmp_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # In this process (cli.main, as the console script runs it): the subprocess path is the tests
    # around this one (a corrupt model.path, mmpipe eval's bad arguments)
    extra = [f"run_dir={tmp_path / 'run'}"] if args[0] == "train" else []
    code, err = mmpipe_here(*args, *extra, cwd=tmp_path, capsys=capsys)
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()  # nothing was started or written


def test_unloadable_model_path_is_refused_before_any_work(tiny_wan_dir: Path, tmp_path: Path) -> None:
    """A corrupt weight file under model.path: exit status 2 naming the file, nothing written."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_wan_dir, broken)
    (broken / "text_encoder" / "model.safetensors").write_bytes(b"not safetensors")
    res = mmpipe("train", f"model.path={broken}", f"run_dir={tmp_path / 'run'}", *SMALL, cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert (
        f"model.path={str(broken)!r}: text_encoder/model.safetensors is not a readable safetensors file" in res.stderr
    )
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "run").exists()
