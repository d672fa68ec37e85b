"""``mmpipe generate device=...``: the placement the GPU path uses, checked on CPU.

The CUDA placement itself is :func:`place_module` with bf16; its dtypes are compared here, on CPU,
with what diffusers' and transformers' ``from_pretrained(torch_dtype=...)`` load, and a float32
checkpoint loaded into the bf16 DiT is compared with the cast weights. The GPU run is
``tests/unit/test_generate_cuda.py``.
"""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from diffusers import DiffusionPipeline

import mmpipe
from mmpipe.config import GenerateConfig, RunConfig, to_dict
from mmpipe.models.wan import component_dtypes, place_module
from mmpipe.runtime.checkpoint import load_latest_weights

CALL = dict(prompt="a red circle moving left", negative_prompt="blurry static", height=32, width=48, num_frames=9)


def _dtypes(module: torch.nn.Module) -> dict[str, torch.dtype]:
    return {n: t.dtype for n, t in itertools.chain(module.named_parameters(), module.named_buffers())}


def test_cuda_dtypes_are_those_diffusers_loads(tiny_wan_dir: Path) -> None:
    """bf16 text encoder and DiT, the DiT's keep-in-fp32 modules (norms, time embedder, modulation
    tables) float32, the VAE float32: tensor for tensor what ``from_pretrained(dtype=...)`` gives."""
    dtypes = component_dtypes("cuda")
    ref = DiffusionPipeline.from_pretrained(tiny_wan_dir, dtype={**dtypes, "default": torch.float32})
    ours = DiffusionPipeline.from_pretrained(tiny_wan_dir)
    for component, dtype in dtypes.items():
        placed = place_module(getattr(ours, component), "cpu", dtype)
        assert _dtypes(placed) == _dtypes(getattr(ref, component)), component
        for name, t in getattr(ref, component).state_dict().items():  # the same rounding
            assert torch.equal(placed.state_dict()[name], t), (component, name)
    dit = _dtypes(ours.transformer)
    assert dit["scale_shift_table"] == dit["blocks.0.norm2.weight"] == torch.float32
    assert dit["blocks.0.attn1.to_q.weight"] == torch.bfloat16
    assert ours.transformer.dtype == torch.bfloat16  # what the denoiser casts its inputs to


def test_placing_on_cpu_keeps_float32_and_the_frames_bitwise(tiny_wan_dir: Path) -> None:
    stock = mmpipe.from_diffusers(tiny_wan_dir)
    placed = mmpipe.from_diffusers(tiny_wan_dir, device="cpu")
    for stage in ("text", "denoise", "decode"):
        assert set(_dtypes(placed.stages[stage].module).values()) == {torch.float32}, stage
        assert placed.stages[stage].device() == torch.device("cpu")
    call = CALL | {"num_inference_steps": 2, "seed": 5, "progress": False}
    assert np.array_equal(placed.generate(**call), stock.generate(**call))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, by design
def test_a_float32_checkpoint_loads_into_the_bf16_dit(tiny_wan_dir: Path, tmp_path: Path) -> None:
    """What ``load_trained_graph`` does on CUDA: DCP copies the saved float32 weights into the placed
    module, each rounded once to its dtype (bitwise the cast of the float32 weights)."""
    trained = DiffusionPipeline.from_pretrained(tiny_wan_dir).transformer
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01)  # differ from the pipeline's weights
    ckpt = tmp_path / "checkpoints" / "step_00000001"
    dcp.save({"step": 1, "stages": {"dit": {"model": trained.state_dict()}}}, checkpoint_id=ckpt)
    (ckpt.parent / "latest").write_text(ckpt.name + "\n")
    dit = place_module(DiffusionPipeline.from_pretrained(tiny_wan_dir).transformer, "cpu", torch.bfloat16)
    load_latest_weights(tmp_path, {"dit": dit})
    expected = place_module(trained, "cpu", torch.bfloat16).state_dict()
    for name, t in dit.state_dict().items():
        assert t.dtype == expected[name].dtype and torch.equal(t, expected[name]), name


def _trained_run(tmp_path: Path, pipeline: Path) -> Path:
    """A run directory that passes ``check_trained_run`` (config, pipeline, checkpoint marker)."""
    run = tmp_path / "run"
    shutil.copytree(pipeline, run / "pipeline")
    cfg = to_dict(RunConfig(run_dir=str(run)))
    cfg["model"]["path"] = str(run / "pipeline")
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run / "checkpoints" / "step_00000001").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_00000001\n")
    return run


def test_device_cuda_without_a_gpu_is_refused_before_anything_loads_or_is_written(
    tiny_wan_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mmpipe import generate as gen

    run = _trained_run(tmp_path, tiny_wan_dir)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU machine, wherever this runs

    def loaded(*args: object, **kwargs: object) -> None:
        raise AssertionError("the run was loaded")

    monkeypatch.setattr(gen, "load_trained_graph", loaded)
    cfg = GenerateConfig(ckpt=str(run), device="cuda", out=str(tmp_path / "out"))
    with pytest.raises(ValueError, match=r"^device=cuda, but this machine has no usable CUDA device"):
        gen.generate(cfg)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
