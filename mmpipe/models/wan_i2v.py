"""Wan image-to-video (``diffusers.WanImageToVideoPipeline``): the family's hooks of the shared
inference graph (:mod:`mmpipe.models.pipeline_graph`) and its tiny random-weight presets.

Latents ``(B, Z, t, h, w)`` float32, as the pipeline keeps them. The image conditions twice:
CLIP's penultimate hidden states ``(B, N, D)`` (``image_embeds``, for Wan 2.1 transformers, which
have an ``image_dim``) are a condition port beside the T5 ``prompt_embeds``; and the condition
latents, which the pipeline's own ``prepare_latents`` draws beside the noise, ride in the loop's
state: ``(B, S + Z, t, h, w)``, a first-frame mask of ``S`` channels then the VAE latents of the
image (and of a ``last_image``) followed by zero frames, concatenated to the latents on the
channel axis at each step. Wan 2.2's paths run too: two experts (``transformer_2`` below
``boundary_ratio``, with ``guidance_scale_2``), and TI2V's ``expand_timesteps``, whose condition
is the image's latents ``(B, Z, 1, h, w)`` written over the first latent frame (whose tokens take
timestep 0) at each step and after the last.

Training graph (:func:`build_wan_i2v_training_graph`), each clip conditioning on its own first
frame; Wan 2.1 I2V's::

    input.{input_ids, attention_mask} -> text.context -> dit.context
    input.video -> clip.image_embeds -> dit.image_embeds
    input.video -> vae.{latents, condition} -> dit.{latents, condition} -> dit.loss

Wan 2.2 I2V's has no ``clip`` and two experts (``dit``, ``dit_2``) on the same ports; TI2V's has no
``clip`` and no condition (its DiT keeps the latents' first frame clean). FLF2V's conditions on
each clip's first and last frames.

Tiny presets: the real component classes (``WanTransformer3DModel``, ``AutoencoderKLWan``,
``UMT5EncoderModel``, ``CLIPVisionModel`` with a ``CLIPImageProcessor``) from small configs, a
word-level tokenizer built locally (nothing is downloaded), saved with ``save_pretrained``.

Legend: B batch, Z latent channels, S the VAE's temporal compression, t/h/w latent frames/height/width,
N image tokens, D CLIP width.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, cast

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanImageToVideoPipeline, WanTransformer3DModel
from torch import nn
from transformers import AutoTokenizer, CLIPVisionConfig, CLIPVisionModel

from mmpipe.config import ModelConfig
from mmpipe.data import caption_vocabulary
from mmpipe.graph import Graph, TensorSpec
from mmpipe.models.pipeline_graph import check_component, prompt_list, read_model_index
from mmpipe.models.wan import (
    Wan22Family,
    build_text_encoder,
    build_text_stage,
    build_word_tokenizer,
    flow_shift_of,
    two_experts,
)
from mmpipe.stages import (
    CLIPImageEncoderStage,
    WanI2VDiTFlowMatchingStage,
    WanI2VVAEEncodeStage,
    WanTI2VDiTFlowMatchingStage,
    WanVAEEncodeStage,
)


class WanI2VFamily(Wan22Family):
    """``WanImageToVideoPipeline``: Wan 2.1 I2V (CLIP image embeddings and the VAE-encoded first
    frame condition one expert), FLF2V (a ``last_image`` too), Wan 2.2 I2V (two experts split at
    ``boundary_ratio``) and TI2V (``expand_timesteps``: per-token timesteps, the first latent frame
    is the image's).

    Latents ``(B, Z, t, h, w)`` float32; the condition latents in the state (see the module docstring).
    Sizes, text encoding, the expert boundary and the decode are :class:`Wan22Family`'s.
    """

    pipeline_cls = WanImageToVideoPipeline
    text_components = ("text_encoder", "image_encoder")
    denoise_components = ("transformer", "transformer_2")
    condition_ports: ClassVar[tuple[str, ...]] = ("prompt_embeds", "image_embeds")
    sequence_state = ("condition",)  # the first frame's latents, concatenated to the latents' channels

    def __init__(self, pipe: Any) -> None:
        super().__init__(pipe)
        if not self.takes_image_embeds:
            # Wan 2.2's transformers take no CLIP embeddings: the port would have no value. (Ports
            # are a class attribute of Family; this pipeline's depend on its transformer's config.)
            self.condition_ports = ("prompt_embeds",)  # type: ignore[misc]

    @property
    def takes_image_embeds(self) -> bool:
        """Whether the pipeline feeds CLIP embeddings (its ``transformer`` has an ``image_dim``)."""
        t = self.pipe.transformer
        return t is not None and t.config.image_dim is not None

    def prepare_call(self, call: dict[str, Any]) -> dict[str, Any]:
        """The required ``image``, the pipeline's ``check_inputs``, and the frame count and sizes
        rounded as ``__call__`` rounds them; ``guidance_scale_2`` defaults to ``guidance_scale``
        on two-expert pipelines."""
        p = self.pipe
        if "image" not in call:
            raise TypeError(
                "WanImageToVideoPipeline.__call__: missing a required argument: 'image' "
                "(the first frame, a PIL image or a tensor)"
            )
        p.check_inputs(
            call["prompt"],
            call["negative_prompt"],
            call["image"],
            call["height"],
            call["width"],
            callback_on_step_end_tensor_inputs=call["callback_on_step_end_tensor_inputs"],
            guidance_scale_2=call["guidance_scale_2"],
        )
        return self._fit_call(call)

    def encode(self, call: Mapping[str, Any], guided: bool) -> dict[str, torch.Tensor]:
        """``encode_prompt``, and ``encode_image`` on the image (and ``last_image``) where the
        transformer takes CLIP embeddings: both branches share them."""
        p = self.pipe
        out = super().encode(call, guided)
        dtype = self._expert().dtype
        if self.takes_image_embeds:
            images = call["image"] if call["last_image"] is None else [call["image"], call["last_image"]]
            # as __call__: repeated for the prompts, not for num_videos_per_prompt
            embeds = (
                p.encode_image(images, self.execution_device).repeat(len(prompt_list(call["prompt"])), 1, 1).to(dtype)
            )
            out["image_embeds"] = embeds
            if guided:
                out["negative_image_embeds"] = embeds
        return out

    def prepare_latents(
        self, call: Mapping[str, Any], cond: Mapping[str, torch.Tensor], generator: torch.Generator | None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The pipeline's ``video_processor.preprocess`` of the image(s) and its ``prepare_latents``:
        the noise, then the VAE-encoded condition (the VAE is the decode stage's component; the
        pipeline's method runs it where it is)."""
        p = self.pipe
        device = self.execution_device
        height, width = call["height"], call["width"]
        image = p.video_processor.preprocess(call["image"], height=height, width=width).to(device, torch.float32)
        last = call["last_image"]
        if last is not None:
            last = p.video_processor.preprocess(last, height=height, width=width).to(device, torch.float32)
        out = p.prepare_latents(
            image,
            len(prompt_list(call["prompt"])) * call["num_videos_per_prompt"],
            p.vae.config.z_dim,
            height,
            width,
            call["num_frames"],
            torch.float32,
            device,
            generator,
            None,
            last,
        )
        latents, condition = out[0], out[1]
        return latents, {
            "condition": condition,
            "first_frame_mask": out[2] if p.config.expand_timesteps else None,
            "dtype": self._expert().dtype,
        }

    def predict(
        self,
        model: nn.Module,
        latents: torch.Tensor,
        t: torch.Tensor,
        cond: Mapping[str, torch.Tensor],
        call: Mapping[str, Any],
        state: dict[str, Any],
    ) -> torch.Tensor:
        """The latents with their condition (concatenated, or TI2V's first frame replaced, with a
        timestep per 2x2-patched token) through one expert."""
        condition, mask = state["condition"], state["first_frame_mask"]
        if mask is not None:
            model_input = ((1 - mask) * condition + mask * latents).to(state["dtype"])
            timestep = (mask[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0).expand(latents.shape[0], -1)
        else:
            model_input = torch.cat([latents, condition], dim=1).to(state["dtype"])
            timestep = t.expand(latents.shape[0])
        pred = model(
            hidden_states=model_input,
            timestep=timestep,
            encoder_hidden_states=cond["prompt_embeds"],
            encoder_hidden_states_image=cond.get("image_embeds"),
            attention_kwargs=call["attention_kwargs"],
            return_dict=False,
        )[0]
        return cast(torch.Tensor, pred)

    def finish(self, latents: torch.Tensor, call: Mapping[str, Any], state: dict[str, Any]) -> torch.Tensor:
        """TI2V: the first latent frame becomes the image's, as ``__call__`` does after its loop
        (so ``output_type="latent"`` returns it too)."""
        mask = state["first_frame_mask"]
        return latents if mask is None else (1 - mask) * state["condition"] + mask * latents


# ---- training ----------------------------------------------------------------------------------------

#: Wan 2.1 I2V's image cross-attention takes all but the context's last 512 tokens as the image's
#: (diffusers' ``WanAttnProcessor``: ``image_context_length = encoder_hidden_states.shape[1] - 512``),
#: so its prompts are padded to exactly 512 tokens, as the pipeline pads them
I2V_TEXT_LEN = 512

#: where each input port of an image-to-video DiT stage comes from
I2V_DIT_SOURCES = {
    "context": "text.context",
    "latents": "vae.latents",
    "condition": "vae.condition",
    "image_embeds": "clip.image_embeds",
}


def connect_i2v_training_graph(g: Graph, experts: Sequence[str]) -> None:
    """The edges of an image-to-video training graph whose stages are added: the prompt to
    ``text``, the clip to ``vae`` (and ``clip``), every port of each expert from the stage that
    makes it (:data:`I2V_DIT_SOURCES`)."""
    g.connect("input.input_ids", "text.input_ids")
    g.connect("input.attention_mask", "text.attention_mask")
    g.connect("input.video", "vae.video")
    if "clip" in g.stages:
        g.connect("input.video", "clip.video")
    for expert in experts:
        for port in g.stages[expert].inputs:
            g.connect(I2V_DIT_SOURCES[port], f"{expert}.{port}")


def check_i2v_text_len(text_len: int) -> None:
    """A ``ValueError`` unless ``text_len`` (``model.text_len``) is :data:`I2V_TEXT_LEN`."""
    if text_len != I2V_TEXT_LEN:
        raise ValueError(
            f"model.text_len={text_len}: Wan 2.1 I2V's transformer takes the last {I2V_TEXT_LEN} context "
            f"tokens as the text and the rest as the image's; set model.text_len={I2V_TEXT_LEN}"
        )


def _transformer_config(root: Path) -> dict[str, Any]:
    config = root / "transformer" / "config.json"
    return cast(dict[str, Any], json.loads(config.read_text())) if config.is_file() else {}


def is_flf2v(root: Path) -> bool:
    """Whether the directory's transformer is Wan 2.1 FLF2V's (``pos_embed_seq_len``: first and last frames)."""
    return _transformer_config(root).get("pos_embed_seq_len") is not None


def check_i2v_training_dir(root: Path, meta: Mapping[str, Any], where: str) -> None:
    """Refuse the ``WanImageToVideoPipeline`` layouts training does not cover (a ``ValueError``
    naming ``where`` and why), from ``model_index.json`` and the transformer's config only. It
    trains Wan 2.1 I2V (one transformer with CLIP image embeddings), Wan 2.2 I2V (two experts split
    at ``boundary_ratio``, no CLIP), Wan 2.2 TI2V (``expand_timesteps``), each clip conditioned
    on its own first frame, and Wan 2.1 FLF2V (``pos_embed_seq_len``) on its first and last frames."""
    # (check_pipeline_dir refuses a transformer_2 without a boundary_ratio, and the reverse)
    if meta.get("expand_timesteps") and two_experts(meta):
        raise ValueError(f"{where}: expand_timesteps=True (Wan 2.2 TI2V) with two experts is not a Wan layout")
    config = _transformer_config(root)
    if config.get("pos_embed_seq_len") is not None and config.get("image_dim") is None:
        raise ValueError(
            f"{where}: the transformer has pos_embed_seq_len (FLF2V's first and last frames' CLIP "
            "embeddings) but no image_dim to take them"
        )
    if config.get("image_dim") is not None:  # Wan 2.1 I2V: the CLIP stage's components
        for component in ("image_encoder", "image_processor"):
            entry = meta.get(component)
            if not (isinstance(entry, list) and all(entry)):
                raise ValueError(
                    f"{where}: the transformer takes CLIP image embeddings (image_dim={config['image_dim']}) "
                    f"but model_index.json names no {component} (got {entry!r})"
                )
            check_component(root, component, where)


def wan_i2v_training_stages(root: Path) -> tuple[str, ...]:
    """The stage names of :func:`build_wan_i2v_training_graph` for the directory ``root``: ``clip``
    where the transformer takes CLIP embeddings (Wan 2.1), ``dit_2`` for Wan 2.2's second expert."""
    meta = json.loads((root / "model_index.json").read_text())
    clip = ("clip",) if _transformer_config(root).get("image_dim") is not None else ()
    return ("text", *clip, "vae", "dit", *(("dit_2",) if two_experts(meta) else ()))


def build_wan_i2v_training_graph(pipeline_dir: str | Path, *, text_len: int) -> Graph:
    """The flow-matching training graph of a local ``WanImageToVideoPipeline`` directory, each clip
    conditioning on its own first frame. Wan 2.1 I2V::

        input.{input_ids, attention_mask} -> text.context -> dit.context
        input.video -> clip.image_embeds -> dit.image_embeds
        input.video -> vae.{latents, condition} -> dit.{latents, condition} -> dit.loss

    Wan 2.1 FLF2V: the same stages on the first and the last frame (``clip`` embeds both, the
    condition holds both). Wan 2.2 I2V: no ``clip``; the experts ``dit`` (noise levels from
    ``boundary_ratio`` up) and ``dit_2`` (below) take the same ports. Wan 2.2 TI2V: no ``clip``, no
    condition port (the DiT keeps the latents' first frame clean,
    :class:`~mmpipe.stages.WanTI2VDiTFlowMatchingStage`).

    ``text_len`` (``model.text_len``) must be 512 (:data:`I2V_TEXT_LEN`) where CLIP embeddings
    share the context (Wan 2.1)."""
    root = Path(pipeline_dir)
    where = f"model.path={str(root)!r}"
    meta = read_model_index(root, where)
    check_i2v_training_dir(root, meta, where)
    stages = wan_i2v_training_stages(root)
    if "clip" in stages:
        check_i2v_text_len(text_len)
    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
    shift = flow_shift_of(UniPCMultistepScheduler.load_config(root / "scheduler"))
    ti2v = bool(meta.get("expand_timesteps"))
    g = Graph("wan_ti2v_train" if ti2v else "wan_i2v_train")
    g.add_input("input_ids", TensorSpec(("B", text_len), torch.int64))
    g.add_input("attention_mask", TensorSpec(("B", text_len), torch.int64))
    g.add_input("video", TensorSpec(("B", 3, "T", "H", "W"), torch.float32))
    g.add_stage(build_text_stage("text", root / "text_encoder", tokenizer, max_length=text_len))
    flf2v = is_flf2v(root)  # the first and the last frame condition
    if "clip" in stages:
        g.add_stage(CLIPImageEncoderStage.from_pipeline_dir("clip", root, last_frame=flf2v))
    if ti2v:
        g.add_stage(WanVAEEncodeStage.from_pretrained("vae", root / "vae"))
    else:
        g.add_stage(WanI2VVAEEncodeStage.from_pretrained("vae", root / "vae", last_frame=flf2v))
    dit_cls = WanTI2VDiTFlowMatchingStage if ti2v else WanI2VDiTFlowMatchingStage
    if "dit_2" in stages:  # Wan 2.2: each expert trains on the noise range the sampler gives it
        boundary = float(meta["boundary_ratio"])
        experts = {"dit": ("transformer", (boundary, 1.0)), "dit_2": ("transformer_2", (0.0, boundary))}
    else:
        experts = {"dit": ("transformer", (0.0, 1.0))}
    for name, (component, sigmas) in experts.items():
        g.add_stage(dit_cls.from_pretrained(name, root / component, shift=shift, sigma_range=sigmas))
    connect_i2v_training_graph(g, list(experts))
    g.validate()
    return g


# ---- tiny presets -------------------------------------------------------------------------------

#: the tiny presets: Wan 2.1 I2V (CLIP embeddings, the condition concatenated), FLF2V (first and
#: last frames), Wan 2.2 I2V (two experts, no CLIP) and TI2V (``expand_timesteps``, no CLIP)
TinyVariant = Literal["wan21", "flf2v", "wan22", "ti2v"]

CLIP_IMAGE_SIZE = 32
CLIP_PATCH = 8  # (32 / 8)^2 patches + the class token: 17 image tokens


def build_tiny_wan_i2v_pipeline(
    *, seed: int = 0, variant: TinyVariant = "wan21", texts: Sequence[str] | None = None
) -> WanImageToVideoPipeline:
    """Random-weight ``WanImageToVideoPipeline`` components from small configs; weights are a pure
    function of ``seed``. ``variant`` picks a real checkpoint's layout (:data:`TinyVariant`); the
    tokenizer knows the words of ``texts`` (the moving-shapes captions by default). Prompts are
    padded to 512 tokens (the default ``max_sequence_length``: Wan 2.1's image cross-attention
    splits the image tokens off at 512 text tokens); sizes are multiples of 16 pixels."""
    # Imported here: without torchvision, importing CLIPImageProcessor logs a fallback warning, and
    # mmpipe.models (which imports this module for training) must not print at import time.
    from transformers import CLIPImageProcessor

    if variant not in ("wan21", "flf2v", "wan22", "ti2v"):
        raise ValueError(f"variant must be 'wan21', 'flf2v', 'wan22' or 'ti2v', got {variant!r}")
    texts = [*caption_vocabulary(), "blurry static"] if texts is None else texts
    spec = ModelConfig()
    tokenizer = build_word_tokenizer(texts)
    clip = variant in ("wan21", "flf2v")
    image_tokens = (CLIP_IMAGE_SIZE // CLIP_PATCH) ** 2 + 1
    heads, head_dim = 2, 16
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = build_text_encoder(spec, vocab_size=len(tokenizer))
        vae = AutoencoderKLWan(
            base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        )
        image_encoder = (
            CLIPVisionModel(
                CLIPVisionConfig(
                    hidden_size=16,
                    intermediate_size=32,
                    projection_dim=16,
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    image_size=CLIP_IMAGE_SIZE,
                    patch_size=CLIP_PATCH,
                )
            )
            if clip
            else None
        )
        experts = [
            WanTransformer3DModel(
                patch_size=(1, 2, 2),
                num_attention_heads=heads,
                attention_head_dim=head_dim,
                # TI2V denoises the latents alone; the others see [latents, mask, condition]
                in_channels=16 if variant == "ti2v" else 16 + 4 + 16,
                out_channels=16,
                text_dim=spec.text_dim,
                freq_dim=64,
                ffn_dim=64,
                num_layers=2,
                cross_attn_norm=True,
                qk_norm="rms_norm_across_heads",
                image_dim=16 if clip else None,
                added_kv_proj_dim=heads * head_dim if clip else None,
                rope_max_seq_len=64,
                pos_embed_seq_len=2 * image_tokens if variant == "flf2v" else None,
            )
            for _ in range(2 if variant == "wan22" else 1)
        ]
    for module in (text_encoder, vae, image_encoder, *experts):
        if module is not None:
            cast(nn.Module, module).eval()  # as from_pretrained returns them
    image_processor = (
        CLIPImageProcessor(
            size={"shortest_edge": CLIP_IMAGE_SIZE}, crop_size={"height": CLIP_IMAGE_SIZE, "width": CLIP_IMAGE_SIZE}
        )
        if clip
        else None
    )
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0
    )
    return WanImageToVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=scheduler,
        image_processor=image_processor,
        image_encoder=image_encoder,
        transformer=experts[0],
        transformer_2=experts[1] if len(experts) > 1 else None,
        boundary_ratio=0.9 if variant == "wan22" else None,
        expand_timesteps=variant == "ti2v",
    )


def save_tiny_wan_i2v_pipeline(
    path: str | Path, *, seed: int = 0, variant: TinyVariant = "wan21", texts: Sequence[str] | None = None
) -> Path:
    """Build (:func:`build_tiny_wan_i2v_pipeline`) and ``save_pretrained`` a tiny
    ``WanImageToVideoPipeline`` into ``path``."""
    path = Path(path)
    pipe: Any = build_tiny_wan_i2v_pipeline(seed=seed, variant=variant, texts=texts)
    pipe.save_pretrained(path)
    return path
