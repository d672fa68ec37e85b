"""The family graphs denoised over two ranks (CFG-parallel branches, Ulysses / ring frames) return
the single-process output: Wan 2.2's two experts, Wan 2.1 I2V (its first-frame condition split with
the latents), HunyuanVideo (joint attention with the text as a replicated tail, the real mask);
families that cannot be split are refused naming the key."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mmpipe.models.loading import from_diffusers
from mmpipe.parallel.denoise import DenoiseGroup, DenoiseLayout
from tests.families.test_wan_i2v import circle

sys.path.insert(0, str(Path(__file__).parents[1] / "dist"))
from workers import run_workers  # noqa: E402

VIDEO = dict(prompt="a red circle moving left", negative_prompt="blurry static", height=32, width=48, num_frames=9)
IMAGE = dict(prompt="a red circle", negative_prompt="blurry static", height=32, width=48)


def _generate(path: Path, layout: DenoiseLayout | None, call: dict[str, Any]) -> np.ndarray:
    graph: Any = from_diffusers(path)
    if layout is not None:
        graph.denoise.parallelize(DenoiseGroup(layout, list(range(layout.size))))
    with torch.no_grad():
        out = graph.generate(**call, seed=0, output_type="latent", progress=False)
    return np.asarray(out.float())


def _worker(rank: int, world: int, path: Path, layout: DenoiseLayout, call: dict[str, Any]) -> np.ndarray:
    torch.set_num_threads(1)
    return _generate(path, layout, call)


@pytest.fixture(scope="module")
def dirs(wan22_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from mmpipe.models.flux import save_tiny_flux_pipeline
    from mmpipe.models.hunyuan import save_tiny_hunyuan_pipeline
    from mmpipe.models.ltx import save_tiny_ltx_pipeline
    from mmpipe.models.wan_i2v import save_tiny_wan_i2v_pipeline

    root = tmp_path_factory.mktemp("parallel-families")
    return {
        "wan22": wan22_dir,
        "wan_i2v": save_tiny_wan_i2v_pipeline(root / "i2v"),
        "ti2v": save_tiny_wan_i2v_pipeline(root / "ti2v", variant="ti2v"),
        "hunyuan": save_tiny_hunyuan_pipeline(root / "hunyuan"),
        "flux": save_tiny_flux_pipeline(root / "flux"),
        "ltx": save_tiny_ltx_pipeline(root / "ltx"),
    }


CASES = [
    ("wan22", DenoiseLayout(ulysses=2), dict(VIDEO, num_inference_steps=4, guidance_scale=4.0, guidance_scale_2=2.0)),
    ("wan22", DenoiseLayout(cfg=2), dict(VIDEO, num_inference_steps=4, guidance_scale=4.0, guidance_scale_2=2.0)),
    ("wan_i2v", DenoiseLayout(ring=2), dict(VIDEO, image=circle("red"), num_inference_steps=3, guidance_scale=5.0)),
    ("wan_i2v", DenoiseLayout(cfg=2), dict(VIDEO, image=circle("red"), num_inference_steps=3, guidance_scale=5.0)),
    ("hunyuan", DenoiseLayout(ulysses=2), dict(VIDEO, num_inference_steps=3, true_cfg_scale=3.0)),
    # packed (B, S, C) latents: CFG rows exchange whole predictions
    ("flux", DenoiseLayout(cfg=2), dict(IMAGE, num_inference_steps=3, true_cfg_scale=3.0)),
    ("ltx", DenoiseLayout(cfg=2), dict(VIDEO, width=64, num_inference_steps=3, guidance_scale=3.0)),
    # the loop's latents unpacked, each rank packing its frames; the rotary tables of the whole grid, cut
    ("ltx", DenoiseLayout(ulysses=2), dict(VIDEO, width=64, num_inference_steps=3, guidance_scale=3.0)),
    (
        "ltx",
        DenoiseLayout(ring=2),
        dict(VIDEO, width=64, num_inference_steps=3, guidance_scale=3.0, guidance_rescale=0.7),
    ),
]


@pytest.mark.parametrize(
    ("name", "layout", "call"),
    CASES,
    ids=[
        "wan22-ulysses2",
        "wan22-cfg2",
        "wan_i2v-ring2",
        "wan_i2v-cfg2",
        "hunyuan-ulysses2-truecfg",
        "flux-cfg2-truecfg",
        "ltx-cfg2",
        "ltx-ulysses2",
        "ltx-ring2-rescale",
    ],
)
def test_family_parallel_matches_one_process(
    dirs: dict[str, Path], name: str, layout: DenoiseLayout, call: dict[str, Any]
) -> None:
    expected = _generate(dirs[name], None, call)
    results = run_workers(_worker, layout.size, dirs[name], layout, call)
    # Sequence-parallel attention sums in another order; the I2V image's VAE encode (3-D convolutions)
    # blocks differently with a worker's one thread than with this process's: float32 reassociation
    tol = 1e-5
    for rank, got in enumerate(results):
        np.testing.assert_allclose(got, expected, rtol=0, atol=tol, err_msg=f"{name} rank {rank}")


def test_families_that_cannot_be_split_are_named(dirs: dict[str, Path]) -> None:
    from mmpipe.models.pipeline_graph import check_parallel_dir

    with pytest.raises(ValueError, match="placement.denoise: .*expand_timesteps"):
        check_parallel_dir(dirs["ti2v"], DenoiseLayout(ulysses=2), key="placement.denoise")
    check_parallel_dir(dirs["ti2v"], DenoiseLayout(cfg=2), key="placement.denoise")  # CFG needs no hooks
    with pytest.raises(ValueError, match="heads cannot be split over ulysses=4"):
        check_parallel_dir(dirs["hunyuan"], DenoiseLayout(ulysses=4), key="placement.denoise")
