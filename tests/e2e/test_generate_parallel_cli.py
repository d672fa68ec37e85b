"""``mmpipe generate nproc=2``: one request over two local ranks writes the frames one process
writes (CFG-2 bitwise, Ulysses-2 with the decode split by rows up to float reassociation), with a
step cache too; placements that cannot run are refused before any rank starts or anything is
written, naming the key."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from mmpipe.config import GenerateConfig, StepCacheConfig
from mmpipe.generate import generate

SMALL = dict(steps=3, frames=9, height=48, width=64, device="cpu")


def _frames(gif: Path) -> np.ndarray:
    with Image.open(gif) as im:
        out = []
        for i in range(im.n_frames):
            im.seek(i)
            out.append(np.asarray(im.convert("RGB"), dtype=np.int16))
    return np.stack(out)


def _run(path: Path, out: Path, **kw: Any) -> np.ndarray:
    written = generate(GenerateConfig(pipeline=str(path), out=str(out), **(SMALL | kw)))
    return _frames(written["gif"])


@pytest.mark.parametrize(
    ("placement", "cache", "tol"),
    [
        (None, "none", 0),  # the default on 2 ranks with guidance on: CFG-2, bitwise
        ({"text": [1], "denoise": {"ranks": [0, 1], "ulysses": 2}, "decode": [0, 1]}, "none", 1),
        ({"text": [0], "denoise": {"ranks": [0, 1], "cfg": 2}, "decode": [1]}, "teacache", 0),
    ],
    ids=["default-cfg2", "ulysses2-decode-rows", "cfg2-teacache-decode-on-rank1"],
)
def test_two_ranks_write_one_process_frames(
    tiny_wan_dir: Path, tmp_path: Path, placement: dict[str, Any] | None, cache: str, tol: int
) -> None:
    one = _run(tiny_wan_dir, tmp_path / "one", cache=StepCacheConfig(policy=cache))
    two = _run(tiny_wan_dir, tmp_path / "two", nproc=2, placement=placement, cache=StepCacheConfig(policy=cache))
    assert two.shape == one.shape
    diff = np.abs(two - one)
    if tol == 0:
        assert diff.max() == 0
    else:
        # Ulysses sums attention in another order (1e-6 on the latents, tests/dist/test_parallel_generate.py);
        # a GIF's palette turns a one-level difference into a few: compare the frames on average
        assert diff.mean() < 0.5 and diff.max() <= 16, (diff.mean(), diff.max())


def test_a_residual_vae_decodes_split_by_rows(tiny_wan_dir: Path, tmp_path: Path) -> None:
    """A Wan 2.2-style residual VAE (``is_residual=True``, as Wan2.2-TI2V-5B's) in the pipeline
    directory: ``placement.decode`` over two ranks (CFG-2 on both, bitwise) splits its decode by
    rows and writes the frames one process writes (up to float reassociation and the GIF's
    palette)."""
    import shutil

    from diffusers import AutoencoderKLWan

    path = tmp_path / "residual"
    shutil.copytree(tiny_wan_dir, path)
    shutil.rmtree(path / "vae")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        AutoencoderKLWan(
            base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, is_residual=True
        ).save_pretrained(path / "vae")
    one = _run(path, tmp_path / "one")
    placement = {"text": [0], "denoise": {"ranks": [0, 1], "cfg": 2}, "decode": [0, 1]}
    two = _run(path, tmp_path / "two", nproc=2, placement=placement)
    assert two.shape == one.shape and one.std() > 1
    diff = np.abs(two - one)
    assert diff.mean() < 0.5 and diff.max() <= 16, (diff.mean(), diff.max())


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (
            dict(nproc=2, guidance=1.0, placement={"denoise": {"ranks": [0, 1], "cfg": 2}}),
            "cfg=2 runs the two guidance",
        ),
        (dict(nproc=2, placement={"denoise": {"ranks": [0, 1], "ulysses": 3}}), r"ulysses=3 = 3 ranks"),
        (
            dict(nproc=3, placement={"denoise": {"ranks": [0, 1, 2], "ulysses": 3}}),
            "heads cannot be split over ulysses=3",
        ),
        (dict(nproc=2, placement={"denoise": {"ranks": [0, 1], "ulysses": 2}}, frames=1), "at least one frame"),
        (
            dict(
                nproc=2,
                placement={"denoise": {"ranks": [0, 1], "ulysses": 2}},
                cache=StepCacheConfig(policy="first_block"),
            ),
            "first_block",
        ),
        (dict(nproc=2, placement={"denoise": {"ranks": [0, 1], "cfg": 2, "dp": 2}}), "dp=2: one request"),
        (dict(nproc=3, placement={"denoise": {"ranks": [0, 1], "cfg": 2}}), "rank 2 of nproc=3 runs no stage"),
        (
            dict(nproc=2, placement={"denoise": {"ranks": [0, 1], "cfg": 2}, "decode": {"ranks": [0, 1], "halo": 2}}),
            "only a split by frames",
        ),
    ],
)
def test_bad_parallel_generate_is_refused_naming_the_key(
    tiny_wan_dir: Path, tmp_path: Path, args: dict[str, Any], match: str
) -> None:
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=match):
        generate(GenerateConfig(pipeline=str(tiny_wan_dir), out=str(out), **(SMALL | args)))
    assert not out.exists()


def test_the_cli_exits_2_naming_the_key(tiny_wan_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["nproc=2", "placement={denoise:{ranks:[0,1],ulysses:3}}"]
    cmd = [sys.executable, "-m", "mmpipe.cli", "generate", f"pipeline={tiny_wan_dir}", f"out={out}", "device=cpu"]
    done = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert re.search(r"placement.denoise: .*ulysses=3 = 3 ranks", done.stderr), done.stderr[-2000:]
    assert not out.exists()


def test_compile_renders_what_eager_renders(tiny_wan_dir: Path, tmp_path: Path) -> None:
    """``compile=true``: the denoiser's blocks compiled in place (regional compilation); inductor's
    fused kernels reassociate float32 sums, so the frames match eager's within 1e-4 (not bitwise:
    the GIF's palette may then differ by a few levels, so the comparison is on the graph's frames)."""
    from mmpipe.models.loading import from_diffusers
    from mmpipe.runtime.inference import configure_denoiser

    written = generate(GenerateConfig(pipeline=str(tiny_wan_dir), out=str(tmp_path / "c"), compile=True, **SMALL))
    assert written["gif"].is_file()
    call = dict(prompt="a red circle moving left", height=48, width=64, num_frames=9, num_inference_steps=3)
    eager = from_diffusers(tiny_wan_dir).generate(**call, seed=0, progress=False)
    graph = from_diffusers(tiny_wan_dir)
    configure_denoiser(graph, StepCacheConfig(), compile=True)
    compiled = graph.generate(**call, seed=0, progress=False)
    np.testing.assert_allclose(compiled, eager, rtol=0, atol=1e-4)


def test_cache_config_names_a_bad_policy_or_threshold() -> None:
    from mmpipe.config import CACHE_POLICIES
    from mmpipe.stages.cache import CachePolicy

    assert set(CACHE_POLICIES) == {p.value for p in CachePolicy}  # the config's list is the stage's
    with pytest.raises(ValueError, match="cache.policy='fast'"):
        StepCacheConfig(policy="fast")
    with pytest.raises(ValueError, match="cache.threshold=0"):
        StepCacheConfig(policy="mag", threshold=0)
