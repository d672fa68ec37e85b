"""The directory checks that ``mmpipe serve``, ``generate`` and ``train model.path=`` run before any
worker starts or any weight loads: each bad directory gets a ``ValueError`` that names the key and
the cause, and the tiny pipeline saved with ``save_pretrained`` passes."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from mmpipe.config import RunConfig, to_dict
from mmpipe.models.wan import check_pipeline_dir
from mmpipe.runtime.trained import check_trained_run
from mmpipe.stages import WanDiTFlowMatchingStage


def _copy(src: Path, dst: Path) -> Path:
    """``src``'s model_index.json and empty component folders (the check reads no weights)."""
    dst.mkdir()
    shutil.copy(src / "model_index.json", dst / "model_index.json")
    for child in src.iterdir():
        if child.is_dir():
            (dst / child.name).mkdir()
    return dst


def _edit_index(root: Path, edit: Callable[[dict], None]) -> None:
    meta = json.loads((root / "model_index.json").read_text())
    edit(meta)
    (root / "model_index.json").write_text(json.dumps(meta))


def test_saved_tiny_pipeline_passes(tiny_wan_dir: Path, tmp_path: Path) -> None:
    assert check_pipeline_dir(tiny_wan_dir) == tiny_wan_dir
    assert check_pipeline_dir(_copy(tiny_wan_dir, tmp_path / "p")) == tmp_path / "p"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda r: (r / "model_index.json").unlink(), "no model_index.json"),
        (lambda r: (r / "model_index.json").write_text("{bad"), "model_index.json is not readable JSON"),
        (lambda r: (r / "model_index.json").write_text("[1, 2]"), "model_index.json is not a JSON object"),
        (lambda r: _edit_index(r, lambda m: m.pop("_class_name")), "_class_name=None is not supported"),
        (
            lambda r: _edit_index(r, lambda m: m.update(_class_name="FluxPipeline")),
            "_class_name='FluxPipeline' is not supported; supported: \\['WanPipeline'\\]",
        ),
        (
            lambda r: _edit_index(r, lambda m: m.update(transformer_2=["diffusers", "WanTransformer3DModel"])),
            "two-expert Wan 2.2",
        ),
        (lambda r: _edit_index(r, lambda m: m.update(boundary_ratio=0.9)), "two-expert Wan 2.2"),
        (lambda r: _edit_index(r, lambda m: m.update(expand_timesteps=True)), "expand_timesteps=True"),
        (lambda r: _edit_index(r, lambda m: m.pop("vae")), "names no vae"),
        (lambda r: _edit_index(r, lambda m: m.update(tokenizer=[None, None])), "names no tokenizer"),
        (lambda r: shutil.rmtree(r / "transformer"), "the transformer folder is missing"),
    ],
    ids=[
        "no-index",
        "bad-json",
        "not-object",
        "no-class",
        "other-pipeline",
        "two-expert",
        "boundary",
        "ti2v",
        "no-vae",
        "null-tokenizer",
        "no-transformer-dir",
    ],
)
def test_bad_pipeline_dir_is_refused(
    tiny_wan_dir: Path, tmp_path: Path, damage: Callable[[Path], None], message: str
) -> None:
    root = _copy(tiny_wan_dir, tmp_path / "p")
    damage(root)
    with pytest.raises(ValueError, match=message) as err:
        check_pipeline_dir(root, key="model.path")
    assert str(err.value).startswith(f"model.path={str(root)!r}")


@pytest.mark.parametrize("kind", ["junk", "truncated"])
def test_unreadable_weights_are_refused(tiny_wan_dir: Path, tmp_path: Path, kind: str) -> None:
    """Safetensors headers are read (not the weights): a junk or truncated file is named."""
    root = _copy(tiny_wan_dir, tmp_path / "p")
    name = "diffusion_pytorch_model.safetensors"
    whole = (tiny_wan_dir / "transformer" / name).read_bytes()
    (root / "transformer" / name).write_bytes(b"junk" if kind == "junk" else whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=f"transformer/{name} is not a readable safetensors file"):
        check_pipeline_dir(root)
    (root / "transformer" / name).write_bytes(whole)
    check_pipeline_dir(root)


def test_a_stage_that_cannot_load_names_its_class_and_directory(tiny_wan_dir: Path, tmp_path: Path) -> None:
    """Loading is lazy (on the rank that runs the stage); its error names the class and folder."""
    root = tmp_path / "p"
    shutil.copytree(tiny_wan_dir, root)
    config = root / "transformer" / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"ffn_dim": 2048}))  # the weights' is 1024
    stage = WanDiTFlowMatchingStage.from_pretrained("dit", root / "transformer", shift=3.0)
    where = f"WanTransformer3DModel from {str(root / 'transformer')!r}"
    with pytest.raises(ValueError, match=f"^{re.escape(where)}: cannot load it: ValueError: Cannot load"):
        _ = stage.module


def _run_dir(tmp_path: Path, pipeline: Path) -> Path:
    """A run directory whose config points at ``pipeline`` (model.path), without checkpoints."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = to_dict(RunConfig(run_dir=str(run)))
    cfg["model"]["path"] = str(pipeline)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    return run


def test_trained_run_checks(tiny_wan_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not an mmpipe run directory \\(no config.yaml\\)"):
        check_trained_run(tmp_path)
    pipeline = _copy(tiny_wan_dir, tmp_path / "p")
    run = _run_dir(tmp_path, pipeline)
    with pytest.raises(ValueError, match=f"ckpt={str(run)!r}: the run has no checkpoint yet"):
        check_trained_run(run)
    (run / "checkpoints" / "step_4").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_4")  # what save_checkpoint writes last
    check_trained_run(run)
    shutil.rmtree(pipeline / "vae")
    with pytest.raises(ValueError, match=f"ckpt={str(run)!r}: pipeline={str(pipeline)!r}: the vae folder is missing"):
        check_trained_run(run)
