"""Step caching (``mmpipe.stages.cache``) on a tiny random-weight Wan DiT, in a hand-written
flow-matching loop with guidance that runs each branch inside ``transformer.cache_context``.

Block computations are counted (a forward hook on the last block's feed-forward, which runs only
when the block itself does), never timed."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator

import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusers.models.cache_utils import CacheMixin
from torch import nn

from mmpipe.stages.cache import (
    IDENTITY,
    CacheConfig,
    CachePolicy,
    apply_cache,
    calibrate_mag_ratios,
    installed_cache,
    remove_cache,
    reset_cache,
    teacache_profile,
)

STEPS = 8
TEXT_DIM = 32
CACHED = ("first_block", "teacache", "mag")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # Tiny matmuls: one thread is faster than two fighting over a shared 2-core machine, and exact.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def build_dit(seed: int = 0) -> WanTransformer3DModel:
    """Wan's block structure at toy width (as mmpipe.models.wan's tiny pipeline: rms_norm_across_heads, cross_attn_norm)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=16,
            in_channels=16,
            out_channels=16,
            text_dim=TEXT_DIM,
            freq_dim=64,
            ffn_dim=64,
            num_layers=3,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=64,
        ).eval()


def count_block_runs(dit: nn.Module) -> list[int]:
    """A counter of full block-stack runs: diffusers' cache hooks replace a skipped block's forward,
    so the last block's FFN runs only when the whole stack does."""
    runs = [0]
    dit.blocks[-1].ffn.register_forward_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
    return runs


@torch.no_grad()
def denoise(dit: nn.Module, *, steps: int = STEPS, guidance: float = 5.0, seed: int = 0) -> torch.Tensor:
    """Euler flow matching from sigma 1 to 0 with classifier-free guidance, as the sampler runs it."""
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(1, 16, 1, 8, 8, generator=g)
    context = {"cond": torch.randn(1, 8, TEXT_DIM, generator=g), "uncond": torch.randn(1, 8, TEXT_DIM, generator=g)}
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    for i in range(steps):
        timestep = (sigmas[i] * 1000).expand(1)
        pred = {}
        for branch, ctx in context.items():
            with dit.cache_context(branch):
                pred[branch] = dit(
                    hidden_states=latents, timestep=timestep, encoder_hidden_states=ctx, return_dict=False
                )[0]
        velocity = pred["uncond"] + guidance * (pred["cond"] - pred["uncond"])
        latents = latents + (sigmas[i + 1] - sigmas[i]) * velocity
    return latents


@pytest.fixture(scope="module")
def uncached() -> torch.Tensor:
    return denoise(build_dit())


@pytest.fixture(scope="module")
def mag_ratios() -> tuple[float, ...]:
    dit = build_dit()
    with torch.random.fork_rng(devices=[]):
        return calibrate_mag_ratios(dit, lambda: denoise(dit))


def cached_dit(policy: str, threshold: float | None, ratios: tuple[float, ...]) -> WanTransformer3DModel:
    dit = build_dit()
    mag = {"mag_ratios": ratios} if policy == "mag" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # teacache: the toy architecture has no published fit
        apply_cache(dit, CacheConfig(policy=policy, threshold=threshold, num_inference_steps=STEPS, **mag))
    return dit


def test_none_is_the_uncached_model_bitwise(uncached: torch.Tensor) -> None:
    dit = build_dit()
    apply_cache(dit, CacheConfig(policy="none"))
    assert installed_cache(dit) is None
    assert torch.equal(denoise(dit), uncached)


@pytest.mark.parametrize("policy", CACHED)
def test_a_tiny_threshold_computes_every_step(
    policy: str, uncached: torch.Tensor, mag_ratios: tuple[float, ...]
) -> None:
    dit = cached_dit(policy, 1e-9, mag_ratios)
    runs = count_block_runs(dit)
    out = denoise(dit)
    assert runs[0] == 2 * STEPS
    # Same kernels on the same inputs; the hooks only add a subtraction on the side (float32).
    torch.testing.assert_close(out, uncached, rtol=0, atol=1e-6)


@pytest.mark.parametrize("policy", CACHED)
def test_a_large_threshold_skips_blocks(policy: str, uncached: torch.Tensor, mag_ratios: tuple[float, ...]) -> None:
    dit = cached_dit(policy, 1e3, mag_ratios)
    runs = count_block_runs(dit)
    out = denoise(dit)
    assert runs[0] < 2 * STEPS
    assert runs[0] >= 2  # the first step of each branch has no residual to reuse
    assert torch.isfinite(out).all()
    assert not torch.allclose(out, uncached, atol=1e-4)


@pytest.mark.parametrize("policy", CACHED)
def test_reset_cache_makes_the_next_generation_identical(policy: str, mag_ratios: tuple[float, ...]) -> None:
    dit = cached_dit(policy, 1e3, mag_ratios)
    first = denoise(dit)
    reset_cache(dit)
    assert torch.equal(denoise(dit), first)


def test_without_reset_first_block_reuses_the_last_request() -> None:
    """The reset test can fail: First Block Cache keeps the last step's residual across requests."""
    dit = cached_dit("first_block", 1e3, ())
    first = denoise(dit)
    assert not torch.equal(denoise(dit), first)


@pytest.mark.parametrize("policy", CACHED)
def test_each_guidance_branch_keeps_its_own_state(policy: str, mag_ratios: tuple[float, ...]) -> None:
    """The unconditional branch's outputs are the same whether or not the conditional branch runs
    in between: with one state shared by both, a skipped call would reuse the other's residual."""
    g = torch.Generator().manual_seed(1)
    inputs = [
        (torch.randn(1, 16, 1, 8, 8, generator=g), torch.tensor([1000.0 * (1 - i / STEPS)])) for i in range(STEPS)
    ]
    context = {"cond": torch.randn(1, 8, TEXT_DIM, generator=g), "uncond": torch.randn(1, 8, TEXT_DIM, generator=g)}

    @torch.no_grad()
    def uncond_outputs(branches: tuple[str, ...]) -> list[torch.Tensor]:
        dit, outs = cached_dit(policy, 1e3, mag_ratios), []
        for x, t in inputs:
            for branch in branches:
                with dit.cache_context(branch):
                    out = dit(hidden_states=x, timestep=t, encoder_hidden_states=context[branch], return_dict=False)[0]
                if branch == "uncond":
                    outs.append(out)
        return outs

    for both, alone in zip(uncond_outputs(("cond", "uncond")), uncond_outputs(("uncond",)), strict=True):
        assert torch.equal(both, alone)


def test_teacache_starts_over_after_num_inference_steps(mag_ratios: tuple[float, ...]) -> None:
    dit = cached_dit("teacache", 1e3, mag_ratios)
    assert torch.equal(denoise(dit), denoise(dit))


def test_remove_cache_restores_the_uncached_model(uncached: torch.Tensor, mag_ratios: tuple[float, ...]) -> None:
    for policy in CACHED:
        dit = cached_dit(policy, 1e3, mag_ratios)
        with pytest.raises(ValueError, match="already has a step cache"):
            apply_cache(dit, CacheConfig(policy="first_block"))
        remove_cache(dit)
        assert installed_cache(dit) is None
        assert torch.equal(denoise(dit), uncached)


def test_calibrated_ratios_are_one_per_step(mag_ratios: tuple[float, ...]) -> None:
    assert len(mag_ratios) == STEPS and mag_ratios[0] == 1.0
    assert all(math.isfinite(r) and r > 0 for r in mag_ratios)


@pytest.mark.parametrize("policy", ["bogus", "FirstBlock", ""])
def test_an_unknown_policy_is_named(policy: str) -> None:
    with pytest.raises(ValueError, match=f"cache.policy={policy!r}.*'none', 'first_block', 'teacache', 'mag'"):
        CacheConfig(policy=policy)


@pytest.mark.parametrize("threshold", [0.0, -0.1, math.nan, math.inf])
def test_a_bad_threshold_is_named(threshold: float) -> None:
    with pytest.raises(ValueError, match=f"cache.threshold={threshold!r}"):
        CacheConfig(policy="teacache", threshold=threshold)


def test_config_errors_and_warnings() -> None:
    assert CacheConfig(policy="mag", num_inference_steps=4, mag_ratios=[1, 0.9]).policy is CachePolicy.MAG
    with pytest.raises(ValueError, match="needs cache.num_inference_steps"):
        CacheConfig(policy="mag")
    with pytest.raises(ValueError, match="cache.num_inference_steps=0"):
        CacheConfig(policy="teacache", num_inference_steps=0)
    with pytest.raises(ValueError, match="cache.mag_ratios"):
        CacheConfig(policy="mag", num_inference_steps=4, mag_ratios=(1.0, -1.0))
    with pytest.warns(UserWarning, match="cache.threshold=0.1 ignored with cache.policy='none'"):
        CacheConfig(policy="none", threshold=0.1)


def test_mag_without_ratios_for_an_unpublished_architecture_asks_for_calibration() -> None:
    with pytest.raises(ValueError, match="calibrate_mag_ratios"):
        apply_cache(build_dit(), CacheConfig(policy="mag", num_inference_steps=STEPS))


class NoCacheContext(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])


class UnknownBlocks(NoCacheContext, CacheMixin):
    pass


@pytest.mark.parametrize("policy", CACHED)
@pytest.mark.parametrize(("model", "why"), [(NoCacheContext, "CacheMixin"), (UnknownBlocks, "no block metadata")])
def test_a_transformer_the_policy_cannot_handle_is_named(policy: str, model: type[nn.Module], why: str) -> None:
    dit = model()
    with pytest.raises(ValueError, match=f"cache.policy={policy!r} cannot handle {model.__name__}.*{why}"):
        apply_cache(dit, CacheConfig(policy=policy, num_inference_steps=STEPS))
    assert not hasattr(dit, "_diffusers_hook")  # refused before touching the model


def test_teacache_uses_the_published_fit_for_wan21_1_3b() -> None:
    with torch.device("meta"):
        dit = WanTransformer3DModel(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30)
    profile = teacache_profile(dit)
    assert profile.coefficients[0] == -5.21862437e04 and profile.threshold == 0.08
    assert profile.retention_steps == 5 and "1.3B" in profile.source
    assert teacache_profile(build_dit()).coefficients == IDENTITY
