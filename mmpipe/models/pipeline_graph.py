"""What every diffusers family's inference graph shares: the call binding, the three stages and the
denoising loop driving the pipeline's own scheduler, with classifier-free guidance.

A family (``mmpipe.models.flux``, ``mmpipe.models.ltx``, ...) is a :class:`Family` subclass: the
few pieces of its pipeline's ``__call__`` that differ between pipelines (how prompts are encoded,
how the initial latents and their side tensors are drawn, how the scheduler is set, one
transformer call, the guidance formula, the decode). Each piece calls the pipeline's own methods
(``encode_prompt``, ``prepare_latents``, ``_unpack_latents``, ...) where the pipeline has one, so
the graph returns the pipeline's output for the same seed by construction, and mmpipe's code is the
loop around them::

    text (options: the call's prompt, negative_prompt, image, ...) -> {port, negative_port, ...}
    text.* -> denoise (draws the initial latents from the call's generator) -> latents
    denoise.latents -> decode -> pixels -> the pipeline's post-processing

Adding a family: one module with a :class:`Family` subclass, one line in :data:`FAMILY_MODULES`,
and a parity test against the pipeline on tiny random components (``tests/families/``).

Legend: B batch, N tokens, C channels; a family's own docstring names its latent layout.
"""

from __future__ import annotations

import abc
import copy
import importlib
import inspect
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar, cast

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm.auto import tqdm

from mmpipe.graph import Graph, Stage, TensorSpec
from mmpipe.parallel.denoise import COND, UNCOND, DenoiseGroup, DenoiseLayout
from mmpipe.parallel.modules import SequenceState
from mmpipe.stages.cache import StepCache
from mmpipe.stages.sampler import check_denoise_layout, step_predictions

#: diffusers pipeline class name -> "module:Family class" (imported on first use)
FAMILY_MODULES: dict[str, str] = {
    "WanPipeline": "mmpipe.models.wan:Wan22Family",
    "WanImageToVideoPipeline": "mmpipe.models.wan_i2v:WanI2VFamily",
    "HunyuanVideoPipeline": "mmpipe.models.hunyuan:HunyuanVideoFamily",
    "CogVideoXPipeline": "mmpipe.models.cogvideox:CogVideoXFamily",
    "LTXPipeline": "mmpipe.models.ltx:LTXFamily",
    "FluxPipeline": "mmpipe.models.flux:FluxFamily",
    "QwenImagePipeline": "mmpipe.models.qwenimage:QwenImageFamily",
}

#: ``__call__`` arguments no family's graph implements: precomputed embeddings and latents (the
#: graph computes them), step callbacks (the loop is mmpipe's), ``return_dict`` (the graph returns
#: the frames / images array itself). Passing one with a non-default value is a ``ValueError``.
NOT_IMPLEMENTED = frozenset(
    {
        "prompt_embeds",
        "negative_prompt_embeds",
        "pooled_prompt_embeds",
        "negative_pooled_prompt_embeds",
        "prompt_attention_mask",
        "negative_prompt_attention_mask",
        "prompt_embeds_mask",
        "negative_prompt_embeds_mask",
        "image_embeds",
        "latents",
        "callback_on_step_end",
        "callback_on_step_end_tensor_inputs",
        "callback",
        "callback_steps",
        "return_dict",
        "ip_adapter_image",
        "ip_adapter_image_embeds",
        "negative_ip_adapter_image",
        "negative_ip_adapter_image_embeds",
    }
)

#: ``generate`` keywords of mmpipe's own (not the pipeline's): the seed of a CPU generator, as
#: ``pipe(..., generator=torch.Generator().manual_seed(seed))``, and the progress bar
OWN_KEYWORDS = ("seed", "progress")


def bind_call(
    pipeline_cls: type, args: Sequence[Any], kwargs: Mapping[str, Any], *, not_implemented: frozenset[str]
) -> dict[str, Any]:
    """``pipeline_cls.__call__``'s arguments for ``args`` / ``kwargs`` with its defaults filled in.

    An argument ``__call__`` does not take is a ``TypeError`` naming it (Python's own message, as the
    pipeline would raise); one mmpipe does not implement (``not_implemented``) given with a value
    other than its default is a ``ValueError`` naming it.
    """
    sig = inspect.signature(pipeline_cls.__call__)
    try:
        bound = sig.bind_partial(None, *args, **kwargs)  # None: self
    except TypeError as err:
        raise TypeError(f"{pipeline_cls.__name__}.__call__: {err}") from None
    given = dict(bound.arguments)
    given.pop(next(iter(sig.parameters)))
    for name in sorted(given):
        default = sig.parameters[name].default
        if name in not_implemented and given[name] is not default:
            raise ValueError(
                f"{pipeline_cls.__name__}.__call__ argument {name}={_short(given[name])} is not supported by "
                "mmpipe's graph (it computes embeddings and latents itself, and returns the output array)"
            )
    call = {
        name: p.default
        for name, p in list(sig.parameters.items())[1:]
        if p.default is not inspect.Parameter.empty and p.kind is not inspect.Parameter.VAR_KEYWORD
    }
    return call | given


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def call_generator(call: Mapping[str, Any], seed: int | None) -> torch.Generator | None:
    """The call's generator: its own ``generator``, else a CPU one seeded with ``seed`` (``None``:
    fresh entropy), as ``pipe(..., generator=torch.Generator().manual_seed(seed))``."""
    if call.get("generator") is not None:
        if seed is not None:
            raise ValueError("pass either seed or generator, not both")
        return call["generator"]
    return torch.Generator().manual_seed(seed) if seed is not None else None


def prompt_list(prompt: Any, name: str = "prompt") -> list[str]:
    """``prompt`` (a string or a list of strings) as a non-empty list."""
    prompts = [prompt] if isinstance(prompt, str) else list(prompt) if prompt is not None else []
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"{name} must be a non-empty string or list of strings, got {_short(prompt)}")
    return prompts


class Family(abc.ABC):
    """One diffusers pipeline class as the hooks of the shared graph (see the module docstring).

    ``call`` below is the bound ``__call__`` arguments (:func:`bind_call`) after :meth:`prepare_call`
    (sizes rounded as the pipeline rounds them, so :meth:`decode` can read them); ``state`` is what
    :meth:`prepare_latents` returned beside the latents (ids, masks, condition latents): read by
    :meth:`set_timesteps`, :meth:`predict`, :meth:`guide` and :meth:`step`.
    """

    pipeline_cls: ClassVar[type]
    #: what ``generate`` returns: the pipeline output's ``frames`` (video) or ``images`` (image)
    output: ClassVar[str] = "video"
    #: the pipeline's components each stage owns (a ``None`` component is left out)
    text_components: ClassVar[tuple[str, ...]] = ("text_encoder",)
    denoise_components: ClassVar[tuple[str, ...]] = ("transformer",)
    decode_components: ClassVar[tuple[str, ...]] = ("vae",)
    #: the text stage's output ports (each has an optional ``negative_<port>`` twin)
    condition_ports: ClassVar[tuple[str, ...]] = ("prompt_embeds",)
    #: tensors of the loop's state the decode needs too (LTX's decode noise): optional ports of the
    #: edge ``denoise -> decode``, present when the state holds them
    decode_ports: ClassVar[tuple[str, ...]] = ()
    not_implemented: ClassVar[frozenset[str]] = NOT_IMPLEMENTED
    #: the ``__call__`` argument that scales classifier-free guidance (what ``mmpipe serve``'s
    #: ``guidance`` sets): ``true_cfg_scale`` where ``guidance_scale`` is a distilled embedding
    cfg_argument: ClassVar[str] = "guidance_scale"

    #: state tensors ``(B, C, t, h, w)`` that :meth:`predict` reads beside the latents (an image
    #: condition): a sequence-parallel rank gets its frames of them too
    sequence_state: ClassVar[tuple[str, ...]] = ()
    #: whether :meth:`decode` can split a video's latent frames over ranks (``decode_group``)
    parallel_decode: ClassVar[bool] = False
    decode_group: dist.ProcessGroup | None = None
    decode_split: str = "rows"
    decode_halo: int | None = None

    def __init__(self, pipe: Any) -> None:
        """Wrap ``pipe``; a subclass raises ``ValueError`` here for a pipeline it cannot run."""
        self.pipe = pipe

    # ---- parallel denoising ------------------------------------------------------------------
    @classmethod
    def sequence_parallel(cls, pipeline_config: Mapping[str, Any]) -> str | None:
        """Why the denoiser of a pipeline of this class and ``pipeline_config`` (its
        ``model_index.json``) cannot run sequence parallel; ``None``: it can, through
        :meth:`apply_sequence_hooks`."""
        return f"{cls.pipeline_cls.__name__}'s transformer has no sequence-parallel hooks in mmpipe"

    def apply_sequence_hooks(self, model: nn.Module, state: SequenceState) -> None:
        """Make ``model`` run on a rank's latent frames (:mod:`mmpipe.stages.dit`'s hooks)."""
        raise ValueError(self.sequence_parallel(self.pipe.config) or "no sequence-parallel hooks")

    @classmethod
    def check_parallel(
        cls, layout: DenoiseLayout, pipeline_config: Mapping[str, Any], models: Mapping[str, Any], *, key: str
    ) -> None:
        """Refuse a denoise layout this pipeline cannot run, naming the key (``models``: each denoise
        component's config)."""
        if layout.sp == 1:
            return
        why = cls.sequence_parallel(pipeline_config)
        if why is not None:
            raise ValueError(f"{key}: ulysses x ring = {layout.sp}, but {why}; use cfg=2 or one rank")
        for name, config in models.items():
            check_denoise_layout(config, layout, key=f"{key} ({name})")

    def tokens_per_frame(self, model: nn.Module, latents: torch.Tensor) -> int:
        """Tokens of one latent frame of ``latents`` ``(B, C, t, h, w)`` in ``model``'s sequence."""
        patch = cast(Any, model).config.patch_size
        p_h, p_w = patch[1:] if isinstance(patch, list | tuple) else (patch, patch)
        return (latents.shape[3] // p_h) * (latents.shape[4] // p_w)

    @classmethod
    def image_argument(cls) -> str | None:
        """Whether ``__call__`` takes an input ``image``: ``"required"``, ``"optional"`` or ``None``
        (read from its signature; what ``mmpipe serve`` asks of ``input_reference``)."""
        param = inspect.signature(cls.pipeline_cls.__call__).parameters.get("image")
        if param is None:
            return None
        return "required" if param.default is inspect.Parameter.empty else "optional"

    # ---- the call ----------------------------------------------------------------------------
    def prepare_call(self, call: dict[str, Any]) -> dict[str, Any]:
        """Validate and round ``call`` as the pipeline's ``__call__`` does before encoding (its
        ``check_inputs``, size rounding); returns the call to run."""
        return call

    @abc.abstractmethod
    def guided(self, call: Mapping[str, Any]) -> bool:
        """Whether the call runs a second (negative / unconditional) branch each step."""

    @property
    def execution_device(self) -> torch.device:
        return torch.device(self.pipe._execution_device)

    # ---- stages --------------------------------------------------------------------------------
    @abc.abstractmethod
    def encode(self, call: Mapping[str, Any], guided: bool) -> dict[str, torch.Tensor]:
        """The condition ports (``negative_*`` too when ``guided``) for ``call``'s prompts / image."""

    @abc.abstractmethod
    def prepare_latents(
        self, call: Mapping[str, Any], cond: Mapping[str, torch.Tensor], generator: torch.Generator | None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The initial latents (drawn from ``generator`` exactly as the pipeline draws them) and
        the state the loop and the decode read."""

    @abc.abstractmethod
    def set_timesteps(
        self, scheduler: Any, call: Mapping[str, Any], latents: torch.Tensor, state: dict[str, Any]
    ) -> torch.Tensor:
        """Set ``scheduler`` (a private copy) for the call as the pipeline does; its timesteps."""

    def model_for(
        self, step: int, t: torch.Tensor, call: Mapping[str, Any], state: Mapping[str, Any]
    ) -> tuple[str, float]:
        """The denoiser component and the guidance scale of step ``step`` (two-expert families
        switch both at a boundary)."""
        return self.denoise_components[0], float(call["guidance_scale"])

    @abc.abstractmethod
    def predict(
        self,
        model: nn.Module,
        latents: torch.Tensor,
        t: torch.Tensor,
        cond: Mapping[str, torch.Tensor],
        call: Mapping[str, Any],
        state: dict[str, Any],
    ) -> torch.Tensor:
        """One transformer call on one branch's condition (``cond`` holds the unprefixed ports)."""

    def guide(
        self,
        pred: torch.Tensor,
        pred_uncond: torch.Tensor,
        scale: float,
        call: Mapping[str, Any],
        state: dict[str, Any],
    ) -> torch.Tensor:
        """Classifier-free guidance, the diffusers formula."""
        return pred_uncond + scale * (pred - pred_uncond)

    def step(
        self, scheduler: Any, pred: torch.Tensor, t: torch.Tensor, latents: torch.Tensor, state: dict[str, Any]
    ) -> torch.Tensor:
        """One scheduler step."""
        return scheduler.step(pred, t, latents, return_dict=False)[0]

    def finish(self, latents: torch.Tensor, call: Mapping[str, Any], state: dict[str, Any]) -> torch.Tensor:
        """The denoised latents after the last step (TI2V writes the image's latents back here)."""
        return latents

    @abc.abstractmethod
    def decode(
        self, latents: torch.Tensor, call: Mapping[str, Any], extras: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """The denoised latents as the pixel tensor the pipeline post-processes (``extras``: the
        :attr:`decode_ports` the loop's state held)."""

    def postprocess(self, pixels: torch.Tensor, call: Mapping[str, Any]) -> Any:
        """What the pipeline returns in ``frames`` / ``images`` for ``call["output_type"]``."""
        if call.get("output_type") == "latent":
            return pixels
        if self.output == "video":
            return self.pipe.video_processor.postprocess_video(pixels, output_type=call["output_type"])
        return self.pipe.image_processor.postprocess(pixels, output_type=call["output_type"])


def condition_specs(family: Family) -> dict[str, TensorSpec]:
    """The condition ports: each of the family's, and its optional ``negative_`` twin."""
    ports = {p: TensorSpec() for p in family.condition_ports}
    return ports | {f"negative_{p}": TensorSpec(required=False) for p in family.condition_ports}


def _components(pipe: Any, names: Sequence[str]) -> nn.ModuleDict:
    return nn.ModuleDict({n: m for n in names if isinstance(m := getattr(pipe, n, None), nn.Module)})


class _FamilyStage(Stage):
    """A stage whose module is some of the pipeline's components (the same objects, no copy)."""

    def __init__(self, name: str, family: Family, components: Sequence[str]) -> None:
        super().__init__(name, frozen=True)
        self.family = family
        self._module = _components(family.pipe, components)

    def build(self) -> nn.Module:
        module: Any = self.module
        return _components(self.family.pipe, list(module.keys()))

    def device(self) -> torch.device:
        # The pipeline's execution device: stages of one pipeline object share it.
        return self.family.execution_device


class ConditionStage(_FamilyStage):
    """Prompts (and an image, for image-conditioned families) -> the family's condition ports."""

    kind = "text_encoder"

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        return {}

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        return condition_specs(self.family)

    def forward(self, module: nn.Module, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        return self.family.encode(options["call"], options["guided"])


class DenoiseLoopStage(_FamilyStage):
    """Condition ports -> denoised latents: the initial latents drawn as the pipeline draws them,
    then the loop every family shares."""

    kind = "denoise"

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        return condition_specs(self.family)

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        return {"latents": TensorSpec()} | {p: TensorSpec(required=False) for p in self.family.decode_ports}

    def forward(self, module: nn.Module, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        """Options: ``call`` and ``guided`` (required), ``generator``, ``progress``."""
        call: Mapping[str, Any] = options["call"]
        guided: bool = options["guided"]
        experts: Any = module
        fam = self.family
        ports = fam.condition_ports
        cond = {p: inputs[p] for p in ports if p in inputs}
        uncond = {p: inputs[f"negative_{p}"] for p in ports if f"negative_{p}" in inputs} if guided else None
        if guided and not uncond:
            raise ValueError(f"stage {self.name!r}: a guided call needs the negative condition ports")
        latents, state = fam.prepare_latents(call, cond, options.get("generator"))
        # A private scheduler: schedulers are stateful (step index, multistep history).
        scheduler = copy.deepcopy(fam.pipe.scheduler)
        timesteps = fam.set_timesteps(scheduler, call, latents, state)
        par = self.parallel
        if par is not None:
            par.layout.check_frames(latents.shape[2], key=f"stage {self.name!r}")
        conditions = {COND: cond, UNCOND: uncond}
        frames = latents.shape[2] if par is not None else 0

        def loop() -> torch.Tensor:
            x0 = latents
            for i, t in enumerate(tqdm(timesteps, desc=self.name, disable=not options.get("progress"), leave=False)):
                state["step"] = i
                component, scale = fam.model_for(i, t, call, state)
                model = experts[component]
                x, local_state = x0, state
                if par is not None:
                    x = par.local(x0)
                    local_state = state | {
                        k: par.local(state[k]) for k in fam.sequence_state if state.get(k) is not None
                    }

                # (loop values bound as defaults: ruff's B023; both run before the loop moves on)
                def predict(
                    branch: str,
                    m: nn.Module = model,
                    x: torch.Tensor = x,
                    t: torch.Tensor = t,
                    s: dict[str, Any] = local_state,
                ) -> torch.Tensor:
                    return fam.predict(m, x, t, conditions[branch] or {}, call, s)

                def tokens(m: nn.Module = model, x0: torch.Tensor = x0) -> int:
                    return fam.tokens_per_frame(m, x0)

                preds = step_predictions(
                    model, predict, guided=guided, group=par, frames=frames, tokens_per_frame=tokens
                )
                pred = fam.guide(preds[COND], preds[UNCOND], scale, call, state) if guided else preds[COND]
                x0 = fam.step(scheduler, pred, t, x0, state)
            return x0

        models = list(cast(Any, module).values())
        latents = self.step_cache.run(models, len(timesteps), loop)
        extras = {p: state[p] for p in fam.decode_ports if state.get(p) is not None}
        return {"latents": fam.finish(latents, call, state)} | extras

    #: the step cache each request runs with (``cache.policy``; none by default)
    step_cache: StepCache = StepCache()

    def use_step_cache(self, cache: StepCache) -> None:
        """Run every request with ``cache`` (checked against the denoisers and the layout now)."""
        sp = self.parallel is not None and self.parallel.layout.sp > 1
        cache.check(list(cast(Any, self.module).values()), sequence_parallel=sp)
        self.step_cache = cache

    parallel: DenoiseGroup | None = None

    def parallelize(self, group: DenoiseGroup) -> None:
        """Denoise each request over ``group``'s ranks (:mod:`mmpipe.parallel.denoise`)."""
        fam = self.family
        models = {n: m.config for n in fam.denoise_components if (m := getattr(fam.pipe, n, None)) is not None}
        fam.check_parallel(group.layout, fam.pipe.config, models, key=f"stage {self.name!r}")
        if group.state is not None:
            for model in cast(Any, self.module).values():
                fam.apply_sequence_hooks(model, group.state)
        self.parallel = group


class DecodeStage(_FamilyStage):
    """Denoised latents -> pixels (the tensor the pipeline post-processes)."""

    kind = "vae_decode"

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        return {"latents": TensorSpec()} | {p: TensorSpec(required=False) for p in self.family.decode_ports}

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        return {"pixels": TensorSpec()}

    def parallelize(self, group: dist.ProcessGroup | None, *, split: str = "rows", halo: int | None = None) -> None:
        """Decode each video over ``group``'s ranks (the family's :meth:`Family.decode` reads it)."""
        fam = self.family
        if not fam.parallel_decode:
            raise ValueError(
                f"placement.decode: {fam.pipeline_cls.__name__}'s VAE decode is not split over ranks in mmpipe; "
                "name one rank"
            )
        fam.decode_group, fam.decode_split, fam.decode_halo = group, split, halo

    def forward(self, module: nn.Module, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        call: Mapping[str, Any] = options["call"]
        if call.get("output_type") == "latent":  # as the pipelines return them
            return {"pixels": inputs["latents"]}
        extras = {p: inputs[p] for p in self.family.decode_ports if p in inputs}
        return {"pixels": self.family.decode(inputs["latents"], call, extras)}


class PipelineGraph(Graph):
    """A diffusers pipeline as ``text -> denoise -> decode`` whose :meth:`generate` takes the
    pipeline's ``__call__`` arguments and returns what the pipeline returns in ``frames`` (video
    families) or ``images`` (image families)."""

    def __init__(self, family: Family, defaults: Mapping[str, Any] | None = None) -> None:
        """``defaults``: ``__call__`` arguments a ``generate`` call that does not give them gets
        (``from_diffusers``'s ``max_sequence_length``), instead of the pipeline's defaults."""
        super().__init__(f"{type(family.pipe).__name__}_inference")
        self.family = family
        self.defaults = dict(defaults or {})
        self.pipe = family.pipe
        self.text = ConditionStage("text", family, family.text_components)
        self.denoise = DenoiseLoopStage("denoise", family, family.denoise_components)
        self.decode = DecodeStage("decode", family, family.decode_components)
        for stage in (self.text, self.denoise, self.decode):
            self.add_stage(stage)
        for port in family.condition_ports:
            self.connect(f"text.{port}", f"denoise.{port}")
            self.connect(f"text.negative_{port}", f"denoise.negative_{port}")
        for port in ("latents", *family.decode_ports):
            self.connect(f"denoise.{port}", f"decode.{port}")
        self.validate()

    def bind(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The prepared call of ``generate(*args, **kwargs)`` (mmpipe's own keywords excluded)."""
        fam = self.family
        call = bind_call(fam.pipeline_cls, args, self.defaults | kwargs, not_implemented=fam.not_implemented)
        return fam.prepare_call(call)

    def generate(self, *args: Any, seed: int | None = None, progress: bool = True, **kwargs: Any) -> Any:
        """``pipe(*args, **kwargs)``'s ``frames`` / ``images`` computed by the graph's stages, with
        ``generator=torch.Generator().manual_seed(seed)`` unless a ``generator`` is given."""
        fam = self.family
        call = self.bind(*args, **kwargs)
        generator = call_generator(call, seed)
        guided = fam.guided(call)
        options: dict[str, dict[str, Any]] = {
            "text": {"call": call, "guided": guided},
            "denoise": {"call": call, "guided": guided, "generator": generator, "progress": progress},
            "decode": {"call": call},
        }
        with torch.no_grad():
            out = self.run({}, options)
        return fam.postprocess(out["decode"]["pixels"], call)


def family_for(pipe: Any) -> type[Family]:
    """The :class:`Family` of a pipeline object (its exact class), or a ``ValueError`` listing the
    supported pipelines."""
    name = type(pipe).__name__
    if name not in FAMILY_MODULES:
        raise ValueError(f"from_diffusers: {name} is not supported; supported pipelines: {sorted(FAMILY_MODULES)}")
    family = family_class(name)
    if type(pipe) is not family.pipeline_cls:
        raise ValueError(f"from_diffusers: {name} is not supported; supported pipelines: {sorted(FAMILY_MODULES)}")
    return family


def read_model_index(root: Path, where: str) -> dict[str, Any]:
    """A local pipeline directory's ``model_index.json``, or a ``ValueError`` starting with
    ``where`` (the key and directory) saying what is wrong; nothing is ever downloaded."""
    index = root / "model_index.json"
    if not index.is_file():
        raise ValueError(
            f"{where} is not a local diffusers pipeline directory (no model_index.json); "
            "mmpipe never downloads from a hub at run time"
        )
    try:
        meta = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{where}: model_index.json is not readable JSON ({err})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{where}: model_index.json is not a JSON object")
    return meta


def check_component(root: Path, component: str, where: str) -> None:
    """The component's folder exists and its safetensors headers read (the header only:
    microseconds, memory-mapped, and catches truncated and corrupt files)."""
    if not (root / component).is_dir():
        raise ValueError(f"{where}: the {component} folder is missing")
    for weights in sorted((root / component).glob("*.safetensors")):
        try:
            with safe_open(weights, framework="pt") as f:
                f.keys()
        except (SafetensorError, OSError) as err:
            raise ValueError(
                f"{where}: {weights.relative_to(root)} is not a readable safetensors file ({err})"
            ) from None


def check_family_dir(path: str | Path, *, key: str = "pipeline") -> Path:
    """``path`` as a local diffusers directory of a supported pipeline class, checked from its
    ``model_index.json``, component folders and safetensors headers without loading any weights;
    raises ``ValueError`` naming ``key``, the directory and what is wrong."""
    root = Path(path)
    where = f"{key}={str(root)!r}"
    meta = read_model_index(root, where)
    name = meta.get("_class_name")
    if name not in FAMILY_MODULES:
        raise ValueError(
            f"{where}: model_index.json's _class_name={name!r} is not supported; supported: {sorted(FAMILY_MODULES)}"
        )
    for component, entry in meta.items():
        if not component.startswith("_") and isinstance(entry, list) and entry != [None, None]:
            check_component(root, component, where)
    return root


def check_parallel_dir(root: Path, layout: DenoiseLayout, *, key: str) -> None:
    """:meth:`Family.check_parallel` for the pipeline directory ``root`` from its config files alone
    (nothing is loaded: it runs before any worker starts)."""
    index = read_model_index(root, str(root))
    fam = family_class(str(index.get("_class_name")))
    models: dict[str, Any] = {}
    for name in fam.denoise_components:
        path = root / name / "config.json"
        if isinstance(index.get(name), list) and index[name][0] is not None and path.is_file():
            models[name] = SimpleNamespace(**json.loads(path.read_text()))
    fam.check_parallel(layout, index, models, key=key)


def family_class(pipeline_class: str) -> type[Family]:
    """The :class:`Family` registered for a pipeline class name (imported on first use)."""
    if pipeline_class not in FAMILY_MODULES:
        raise ValueError(f"{pipeline_class} is not supported; supported pipelines: {sorted(FAMILY_MODULES)}")
    module, _, cls = FAMILY_MODULES[pipeline_class].partition(":")
    family: type[Family] = getattr(importlib.import_module(module), cls)
    return family
