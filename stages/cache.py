"""Step caching for diffusion transformers at inference (``cache.policy``): on a denoising step whose
input has changed little since the last fully computed one, reuse that step's residual of the block
stack (its output minus its input) instead of running the blocks again.

Policies (:class:`CachePolicy`), each installed on an unmodified diffusers transformer by
:func:`apply_cache`:

* ``none``: nothing is installed; the model runs as it is (bitwise).
* ``first_block``: diffusers' First Block Cache (``FirstBlockCacheConfig`` via ``enable_cache``):
  every step runs the first block; the others are skipped while the first block's residual has
  changed by less than ``threshold`` (relative mean absolute difference) since the last computed
  step. Default threshold 0.05, diffusers' default. Nothing model-specific to calibrate.
* ``teacache``: mmpipe's own hooks (diffusers 0.42 has no TeaCache), on diffusers' hook machinery as
  its First Block Cache is: TeaCache (Liu et al. 2024, "Timestep Embedding Tells: It's Time to Cache
  for Video Diffusion Model") accumulates the relative L1 change of the first block's
  timestep-modulated input between steps, rescaled by a polynomial fitted per checkpoint, and skips
  the whole stack while the sum stays under ``threshold``. The indicator, the polynomial, the
  default threshold and the always-computed steps come from :func:`teacache_profile`: the TeaCache
  repository's published fits where the architecture matches one (Wan 2.1 T2V 1.3B / 14B,
  HunyuanVideo T2V, FLUX.1), else the identity polynomial (uncalibrated; a warning says so).
* ``mag``: diffusers' MagCache (``MagCacheConfig``): skips while the accumulated error implied by the
  per-step magnitude ratios of consecutive residuals stays under ``threshold``. Those ratios are
  per checkpoint (and scheduler): ``CacheConfig.mag_ratios`` if given, else the MagCache
  repository's published ratios for Wan 2.1 T2V 1.3B / 14B and FLUX.1 (diffusers' constant), else
  :func:`calibrate_mag_ratios` must measure them from one uncached run of the same model and loop.

Every policy keeps its state per guidance branch: the denoising loop calls the model inside
``with transformer.cache_context("cond"):`` (and ``"uncond"``), as diffusers' pipelines do, and
:func:`reset_cache` clears the state between requests (TeaCache and MagCache also start over by
themselves after ``num_inference_steps`` calls per branch when it is known).

Tensor legend: B batch, L tokens, D hidden width, S denoising steps.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import logging
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch
from diffusers import FluxTransformer2DModel, HunyuanVideoTransformer3DModel, WanTransformer3DModel
from diffusers.hooks import FirstBlockCacheConfig, HookRegistry, MagCacheConfig, ModelHook

# Private to diffusers, but exactly what its own cache hooks use to find the block stack and to read a
# block's inputs and outputs: with them every policy here caches the same span of the same models.
from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
from diffusers.hooks.hooks import BaseState, StateManager
from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS
from diffusers.models.cache_utils import CacheMixin
from diffusers.models.normalization import AdaLayerNormZero
from torch import nn

logger = logging.getLogger(__name__)

__all__ = [
    "CacheConfig",
    "CachePolicy",
    "StepCache",
    "InstalledCache",
    "TeaCacheProfile",
    "apply_cache",
    "calibrate_mag_ratios",
    "installed_cache",
    "remove_cache",
    "reset_cache",
    "teacache_profile",
]


class CachePolicy(enum.StrEnum):
    NONE = "none"
    FIRST_BLOCK = "first_block"
    TEACACHE = "teacache"
    MAG = "mag"


# diffusers' FirstBlockCacheConfig default.
FIRST_BLOCK_THRESHOLD = 0.05
# diffusers' MagCacheConfig defaults (threshold, max consecutive skips K, fraction of first steps kept).
MAG_DEFAULTS = (0.06, 3, 0.2)


def parse_policy(policy: CachePolicy | str) -> CachePolicy:
    """``policy`` as a :class:`CachePolicy`; a ValueError naming it and the valid ones otherwise."""
    try:
        return CachePolicy(policy)
    except ValueError:
        valid = ", ".join(repr(p.value) for p in CachePolicy)
        raise ValueError(f"cache.policy={policy!r}: expected one of {valid}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """Which step cache the DiT runs with, and its knobs.

    ``threshold``: how much change a policy tolerates before it recomputes the blocks (> 0; larger
    skips more); None takes the policy's default (``first_block`` 0.05; ``teacache`` per model, see
    :func:`teacache_profile`; ``mag`` 0.06, or MagCache's 0.12 for its published Wan 2.1 ratios).
    ``num_inference_steps``: the loop's step count; ``mag`` needs it (diffusers' MagCache resamples
    its ratios to it and starts a new trajectory after it), ``teacache`` uses it to always compute
    the last step where its profile asks for that and to start over after it; ``first_block`` has no
    use for it (it may be passed anyway). ``mag_ratios``: MagCache's per-step magnitude ratios for
    this checkpoint (from :func:`calibrate_mag_ratios`; S entries, the first 1.0), ``mag`` only.
    """

    policy: CachePolicy | str = CachePolicy.NONE
    threshold: float | None = None
    num_inference_steps: int | None = None
    mag_ratios: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        policy = parse_policy(self.policy)
        object.__setattr__(self, "policy", policy)
        threshold = self.threshold
        if threshold is not None and not (_is_number(threshold) and math.isfinite(threshold) and threshold > 0):
            raise ValueError(f"cache.threshold={self.threshold!r}: expected a finite number > 0")
        steps = self.num_inference_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0):
            raise ValueError(f"cache.num_inference_steps={steps!r}: expected a positive integer")
        if policy is CachePolicy.MAG and steps is None:
            raise ValueError("cache.policy='mag' needs cache.num_inference_steps (MagCache resamples its ratios to it)")
        if self.mag_ratios is not None:
            ratios = tuple(self.mag_ratios)
            if not ratios or not all(_is_number(r) and math.isfinite(r) and r > 0 for r in ratios):
                raise ValueError(f"cache.mag_ratios={self.mag_ratios!r}: expected finite numbers > 0, one per step")
            ratios = tuple(float(r) for r in ratios)
            object.__setattr__(self, "mag_ratios", ratios)
        self._warn_unused(policy)

    def _warn_unused(self, policy: CachePolicy) -> None:
        # num_inference_steps is the loop's, not a knob: passing it to every policy is fine.
        unused = []
        if policy is CachePolicy.NONE and self.threshold is not None:
            unused.append(f"cache.threshold={self.threshold}")
        if policy is not CachePolicy.MAG and self.mag_ratios is not None:
            unused.append("cache.mag_ratios")
        if unused:
            warnings.warn(f"{', '.join(unused)} ignored with cache.policy={policy.value!r}", stacklevel=4)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class InstalledCache:
    """What :func:`apply_cache` installed: the policy, the threshold it resolved to, and where its
    model-specific numbers (TeaCache polynomial, MagCache ratios) came from."""

    policy: CachePolicy
    threshold: float
    calibration: str


_INSTALLED_ATTR = "_mmpipe_step_cache"
_TEACACHE_HEAD_HOOK = "mmpipe_teacache_head"
_TEACACHE_BLOCK_HOOK = "mmpipe_teacache_block"
_MAG_RECORD_HOOK = "mmpipe_mag_record"


def installed_cache(transformer: nn.Module) -> InstalledCache | None:
    """The step cache :func:`apply_cache` installed on ``transformer``, or None."""
    return getattr(transformer, _INSTALLED_ATTR, None)


def apply_cache(transformer: nn.Module, config: CacheConfig) -> None:
    """Install ``config.policy`` on a diffusers transformer (``WanTransformer3DModel``,
    ``HunyuanVideoTransformer3DModel``, ``FluxTransformer2DModel``, ``QwenImageTransformer2DModel``,
    ...). The denoising loop must then call it inside ``transformer.cache_context(name)``, one name
    per guidance branch, and call :func:`reset_cache` between requests.

    Raises ValueError, before touching the model, for a transformer the policy cannot handle
    (naming its class and the policy) and for one that already has a cache installed."""
    policy = parse_policy(config.policy)
    if policy is CachePolicy.NONE:
        return
    blocks = _block_stack(transformer, policy)
    if installed_cache(transformer) is not None or getattr(transformer, "is_cache_enabled", False):
        raise ValueError(
            f"cache.policy={policy.value!r}: {type(transformer).__name__} already has a step cache; remove_cache() first"
        )
    match policy:
        case CachePolicy.FIRST_BLOCK:
            installed = _apply_first_block(transformer, config)
        case CachePolicy.MAG:
            installed = _apply_mag(transformer, config)
        case CachePolicy.TEACACHE:
            installed = _apply_teacache(transformer, blocks, config)
        case _:
            raise AssertionError(policy)
    setattr(transformer, _INSTALLED_ATTR, installed)


def reset_cache(transformer: nn.Module) -> None:
    """Forget every branch's cached residuals and accumulators (call it before each request): the
    next call computes every block, as the first step of a generation must."""
    HookRegistry.check_if_exists_or_initialize(transformer).reset_stateful_hooks(recurse=True)


def remove_cache(transformer: nn.Module) -> None:
    """Take the installed step cache (if any) off ``transformer``; it then runs uncached."""
    installed = installed_cache(transformer)
    if installed is None:
        return
    if installed.policy is CachePolicy.TEACACHE:
        registry = HookRegistry.check_if_exists_or_initialize(transformer)
        registry.remove_hook(_TEACACHE_HEAD_HOOK, recurse=True)
        registry.remove_hook(_TEACACHE_BLOCK_HOOK, recurse=True)
        registry.invalidate_child_registries_cache()
    else:
        cast(CacheMixin, transformer).disable_cache()
    delattr(transformer, _INSTALLED_ATTR)


def _block_stack(transformer: nn.Module, policy: CachePolicy) -> list[nn.Module]:
    """The repeated blocks every policy spans (the ModuleLists diffusers' cache hooks look for, in
    the model's order), after checking that each policy can handle them."""
    name = type(transformer).__name__
    if not isinstance(transformer, CacheMixin):
        raise ValueError(
            f"cache.policy={policy.value!r} cannot handle {name}: it is not a diffusers CacheMixin model "
            "(no cache_context for the guidance branches)"
        )
    blocks = [
        block
        for child_name, child in transformer.named_children()
        if child_name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, nn.ModuleList)
        for block in child
    ]
    if len(blocks) < 2:
        raise ValueError(
            f"cache.policy={policy.value!r} cannot handle {name}: it needs at least 2 transformer blocks in "
            f"one of {sorted(_ALL_TRANSFORMER_BLOCK_IDENTIFIERS)}, found {len(blocks)}"
        )
    for cls in dict.fromkeys(type(b) for b in blocks):
        try:
            TransformerBlockRegistry.get(cls)
        except ValueError:
            raise ValueError(
                f"cache.policy={policy.value!r} cannot handle {name}: diffusers has no block metadata for its "
                f"{cls.__name__} blocks (diffusers.hooks._helpers.TransformerBlockRegistry)"
            ) from None
    return blocks


# --- first_block: diffusers' First Block Cache ---------------------------------------------------


def _apply_first_block(transformer: nn.Module, config: CacheConfig) -> InstalledCache:
    threshold = config.threshold if config.threshold is not None else FIRST_BLOCK_THRESHOLD
    cast(CacheMixin, transformer).enable_cache(FirstBlockCacheConfig(threshold=threshold))
    return InstalledCache(CachePolicy.FIRST_BLOCK, threshold, "none needed")


# --- mag: diffusers' MagCache -------------------------------------------------------------------

# MagCache4Wan2.1/magcache_generate.py (github.com/Zehong-Ma/MagCache), as published: 50 UniPC steps,
# conditional and unconditional ratios interleaved, the first pair the padding 1.0.
# fmt: off
_WAN21_T2V_1_3B_MAG_RATIOS_CFG = (1.0, 1.0, 1.0124, 1.02213, 1.00166, 1.0041, 0.99791, 1.00061, 0.99682, 0.99762, 0.99634, 0.99685, 0.99567, 0.99586, 0.99416, 0.99422, 0.99578, 0.99575, 0.9957, 0.99563, 0.99511, 0.99506, 0.99535, 0.99531, 0.99552, 0.99549, 0.99541, 0.99539, 0.9954, 0.99536, 0.99489, 0.99485, 0.99518, 0.99514, 0.99484, 0.99478, 0.99481, 0.99479, 0.99415, 0.99413, 0.99419, 0.99416, 0.99396, 0.99393, 0.99388, 0.99386, 0.99349, 0.99349, 0.99309, 0.99304, 0.9927, 0.9927, 0.99228, 0.99226, 0.99171, 0.9917, 0.99137, 0.99135, 0.99068, 0.99063, 0.99005, 0.99003, 0.98944, 0.98942, 0.98849, 0.98849, 0.98758, 0.98757, 0.98644, 0.98643, 0.98504, 0.98503, 0.9836, 0.98359, 0.98202, 0.98201, 0.97977, 0.97978, 0.97717, 0.97718, 0.9741, 0.97411, 0.97003, 0.97002, 0.96538, 0.96541, 0.9593, 0.95933, 0.95086, 0.95089, 0.94013, 0.94019, 0.92402, 0.92414, 0.90241, 0.9026, 0.86821, 0.86868, 0.81838, 0.81939)
_WAN21_T2V_14B_MAG_RATIOS_CFG = (1.0, 1.0, 1.02504, 1.03017, 1.00025, 1.00251, 0.9985, 0.99962, 0.99779, 0.99771, 0.9966, 0.99658, 0.99482, 0.99476, 0.99467, 0.99451, 0.99664, 0.99656, 0.99434, 0.99431, 0.99533, 0.99545, 0.99468, 0.99465, 0.99438, 0.99434, 0.99516, 0.99517, 0.99384, 0.9938, 0.99404, 0.99401, 0.99517, 0.99516, 0.99409, 0.99408, 0.99428, 0.99426, 0.99347, 0.99343, 0.99418, 0.99416, 0.99271, 0.99269, 0.99313, 0.99311, 0.99215, 0.99215, 0.99218, 0.99215, 0.99216, 0.99217, 0.99163, 0.99161, 0.99138, 0.99135, 0.98982, 0.9898, 0.98996, 0.98995, 0.9887, 0.98866, 0.98772, 0.9877, 0.98767, 0.98765, 0.98573, 0.9857, 0.98501, 0.98498, 0.9838, 0.98376, 0.98177, 0.98173, 0.98037, 0.98035, 0.97678, 0.97677, 0.97546, 0.97543, 0.97184, 0.97183, 0.96711, 0.96708, 0.96349, 0.96345, 0.95629, 0.95625, 0.94926, 0.94929, 0.93964, 0.93961, 0.92511, 0.92504, 0.90693, 0.90678, 0.8796, 0.87945, 0.86111, 0.86189)
# fmt: on


def _one_ratio_per_step(interleaved: Sequence[float]) -> tuple[float, ...]:
    """MagCache's Wan ratios alternate conditional / unconditional; diffusers' MagCache applies one
    ratio per step to every branch, so take the two branches' mean (they differ by < 1e-3)."""
    return tuple((c + u) / 2 for c, u in zip(interleaved[0::2], interleaved[1::2], strict=True))


def _published_mag_ratios(transformer: nn.Module) -> tuple[tuple[float, ...], str] | None:
    """The MagCache repository's ratios for this architecture, with their source, or None."""
    if isinstance(transformer, WanTransformer3DModel):
        published = {
            "Wan2.1 T2V 1.3B": _WAN21_T2V_1_3B_MAG_RATIOS_CFG,
            "Wan2.1 T2V 14B": _WAN21_T2V_14B_MAG_RATIOS_CFG,
        }
        arch = _wan_arch(transformer)
        if arch in published:
            return _one_ratio_per_step(published[arch]), f"published MagCache ratios for {arch} (50 UniPC steps)"
    if isinstance(transformer, FluxTransformer2DModel) and _is_flux1(transformer):
        return tuple(FLUX_MAG_RATIOS.tolist()), "published MagCache ratios for FLUX.1 (diffusers' FLUX_MAG_RATIOS)"
    return None


def _apply_mag(transformer: nn.Module, config: CacheConfig) -> InstalledCache:
    threshold, max_skip, retention = MAG_DEFAULTS
    if config.mag_ratios is not None:
        ratios, source = config.mag_ratios, "cache.mag_ratios (calibrated)"
    else:
        published = _published_mag_ratios(transformer)
        if published is None:
            raise ValueError(
                f"cache.policy='mag' cannot handle {type(transformer).__name__} as configured: MagCache's "
                "ratios are per checkpoint and none are published for this architecture; measure them "
                "with mmpipe.stages.cache.calibrate_mag_ratios() and pass them as cache.mag_ratios"
            )
        ratios, source = published
        if isinstance(transformer, WanTransformer3DModel):
            threshold, max_skip = 0.12, 2  # MagCache4Wan2.1's defaults (E=0.12, K=2, R=0.2)
    if config.threshold is not None:
        threshold = config.threshold
    assert config.num_inference_steps is not None  # CacheConfig checks it for mag
    cast(CacheMixin, transformer).enable_cache(
        MagCacheConfig(
            threshold=threshold,
            max_skip_steps=max_skip,
            retention_ratio=retention,
            num_inference_steps=config.num_inference_steps,
            mag_ratios=torch.tensor(ratios, dtype=torch.float32),
        )
    )
    return InstalledCache(CachePolicy.MAG, threshold, source)


class _MagRecordState(BaseState):
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.head_input_BLD: torch.Tensor | None = None
        self.previous_residual_BLD: torch.Tensor | None = None


class _MagRecordHook(ModelHook):
    """Records MagCache's calibration figure on an uncached run: at the head block the stack's
    input, at the tail the mean over tokens of |residual_t| / |residual_{t-1}| (diffusers' formula)."""

    _is_stateful = True

    def __init__(self, manager: StateManager, ratios: dict[str, list[float]], *, head: bool, tail: bool) -> None:
        super().__init__()
        self.state_manager, self.ratios, self.head, self.tail = manager, ratios, head, tail
        self._metadata: TransformerBlockMetadata | None = None

    def initialize_hook(self, module: nn.Module) -> nn.Module:
        self._metadata = TransformerBlockRegistry.get(type(module))
        return module

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        assert self._metadata is not None
        state: _MagRecordState = self.state_manager.get_state()
        if self.head:
            state.head_input_BLD = _block_inputs(self._metadata, args, kwargs)[0]
        output = _original_forward(self)(*args, **kwargs)
        if self.tail:
            assert state.head_input_BLD is not None
            residual_BLD = _block_outputs(self._metadata, output)[0] - state.head_input_BLD
            ratio = 1.0
            if state.previous_residual_BLD is not None:
                norms = torch.linalg.norm(residual_BLD.float(), dim=-1)
                previous = torch.linalg.norm(state.previous_residual_BLD.float(), dim=-1)
                ratio = (norms / (previous + 1e-8)).mean().item()
            self.ratios.setdefault(self.state_manager.context.name, []).append(ratio)
            state.previous_residual_BLD = residual_BLD
        return output

    def reset_state(self, module: nn.Module) -> nn.Module:
        self.state_manager.reset()
        return module


def calibrate_mag_ratios(transformer: nn.Module, run_denoise: Callable[[], object]) -> tuple[float, ...]:
    """MagCache's per-step magnitude ratios for ``transformer``, measured on one uncached generation:
    ``run_denoise()`` must run the same loop (scheduler, step count, guidance) the cache will serve,
    calling the model inside ``cache_context`` blocks. Step i's ratio is the mean over tokens of the
    norm of the block stack's residual at step i over that at step i-1 (step 0: 1.0), as diffusers'
    own calibration mode prints it; with guidance, the branches' ratios are averaged per step (they
    share one list in diffusers' MagCache). Pass the result as ``CacheConfig.mag_ratios``.

    The ratios are calibrated for this model, scheduler and step count on this one prompt and seed;
    MagCache's premise is that they barely depend on the prompt."""
    blocks = _block_stack(transformer, CachePolicy.MAG)
    if installed_cache(transformer) is not None or getattr(transformer, "is_cache_enabled", False):
        raise ValueError(f"calibrate_mag_ratios needs {type(transformer).__name__} uncached; remove_cache() first")
    manager = StateManager(_MagRecordState)  # type: ignore[arg-type]  # diffusers annotates the class as an instance
    ratios: dict[str, list[float]] = {}
    for block in (blocks[0], blocks[-1]):
        hook = _MagRecordHook(manager, ratios, head=block is blocks[0], tail=block is blocks[-1])
        HookRegistry.check_if_exists_or_initialize(block).register_hook(hook, _MAG_RECORD_HOOK)
    root = HookRegistry.check_if_exists_or_initialize(transformer)
    root.invalidate_child_registries_cache()
    try:
        run_denoise()
    finally:
        root.remove_hook(_MAG_RECORD_HOOK, recurse=True)
        root.invalidate_child_registries_cache()
    return _mean_per_step(ratios)


def _mean_per_step(ratios: dict[str, list[float]]) -> tuple[float, ...]:
    lengths = {name: len(r) for name, r in ratios.items()}
    if not lengths:
        raise ValueError("calibrate_mag_ratios: run_denoise() never called the transformer")
    if len(set(lengths.values())) != 1:
        raise ValueError(f"calibrate_mag_ratios: the branches ran different step counts {lengths}")
    return tuple(sum(step) / len(step) for step in zip(*ratios.values(), strict=True))


# --- teacache: mmpipe's own hooks ---------------------------------------------------------------

Indicator = Callable[[nn.Module, TransformerBlockMetadata, tuple[Any, ...], dict[str, Any]], torch.Tensor]


def _timestep_embedding(block: nn.Module, meta: TransformerBlockMetadata, args: tuple, kwargs: dict) -> torch.Tensor:
    """The head block's ``temb`` argument: for Wan its timestep projection e0 (B x 6 x D), which is
    the indicator TeaCache4Wan2.1 fits with ``use_ret_steps``."""
    return meta._get_parameter_from_args_kwargs("temb", args, kwargs)


def _modulated_input(block: nn.Module, meta: TransformerBlockMetadata, args: tuple, kwargs: dict) -> torch.Tensor:
    """The head block's AdaLN-Zero output norm1(x) * (1 + scale) + shift (B x L x D): the indicator
    TeaCache4HunyuanVideo and TeaCache4FLUX fit."""
    hidden_BLD = meta._get_parameter_from_args_kwargs(meta.hidden_states_argument_name, args, kwargs)
    temb = meta._get_parameter_from_args_kwargs("temb", args, kwargs)
    norm1: Any = block.norm1
    return norm1(hidden_BLD, emb=temb)[0]


IDENTITY = (1.0, 0.0)


@dataclasses.dataclass(frozen=True)
class TeaCacheProfile:
    """TeaCache's per-model settings. ``coefficients`` in numpy ``poly1d`` order (highest power
    first; :data:`IDENTITY` = uncalibrated); ``retention_steps``: the first steps of each branch,
    always computed; ``compute_last_step``: the last step too (needs ``num_inference_steps``)."""

    source: str
    indicator: Indicator
    coefficients: tuple[float, ...]
    threshold: float
    retention_steps: int
    compute_last_step: bool


# github.com/ali-vilab/TeaCache: TeaCache4Wan2.1 (use_ret_steps: indicator e0, first 5 steps kept,
# thresholds 0.05 / 0.08 for 1.3B, ~0.2 for 14B), TeaCache4HunyuanVideo (0.1: ~1.6x, 0.15: ~2.1x),
# TeaCache4FLUX (0.25: 1.5x, 0.4: 1.8x, 0.6: 2.0x); the last two keep the first and last steps.
_WAN21_T2V_1_3B_TEACACHE = (-5.21862437e04, 9.23041404e03, -5.28275948e02, 1.36987616e01, -4.99875664e-02)
_WAN21_T2V_14B_TEACACHE = (-3.03318725e05, 4.90537029e04, -2.65530556e03, 5.87365115e01, -3.15583525e-01)
_HUNYUAN_VIDEO_TEACACHE = (7.33226126e02, -4.01131952e02, 6.75869174e01, -3.14987800e00, 9.61237896e-02)
_FLUX1_TEACACHE = (4.98651651e02, -2.83781631e02, 5.58554382e01, -3.82021401e00, 2.64230861e-01)
# Uncalibrated: the raw relative L1 change of the indicator, summed over skipped steps.
_IDENTITY_THRESHOLD = 0.1


def _wan_arch(transformer: nn.Module) -> str | None:
    """Which published Wan 2.1 text-to-video checkpoint this architecture is (Wan 2.2 T2V-A14B's
    experts share the 14B one), by its config; None for any other."""
    config: Any = transformer.config
    key = (config["num_layers"], config["num_attention_heads"], config["attention_head_dim"], config["in_channels"])
    return {(30, 12, 128, 16): "Wan2.1 T2V 1.3B", (40, 40, 128, 16): "Wan2.1 T2V 14B"}.get(key)


def _is_flux1(transformer: nn.Module) -> bool:
    config: Any = transformer.config
    return (config["num_layers"], config["num_single_layers"], config["in_channels"]) == (19, 38, 64)


def _is_hunyuan_t2v(transformer: nn.Module) -> bool:
    config: Any = transformer.config
    return (config["num_layers"], config["num_single_layers"], config["in_channels"]) == (20, 40, 16)


def teacache_profile(transformer: nn.Module) -> TeaCacheProfile:
    """TeaCache's indicator, rescaling polynomial, default threshold and kept steps for
    ``transformer``: the TeaCache repository's fit where the architecture is one it published
    (matched by config, so a fine-tune of the same architecture gets the base model's fit), else
    the identity polynomial on the head block's AdaLN-Zero modulated input, or else its ``temb``
    argument (Wan: e0). ValueError for a model whose blocks take no ``temb``."""
    head = _block_stack(transformer, CachePolicy.TEACACHE)[0]
    if "temb" not in inspect.signature(type(head).forward).parameters:
        raise ValueError(
            f"cache.policy='teacache' cannot handle {type(transformer).__name__}: its {type(head).__name__} blocks "
            "take no timestep embedding ('temb') to measure the change between steps"
        )
    if isinstance(transformer, WanTransformer3DModel):
        arch = _wan_arch(transformer)
        fits = {"Wan2.1 T2V 1.3B": (_WAN21_T2V_1_3B_TEACACHE, 0.08), "Wan2.1 T2V 14B": (_WAN21_T2V_14B_TEACACHE, 0.2)}
        coefficients, threshold = fits.get(arch or "", (IDENTITY, _IDENTITY_THRESHOLD))
        source = f"TeaCache4Wan2.1 fit for {arch} (use_ret_steps)" if arch else "uncalibrated (identity)"
        return TeaCacheProfile(source, _timestep_embedding, coefficients, threshold, 5, False)
    if isinstance(getattr(head, "norm1", None), AdaLayerNormZero):
        if isinstance(transformer, HunyuanVideoTransformer3DModel) and _is_hunyuan_t2v(transformer):
            return TeaCacheProfile(
                "TeaCache4HunyuanVideo fit", _modulated_input, _HUNYUAN_VIDEO_TEACACHE, 0.15, 1, True
            )
        if isinstance(transformer, FluxTransformer2DModel) and _is_flux1(transformer):
            return TeaCacheProfile("TeaCache4FLUX fit (FLUX.1)", _modulated_input, _FLUX1_TEACACHE, 0.4, 1, True)
        return TeaCacheProfile("uncalibrated (identity)", _modulated_input, IDENTITY, _IDENTITY_THRESHOLD, 1, True)
    return TeaCacheProfile("uncalibrated (identity)", _timestep_embedding, IDENTITY, _IDENTITY_THRESHOLD, 1, True)


class _TeaCacheState(BaseState):
    """One guidance branch's trajectory."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.step = 0
        self.accumulated = 0.0
        self.previous_indicator: torch.Tensor | None = None
        self.compute = True  # this call runs the blocks (set by the head, read by the others)
        self.stack_input_BLD: torch.Tensor | None = None
        self.stack_encoder_input: torch.Tensor | None = None
        self.residual_BLD: torch.Tensor | None = None  # stack output - input of the last computed step
        self.encoder_residual: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class _TeaCacheSettings:
    profile: TeaCacheProfile
    threshold: float
    num_inference_steps: int | None

    def rescale(self, relative_l1: float) -> float:
        value = 0.0
        for c in self.profile.coefficients:  # Horner, numpy poly1d's order
            value = value * relative_l1 + c
        return value

    def forced(self, step: int) -> bool:
        last = self.num_inference_steps is not None and step == self.num_inference_steps - 1
        return step < self.profile.retention_steps or (self.profile.compute_last_step and last)


class _TeaCacheHeadHook(ModelHook):
    """On the first block: decides whether this call runs the stack; if not, returns the stack's
    input plus the branch's cached residual (the other blocks then pass it through)."""

    _is_stateful = True

    def __init__(self, manager: StateManager, settings: _TeaCacheSettings) -> None:
        super().__init__()
        self.state_manager, self.settings = manager, settings
        self._metadata: TransformerBlockMetadata | None = None

    def initialize_hook(self, module: nn.Module) -> nn.Module:
        self._metadata = TransformerBlockRegistry.get(type(module))
        return module

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        meta = self._metadata
        assert meta is not None
        state: _TeaCacheState = self.state_manager.get_state()
        steps = self.settings.num_inference_steps
        if steps is not None and state.step >= steps:
            state.reset()  # a new generation without reset_cache()
        state.compute = self._decide(state, self.settings.profile.indicator(module, meta, args, kwargs))
        state.step += 1
        hidden_BLD, encoder = _block_inputs(meta, args, kwargs)
        if state.compute:
            state.stack_input_BLD, state.stack_encoder_input = hidden_BLD, encoder
            return _original_forward(self)(*args, **kwargs)
        assert state.residual_BLD is not None
        cached_encoder = encoder + state.encoder_residual if state.encoder_residual is not None else encoder
        return _build_block_output(meta, hidden_BLD + state.residual_BLD, cached_encoder)

    @torch.compiler.disable
    def _decide(self, state: _TeaCacheState, indicator: torch.Tensor) -> bool:
        indicator = indicator.detach().float()
        previous, state.previous_indicator = state.previous_indicator, indicator
        if self.settings.forced(state.step) or previous is None or state.residual_BLD is None:
            state.accumulated = 0.0
            return True
        scale = previous.abs().mean().item()
        if scale == 0.0 or previous.shape != indicator.shape:
            state.accumulated = 0.0
            return True
        state.accumulated += self.settings.rescale((indicator - previous).abs().mean().item() / scale)
        if state.accumulated < self.settings.threshold:
            return False
        state.accumulated = 0.0
        return True

    def reset_state(self, module: nn.Module) -> nn.Module:
        self.state_manager.reset()
        return module


class _TeaCacheBlockHook(ModelHook):
    """On every other block: passes its input through on a skipped call; the tail block records the
    stack's residual on a computed one."""

    def __init__(self, manager: StateManager, *, tail: bool) -> None:
        super().__init__()
        self.state_manager, self.tail = manager, tail
        self._metadata: TransformerBlockMetadata | None = None

    def initialize_hook(self, module: nn.Module) -> nn.Module:
        self._metadata = TransformerBlockRegistry.get(type(module))
        return module

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        meta = self._metadata
        assert meta is not None
        state: _TeaCacheState = self.state_manager.get_state()
        if not state.compute:
            return _build_block_output(meta, *_block_inputs(meta, args, kwargs))
        output = _original_forward(self)(*args, **kwargs)
        if self.tail:
            _record_residual(state, meta, output, type(module).__name__)
        return output


def _record_residual(state: _TeaCacheState, meta: TransformerBlockMetadata, output: Any, block: str) -> None:
    assert state.stack_input_BLD is not None
    hidden_BLD, encoder = _block_outputs(meta, output)
    if hidden_BLD.shape != state.stack_input_BLD.shape:
        raise ValueError(
            f"cache.policy='teacache': the block stack ending in {block} changes the hidden states' shape "
            f"{tuple(state.stack_input_BLD.shape)} -> {tuple(hidden_BLD.shape)}; no residual can be reused"
        )
    state.residual_BLD = hidden_BLD - state.stack_input_BLD
    same = encoder is not None and state.stack_encoder_input is not None
    state.encoder_residual = encoder - state.stack_encoder_input if same else None
    state.stack_input_BLD = state.stack_encoder_input = None


def _apply_teacache(transformer: nn.Module, blocks: list[nn.Module], config: CacheConfig) -> InstalledCache:
    profile = teacache_profile(transformer)
    if profile.coefficients == IDENTITY:
        warnings.warn(
            f"cache.policy='teacache': no published TeaCache fit for this {type(transformer).__name__} "
            "architecture; using the identity polynomial (uncalibrated)",
            stacklevel=3,
        )
    threshold = config.threshold if config.threshold is not None else profile.threshold
    settings = _TeaCacheSettings(profile, threshold, config.num_inference_steps)
    manager = StateManager(_TeaCacheState)  # type: ignore[arg-type]  # diffusers annotates the class as an instance
    HookRegistry.check_if_exists_or_initialize(blocks[0]).register_hook(
        _TeaCacheHeadHook(manager, settings), _TEACACHE_HEAD_HOOK
    )
    for block in blocks[1:]:
        hook = _TeaCacheBlockHook(manager, tail=block is blocks[-1])
        HookRegistry.check_if_exists_or_initialize(block).register_hook(hook, _TEACACHE_BLOCK_HOOK)
    # cache_context reaches hooks through a cached list of child registries: rebuild it.
    HookRegistry.check_if_exists_or_initialize(transformer).invalidate_child_registries_cache()
    return InstalledCache(CachePolicy.TEACACHE, threshold, profile.source)


def _original_forward(hook: ModelHook) -> Callable[..., Any]:
    """The hooked block's own forward (diffusers types it None until the hook is registered)."""
    return cast(Callable[..., Any], hook.fn_ref.original_forward)


def _block_inputs(meta: TransformerBlockMetadata, args: tuple, kwargs: dict) -> tuple[torch.Tensor, Any]:
    """A block's hidden states and, for a two-stream block, its encoder (text) hidden states."""
    hidden = meta._get_parameter_from_args_kwargs(meta.hidden_states_argument_name, args, kwargs)
    encoder = None
    if meta.return_encoder_hidden_states_index is not None:
        encoder = meta._get_parameter_from_args_kwargs(meta.encoder_hidden_states_argument_name, args, kwargs)
    return hidden, encoder


def _block_outputs(meta: TransformerBlockMetadata, output: Any) -> tuple[torch.Tensor, Any]:
    if not isinstance(output, tuple):
        return output, None
    encoder_index = meta.return_encoder_hidden_states_index
    return output[meta.return_hidden_states_index], None if encoder_index is None else output[encoder_index]


def _build_block_output(meta: TransformerBlockMetadata, hidden: torch.Tensor, encoder: Any) -> Any:
    """What the block returns, in its own layout (a tensor, or a tuple ordered by its metadata)."""
    encoder_index = meta.return_encoder_hidden_states_index
    if encoder_index is None:
        return hidden
    output: list[Any] = [None] * (max(meta.return_hidden_states_index, encoder_index) + 1)
    output[meta.return_hidden_states_index] = hidden
    output[encoder_index] = encoder
    return tuple(output)


# --- a denoiser's cache across requests -------------------------------------------------------------

T = TypeVar("T")


class StepCache:
    """What a denoising stage runs its loop with: ``policy`` installed on each of its transformers
    for the request's step count (reinstalled when the count changes), reset before every request.
    MagCache's ratios come from ``mag_ratios``, else the published ones, else they are measured on
    the first request of each step count, which then runs uncached (:func:`calibrate_mag_ratios`;
    logged). The same numbers serve every later request of that step count."""

    def __init__(
        self,
        policy: CachePolicy | str = CachePolicy.NONE,
        threshold: float | None = None,
        mag_ratios: Sequence[float] | None = None,
    ) -> None:
        self.policy = parse_policy(policy)
        self.threshold = threshold
        self.mag_ratios = tuple(mag_ratios) if mag_ratios is not None else None
        CacheConfig(policy=self.policy, threshold=threshold, num_inference_steps=1, mag_ratios=self.mag_ratios)
        self._measured: dict[tuple[int, int], tuple[float, ...]] = {}

    def check(self, models: Sequence[nn.Module], *, sequence_parallel: bool) -> None:
        """Refuse, before the first request, a policy these transformers cannot run: one the
        classes cannot handle, ``first_block`` under sequence parallelism (each rank would decide
        to skip from its own frames' residual, and the ranks' collectives would no longer pair),
        TeaCache there on a model whose indicator is not the timestep embedding alone (Wan's is),
        and MagCache on two experts without given ratios (each expert sees part of the steps)."""
        if self.policy is CachePolicy.NONE:
            return
        for model in models:
            _block_stack(model, self.policy)
        name = self.policy.value
        if sequence_parallel and self.policy is CachePolicy.FIRST_BLOCK:
            raise ValueError(
                f"cache.policy={name!r} with sequence parallelism: each rank would decide from its own "
                "frames whether to skip; use cache.policy=mag or teacache (Wan), or cfg parallelism"
            )
        if sequence_parallel and self.policy is CachePolicy.TEACACHE:
            other = [type(m).__name__ for m in models if not isinstance(m, WanTransformer3DModel)]
            if other:
                raise ValueError(
                    f"cache.policy={name!r} with sequence parallelism: {other[0]}'s TeaCache indicator "
                    "depends on each rank's frames; use cache.policy=mag or cfg parallelism"
                )
        if self.policy is CachePolicy.MAG and len(models) > 1 and self.mag_ratios is None:
            if any(_published_mag_ratios(m) is None for m in models):
                raise ValueError(
                    f"cache.policy={name!r} on {len(models)} experts: give cache.mag_ratios (each expert "
                    "runs part of the steps, so one request cannot measure them)"
                )

    def run(self, models: Sequence[nn.Module], steps: int, loop: Callable[[], T]) -> T:
        """``loop()`` (one request's denoising, calling the models inside ``cache_context``) with
        the cache installed for ``steps`` steps and reset."""
        if self.policy is CachePolicy.NONE:
            return loop()
        if self.policy is CachePolicy.MAG and self.mag_ratios is None:
            model = models[0]
            if (id(model), steps) not in self._measured and _published_mag_ratios(model) is None:
                remove_cache(model)
                if hasattr(model, _CONFIG_ATTR):
                    delattr(model, _CONFIG_ATTR)
                out: list[T] = []
                ratios = calibrate_mag_ratios(model, lambda: out.append(loop()))
                self._measured[(id(model), steps)] = ratios
                logger.info("cache.policy='mag': measured %d ratios on this uncached request", len(ratios))
                return out[0]
        for model in models:
            self._install(model, steps)
            reset_cache(model)
        return loop()

    def _install(self, model: nn.Module, steps: int) -> None:
        ratios = self.mag_ratios or self._measured.get((id(model), steps))
        want = CacheConfig(policy=self.policy, threshold=self.threshold, num_inference_steps=steps, mag_ratios=ratios)
        if getattr(model, _CONFIG_ATTR, None) == want and installed_cache(model) is not None:
            return
        remove_cache(model)
        apply_cache(model, want)
        setattr(model, _CONFIG_ATTR, want)


_CONFIG_ATTR = "_mmpipe_step_cache_config"
