"""Typed configs: composition through Hydra, unknown keys, wrong types, validation messages."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mmpipe.config import (
    DataConfig,
    GenerateConfig,
    ModelConfig,
    ProfileConfig,
    RunConfig,
    TrainConfig,
    compose_config,
    from_dict,
)


def test_allowed_top_level_keys() -> None:
    # Every new top-level key is a cost: extend this list deliberately.
    allowed = ["run_dir", "device", "model", "data", "train", "launch", "placement", "parallel", "memory", "profile"]
    assert [f.name for f in dataclasses.fields(RunConfig)] == allowed
    assert sorted(compose_config("train", [])) == sorted(allowed)
    assert sorted(compose_config("generate", [])) == sorted(f.name for f in dataclasses.fields(GenerateConfig))


def test_default_yaml_equals_dataclass_defaults() -> None:
    cfg = from_dict(RunConfig, compose_config("train", []))
    assert cfg == RunConfig()


def test_overrides_and_presets() -> None:
    raw = compose_config("train", ["model=t2v_tiny_qwen", "train.steps=50", "data.frames=9"])
    cfg = from_dict(RunConfig, raw)
    assert cfg.model.text_encoder == "qwen2" and cfg.model.name == "t2v_tiny_qwen"
    assert cfg.train.steps == 50 and cfg.data.frames == 9
    assert cfg.model.text_dim == ModelConfig().text_dim  # inherited from the t2v_tiny preset
    raw = compose_config("train", ["model=u2g_tiny", "train.lr_scale={llm:0.1,connector:2}"])
    assert from_dict(RunConfig, raw).train.lr_scale == {"llm": 0.1, "connector": 2.0}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"train": {"stepz": 3}}, "unknown config key train.stepz"),
        ({"bogus": 1}, "unknown config key bogus"),
        ({"train": {"steps": "many"}}, "train.steps='many': expected int"),
        ({"train": {"steps": 2.5}}, "train.steps=2.5: expected int"),
        ({"train": {"progress": "yes"}}, "train.progress='yes': expected bool"),
        ({"train": {"precision": "fp16"}}, "train.precision='fp16'"),
        ({"device": "tpu"}, "device='tpu'"),
        ({"launch": {"backend": "mpi"}}, "launch.backend='mpi'"),
        ({"model": {"text_encoder": "bert"}}, "model.text_encoder='bert': expected one of ['umt5', 'qwen2']"),
        ({"train": {"steps": 0}}, "train.steps must be positive, got 0"),
        (
            {"train": {"batch_size": 6, "micro_batches": 4}},
            "train.batch_size=6 is not divisible by train.micro_batches=4",
        ),
        ({"train": {"micro_batches": -1}}, "train.micro_batches=-1: expected >= 1, or 0 (auto)"),
        ({"data": {"height": 40}}, "data.height and data.width must be multiples of 16, got 40x64"),
        ({"data": {"frames": 8}}, "data.frames must be 4k+1"),
        ({"data": {"root": "/definitely/not/here"}}, "data.root='/definitely/not/here' is not a directory"),
        ({"model": {"path": "org/model"}}, "model.path='org/model' is not a local directory"),
        ({"model": {"dit_head_dim": 15}}, "model.dit_head_dim must be even, got 15"),
        ({"launch": {"nproc": -1}}, "launch.nproc=-1: expected 0 (one rank per GPU or core) or a positive int"),
        ({"placement": [0, 1]}, "placement=[0, 1]: expected a mapping"),
        ({"data": {"val_samples": 4}}, "data.val_samples=4 must be >= train.batch_size=8"),
        ({"train": {"lr_scale": {"llm": "slow"}}}, "train.lr_scale.llm='slow': expected float"),
        ({"train": {"lr_scale": {"llm": 0}}}, "train.lr_scale.llm=0.0: expected a positive factor"),
        ({"train": {"lr_scale": [0.1]}}, "train.lr_scale=[0.1]: expected a mapping"),
    ],
)
def test_bad_values_are_named(raw: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        from_dict(RunConfig, raw)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ([2], "micro_sizes=[2]: two or more growing positive micro-batch sizes"),
        ([2, 1, 4], "micro_sizes=[2, 1, 4]: two or more growing"),
        ([0, 2], "micro_sizes=[0, 2]"),
        (["one", 2], "micro_sizes[0]='one': expected int"),
        (2, "micro_sizes=2: expected a list"),
    ],
)
def test_profile_sizes_are_checked(sizes: object, message: str) -> None:
    assert (
        from_dict(ProfileConfig, compose_config("profile", [])).micro_sizes == [1, 2, 4] == ProfileConfig().micro_sizes
    )
    with pytest.raises(ValueError) as err:
        from_dict(ProfileConfig, {"micro_sizes": sizes})
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("train", "placement", "expected"),
    [
        ({}, "auto", 0),  # the planner chooses them with the placement (mmpipe.train.prepare.resolve_auto)
        ({}, None, 2),  # a given placement: 2, so a pipelined one overlaps its stages
        ({}, {"text": [0], "vae": [0], "dit": [1]}, 2),
        ({"batch_size": 3}, None, 1),  # 2 does not divide the batch
        ({"micro_batches": 4}, None, 4),
        ({"micro_batches": 4}, "auto", 4),  # kept: the planner plans with them
    ],
)
def test_micro_batches_auto(train: dict, placement: object, expected: int) -> None:
    cfg = from_dict(RunConfig, {"train": train, "placement": placement, "data": {"val_samples": 8}})
    assert cfg.train.micro_batches == expected


def test_micro_batches_auto_in_the_composed_config() -> None:
    assert from_dict(RunConfig, compose_config("train", [])).train.micro_batches == 2  # placement: null


def test_float_accepts_int_and_optional_accepts_none() -> None:
    assert from_dict(TrainConfig, {"lr": 1}).lr == 1.0
    assert from_dict(DataConfig, {"root": None}).root is None


def test_generate_requires_a_run_dir_or_a_pipeline(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="give exactly one of ckpt and pipeline"):
        GenerateConfig()
    with pytest.raises(ValueError, match="give exactly one of ckpt and pipeline.*ckpt='a' pipeline='b'"):
        GenerateConfig(ckpt="a", pipeline="b")
    with pytest.raises(ValueError, match="image='/nope.png' is not a file"):
        GenerateConfig(pipeline=str(tmp_path), image="/nope.png")
    with pytest.raises(ValueError, match="ckpt='/nope' is not a run directory"):
        GenerateConfig(ckpt="/nope")
