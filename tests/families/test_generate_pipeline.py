"""``mmpipe generate pipeline=DIR``: any supported family's directory renders without a trained run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_here import mmpipe_here

from mmpipe.config import GenerateConfig
from mmpipe.generate import generate
from mmpipe.runtime.events import read_events


def test_generate_renders_a_two_expert_pipeline_and_records_every_expert_call(wan22_dir: Path, tmp_path: Path) -> None:
    cfg = GenerateConfig(
        pipeline=str(wan22_dir), height=32, width=48, frames=9, steps=3, guidance=4.0, out=str(tmp_path / "out")
    )
    files = generate(cfg)
    assert files["gif"].is_file() and files["mp4"].is_file()
    events = [e for e in read_events(files["run"]) if e["stage"] == "denoise"]
    assert len(events) == 3 * 2  # each step's two branches, on whichever expert the step used


def test_a_bad_directory_or_argument_exits_2_naming_it_before_writing(
    wan22_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model_index.json").write_text(json.dumps({"_class_name": "DDPMPipeline"}))
    cases = [
        ([f"pipeline={tmp_path / 'bad'}"], "_class_name='DDPMPipeline' is not supported; supported: ["),
        ([f"pipeline={wan22_dir}", "height=30", "width=32", "frames=5"], "divisible by 16"),
    ]
    for args, message in cases:
        before = sorted(tmp_path.rglob("*"))
        out = tmp_path / "out"
        code, err = mmpipe_here("generate", *args, "device=cpu", f"out={out}", cwd=tmp_path, capsys=capsys)
        assert code == 2, err[-3000:]
        assert message in err, err[-3000:]
        assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("key", ["ckpt", "pipeline"])
def test_generate_config_names_the_missing_source(key: str) -> None:
    with pytest.raises(ValueError, match="give exactly one of ckpt and pipeline"):
        GenerateConfig(**{key: None})
