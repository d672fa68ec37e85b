"""Config -> where one request's stages run in ``mmpipe generate nproc=N placement=...``.

``placement={text: [0], denoise: {ranks: [0, 1, 2, 3], ulysses: 2, cfg: 2}, decode: [0]}``: the
prompt is encoded on one rank and broadcast; the denoiser runs over a group of ``cfg x ring x
ulysses`` ranks (:mod:`mmpipe.parallel.denoise`); the VAE decodes on one rank (broadcast to the
rest) or over all the denoise ranks, split by latent frames (:mod:`mmpipe.parallel.vae`). Every
check here runs before any worker starts and names the key it refuses; the checks that need the
model's configuration (heads, patch size, the family's hooks) read its ``config.json`` files only.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mmpipe.models.pipeline_graph import check_parallel_dir, family_class
from mmpipe.parallel.denoise import DenoiseLayout
from mmpipe.parallel.vae import DECODE_SPLITS

STAGES = ("text", "denoise", "decode")


@dataclasses.dataclass(frozen=True)
class InferencePlacement:
    """Ranks of each stage of one request (``nproc`` processes in all)."""

    nproc: int
    text: int  # the rank that encodes the prompt
    denoise: tuple[int, ...]  # row-major over (cfg, ring, ulysses)
    layout: DenoiseLayout
    decode: tuple[int, ...]  # one rank, or the denoise ranks (a frame-parallel decode)
    #: latent frames of context before each decode rank's range (None: the decoder's whole causal
    #: receptive field, exact; fewer: approximate, see mmpipe.parallel.vae)
    decode_halo: int | None = None
    decode_split: str = "rows"  # rows: bands of rows (exact); frames: latent-frame ranges after a halo

    def describe(self) -> str:
        lay = self.layout
        degrees = ", ".join(f"{k}={getattr(lay, k)}" for k in ("cfg", "ring", "ulysses") if getattr(lay, k) > 1)
        return (
            f"text on rank {self.text}; denoise on ranks {list(self.denoise)}"
            f"{f' ({degrees})' if degrees else ''}; decode on rank{'s' if len(self.decode) > 1 else ''} "
            f"{list(self.decode) if len(self.decode) > 1 else self.decode[0]}"
        )


def default_inference_placement(nproc: int, *, guided: bool) -> dict[str, Any]:
    """What ``nproc`` ranks run without a placement: the two guidance branches on two halves of the
    ranks when guidance is on (SGLang-Diffusion's finding: CFG parallelism beats sequence
    parallelism for latency at equal degree; its exchange is one prediction per step), Ulysses over
    the rest; text and decode on rank 0."""
    cfg = 2 if guided and nproc % 2 == 0 else 1
    return {"text": [0], "denoise": {"ranks": list(range(nproc)), "cfg": cfg, "ulysses": nproc // cfg}, "decode": [0]}


def _ranks(key: str, value: Any, nproc: int) -> tuple[int, ...]:
    values = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(values, list | tuple) or not values or not all(isinstance(r, int) for r in values):
        raise ValueError(f"{key}={value!r}: expected a rank or a list of ranks")
    if len(set(values)) != len(values):
        raise ValueError(f"{key}={value!r}: a rank is named twice")
    bad = [r for r in values if not 0 <= r < nproc]
    if bad:
        raise ValueError(f"{key}={value!r}: rank {bad[0]} is not in 0..{nproc - 1} (nproc={nproc})")
    return tuple(values)


def parse_inference_placement(raw: Mapping[str, Any] | None, nproc: int, *, guided: bool) -> InferencePlacement:
    """The placement of ``raw`` (``None``: :func:`default_inference_placement`) on ``nproc`` ranks."""
    if nproc < 1:
        raise ValueError(f"nproc={nproc}: must be >= 1")
    raw = dict(default_inference_placement(nproc, guided=guided) if raw is None else raw)
    unknown = sorted(set(raw) - set(STAGES))
    if unknown:
        raise ValueError(f"placement.{unknown[0]}: unknown stage; stages: {list(STAGES)}")
    text = _ranks("placement.text", raw.get("text", [0]), nproc)
    if len(text) != 1:
        raise ValueError(f"placement.text={list(text)}: a request's prompt is encoded once; name one rank")
    den = raw.get("denoise", list(range(nproc)))
    if not isinstance(den, Mapping):
        den = {"ranks": den}
        if len(_ranks("placement.denoise", den["ranks"], nproc)) > 1:
            raise ValueError(
                f"placement.denoise={den['ranks']}: say how the ranks split the request "
                "(cfg: 2 for the guidance branches, ulysses / ring: sequence-parallel degrees)"
            )
    if den.get("dp", 1) != 1:
        raise ValueError(
            f"placement.denoise.dp={den['dp']!r}: one request has one replica in mmpipe generate "
            "(data-parallel replicas serve several requests: mmpipe serve)"
        )
    layout, (ranks,) = parse_denoise_replicas(den, nproc)
    if layout.cfg == 2 and not guided:
        raise ValueError(
            "placement.denoise.cfg=2 runs the two guidance branches on different ranks, but the request's "
            "guidance is off (guidance <= 1): use cfg=1"
        )
    dec = raw.get("decode", [text[0]])
    halo, split = None, "rows"
    if isinstance(dec, Mapping):
        unknown = sorted(set(dec) - {"ranks", "split", "halo"})
        if unknown or "ranks" not in dec:
            raise ValueError(
                f"placement.decode={dict(dec)!r}: expected ranks, and optionally split (rows | frames) and "
                "halo (latent frames, with split: frames)"
            )
        split = dec.get("split", "rows")
        if split not in DECODE_SPLITS:
            raise ValueError(f"placement.decode.split={split!r}: expected one of {list(DECODE_SPLITS)}")
        halo = dec.get("halo")
        if halo is not None and (not isinstance(halo, int) or isinstance(halo, bool) or halo < 1):
            raise ValueError(f"placement.decode.halo={halo!r}: expected a positive number of latent frames")
        if halo is not None and split != "frames":
            raise ValueError("placement.decode.halo: only a split by frames has a halo (rows exchange their own)")
        dec = dec["ranks"]
    decode = _ranks("placement.decode", dec, nproc)
    if len(decode) > 1 and sorted(decode) != sorted(ranks):
        raise ValueError(
            f"placement.decode={list(decode)}: a parallel decode runs over the denoise ranks {list(ranks)}; "
            "or name one rank"
        )
    idle = sorted(set(range(nproc)) - {text[0], *ranks, *decode})
    if idle:
        raise ValueError(f"placement: rank {idle[0]} of nproc={nproc} runs no stage")
    if halo is not None and len(decode) == 1:
        raise ValueError("placement.decode.halo: a decode on one rank needs no halo")
    return InferencePlacement(nproc, text[0], ranks, layout, decode, halo, split)


def parse_denoise_replicas(
    den: Mapping[str, Any], nproc: int | None = None
) -> tuple[DenoiseLayout, list[tuple[int, ...]]]:
    """``placement.denoise={ranks, cfg, ulysses, ring, dp}``: the layout of one replica and the
    ranks of each of the ``dp`` replicas (consecutive runs of ``cfg x ring x ulysses`` ranks)."""
    unknown = sorted(set(den) - {"ranks", "cfg", "ulysses", "ring", "dp"})
    if unknown:
        raise ValueError(f"placement.denoise.{unknown[0]}: unknown key; keys: ranks, cfg, ulysses, ring, dp")
    if "ranks" not in den:
        raise ValueError("placement.denoise.ranks is missing: the ranks (processes) that denoise")
    ranks = _ranks("placement.denoise.ranks", den["ranks"], nproc if nproc is not None else 1 << 30)
    degrees = {k: den.get(k, 1) for k in ("cfg", "ulysses", "ring", "dp")}
    for k, v in degrees.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"placement.denoise.{k}={v!r}: expected a positive integer")
    try:
        layout = DenoiseLayout(cfg=degrees["cfg"], ulysses=degrees["ulysses"], ring=degrees["ring"])
    except ValueError as err:
        raise ValueError(f"placement.denoise.{err}") from None
    dp = degrees["dp"]
    if layout.size * dp != len(ranks):
        raise ValueError(
            f"placement.denoise: dp={dp} x cfg={layout.cfg} x ring={layout.ring} x ulysses={layout.ulysses} = "
            f"{layout.size * dp} ranks, but ranks={list(ranks)} names {len(ranks)}"
        )
    return layout, [ranks[i * layout.size : (i + 1) * layout.size] for i in range(dp)]


def check_placement_for_model(
    placement: InferencePlacement, root: Path, latent_frames: int | None, *, cache_policy: str = "none"
) -> None:
    """The model-dependent checks, from the pipeline directory's config files only: the family's
    denoiser can run the layout (heads, whole-frame patches, hooks), every sequence-parallel rank
    gets a latent frame, and the step cache decides the same on every rank (see
    :meth:`mmpipe.stages.cache.StepCache.check`, which the ranks repeat on the loaded models)."""
    layout = placement.layout
    if latent_frames is not None:
        layout.check_frames(latent_frames, key="placement.denoise")
    check_parallel_dir(root, layout, key="placement.denoise")
    if len(placement.decode) > 1:
        family = family_class(str(json.loads((root / "model_index.json").read_text()).get("_class_name")))
        if not family.parallel_decode:
            raise ValueError(
                f"placement.decode={list(placement.decode)}: {family.pipeline_cls.__name__}'s VAE decode is "
                "not split over ranks in mmpipe (the Wan VAEs' is); name one rank"
            )
    if layout.sp > 1 and cache_policy == "first_block":
        raise ValueError(
            f"cache.policy='first_block' with placement.denoise ulysses x ring = {layout.sp}: each rank would "
            "decide from its own frames whether to skip; use cache.policy=mag or cfg parallelism"
        )


def latent_frames_of(root: Path, num_frames: int) -> int | None:
    """Latent frames of a ``num_frames`` video under the directory's VAE (``None``: an image VAE)."""
    path = root / "vae" / "config.json"
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text())
    scale = cfg.get("scale_factor_temporal") or cfg.get("temporal_compression_ratio")
    if scale is None:
        return None
    return (max(num_frames, 1) - 1) // int(scale) + 1
