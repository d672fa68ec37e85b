"""``mmpipe eval RUN_DIR``: does the trained run generate what its captions say?

Generates every caption of the moving-shapes grid (colour x shape x direction: 8 x 3 x 4 = 96,
fixed seeds) with the run's latest checkpoint, and scores each decoded video with the
deterministic tracker of :mod:`mmpipe.data.tracker` (colour of the foreground, its shape, the
direction of its centroid's trajectory). An understand-then-generate run (``model.kind=u2g``) is
given, per grid entry, a still of the coloured shape mid-frame (one still per colour and shape,
the same for its four directions) and the instruction "make it move <direction>": its colour and
shape must come from the image, its direction from the text. Also measures the run's VAE: reconstruction PSNR on
held-out clips (a dataset seed no run trains on). Writes ``RUN_DIR/eval/eval.json`` (``color_acc``,
``direction_acc``, ``shape_acc``, ``vae_psnr_db``, ``n`` and every clip's verdict) and a contact sheet
``RUN_DIR/eval/contact_sheet.png`` (first and last frame of every clip, its caption and the
tracker's verdict) that ``mmpipe report`` shows.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw
from tqdm import tqdm

from mmpipe.config import DataConfig
from mmpipe.data import frames_to_uint8, instruct_clip, instruction
from mmpipe.data.shapes import COLORS, DIRECTIONS, SHAPES
from mmpipe.data.tracker import track
from mmpipe.devices import DeviceType
from mmpipe.models.shapes_vae import reconstruction_psnr
from mmpipe.rundir import EVAL_DIR, load_run_config
from mmpipe.runtime.trained import check_trained_run, load_trained_graph

GRID: tuple[tuple[str, str, str], ...] = tuple(itertools.product(COLORS, SHAPES, DIRECTIONS))


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """How ``mmpipe eval`` generates: the grid's first ``clips`` captions (all 96 by default), in
    batches of ``batch`` prompts, batch ``i`` drawn from seed ``seed + i``."""

    steps: int = 20
    guidance: float = 3.0
    clips: int = len(GRID)
    batch: int = 8
    seed: int = 0
    vae_clips: int = 16

    def __post_init__(self) -> None:
        for key in ("steps", "clips", "batch", "vae_clips"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        if self.clips > len(GRID):
            raise ValueError(f"clips={self.clips}: the grid has {len(GRID)} captions")
        if not self.guidance >= 1.0:
            raise ValueError(f"guidance must be >= 1.0, got {self.guidance!r}")


def check_eval_run(run_dir: Path) -> None:
    """Refuse, before anything loads or is written, a run that cannot be evaluated (``ValueError``)."""
    if not run_dir.is_dir():
        raise ValueError(f"run directory {str(run_dir)!r} does not exist")
    check_trained_run(run_dir, key="RUN_DIR")
    cfg = load_run_config(run_dir)
    if cfg.data.root is not None:
        raise ValueError(
            f"RUN_DIR={str(run_dir)!r} trained on data.root={cfg.data.root!r}; mmpipe eval scores the "
            "moving-shapes captions, so it evaluates runs trained on them (data.root=null)"
        )
    if cfg.model.kind not in ("t2v", "u2g"):
        raise ValueError(
            f"RUN_DIR={str(run_dir)!r}: model.kind={cfg.model.kind!r}; mmpipe eval scores t2v and u2g runs"
        )


def still_seed(color: str, shape: str, seed: int) -> int:
    """The seed of the still an understand-then-generate run is shown for ``color`` ``shape``."""
    return seed * 1000 + COLORS.index(color) * len(SHAPES) + SHAPES.index(shape)


def stills(batch: Sequence[tuple[str, str, str]], data: DataConfig, seed: int) -> torch.Tensor:
    """``(B, 3, H, W)`` in [-1, 1]: the first frame of an instruct-task clip of each entry's colour
    and shape (the same for every direction)."""
    size = {"frames": data.frames, "height": data.height, "width": data.width}
    return torch.stack(
        [instruct_clip(c, s, d, seed=still_seed(c, s, seed), **size)["video"][:, 0] for c, s, d in batch]
    )


def evaluate(run_dir: Path, options: EvalOptions = EvalOptions(), *, progress: bool = True) -> dict[str, Any]:
    """Generate and score the grid, measure the VAE; write ``eval.json`` and the contact sheet."""
    check_eval_run(run_dir)
    cfg = load_run_config(run_dir)
    data, instruct = cfg.data, cfg.model.kind == "u2g"
    start = time.perf_counter()
    graph = load_trained_graph(run_dir, DeviceType.CPU)
    grid = GRID[: options.clips]
    clips: list[dict[str, Any]] = []
    firsts_lasts: list[tuple[np.ndarray, np.ndarray]] = []
    batches = [grid[i : i + options.batch] for i in range(0, len(grid), options.batch)]
    for i, batch in enumerate(tqdm(batches, desc="eval: generate", unit="batch", disable=not progress)):
        if instruct:  # the still of each entry's colour and shape, and the instruction
            prompts = [instruction(d) for _, _, d in batch]
            args: tuple[Any, ...] = (stills(batch, data, options.seed), prompts)
        else:
            prompts = [f"a {c} {s} moving {d}" for c, s, d in batch]
            args = (prompts,)
        video = graph.generate(
            *args,
            height=data.height,
            width=data.width,
            num_frames=data.frames,
            num_inference_steps=options.steps,
            guidance_scale=options.guidance,
            seed=options.seed + i,
            progress=False,
        )
        for (color, shape, direction), prompt, frames in zip(batch, prompts, video, strict=True):
            frames_THWC = frames_to_uint8(frames)
            verdict = track(frames_THWC)
            clips.append(
                {"caption": prompt, "seed": options.seed + i, "verdict": str(verdict)}
                | (
                    {"image": f"{color} {shape}", "image_seed": still_seed(color, shape, options.seed)}
                    if instruct
                    else {}
                )
                | {f"{k}_ok": v for k, v in verdict.matches(color, shape, direction).items()}
                | {"rgb": [round(v, 3) for v in verdict.rgb], "fill_ratio": round(verdict.fill_ratio, 3)}
            )
            firsts_lasts.append((frames_THWC[0], frames_THWC[-1]))
    generate_s = time.perf_counter() - start
    vae = graph.decode.module  # the run's VAE, loaded with the pipeline
    psnr = reconstruction_psnr(vae, clips=options.vae_clips, frames=data.frames, height=data.height, width=data.width)
    n = len(clips)
    result: dict[str, Any] = {
        "color_acc": round(sum(c["color_ok"] for c in clips) / n, 4),
        "direction_acc": round(sum(c["direction_ok"] for c in clips) / n, 4),
        "shape_acc": round(sum(c["shape_ok"] for c in clips) / n, 4),
        "vae_psnr_db": round(psnr, 2),
        "n": n,
        "task": "instruct" if instruct else "describe",
        "steps": options.steps,
        "guidance": options.guidance,
        "seconds": round(time.perf_counter() - start, 1),
        "generate_seconds": round(generate_s, 1),
    }
    out = run_dir / EVAL_DIR
    out.mkdir(exist_ok=True)
    (out / "eval.json").write_text(json.dumps(result | {"clips": clips}, indent=1) + "\n")
    contact_sheet(firsts_lasts, clips, out / "contact_sheet.png")
    return result


def contact_sheet(frames: Sequence[tuple[np.ndarray, np.ndarray]], clips: Sequence[dict[str, Any]], path: Path) -> Path:
    """A PNG grid: per clip its first and last frame side by side, the caption, and the tracker's
    verdict (green when every attribute matches the caption, red otherwise)."""
    h, w = frames[0][0].shape[:2]
    text_h, pad, cols = 26, 4, 8
    cell_w, cell_h = 2 * w + 3 * pad, h + text_h + 2 * pad
    rows = (len(frames) + cols - 1) // cols
    sheet = Image.new("RGB", (cols * cell_w, rows * cell_h), (24, 24, 24))
    draw = ImageDraw.Draw(sheet)
    for k, ((first, last), clip) in enumerate(zip(frames, clips, strict=True)):
        x0, y0 = (k % cols) * cell_w, (k // cols) * cell_h
        sheet.paste(Image.fromarray(first), (x0 + pad, y0 + pad))
        sheet.paste(Image.fromarray(last), (x0 + 2 * pad + w, y0 + pad))
        ok = clip["color_ok"] and clip["shape_ok"] and clip["direction_ok"]
        caption = (
            f"{clip['image']} > {clip['caption'].split()[-1]}"  # the still, then the instruction's direction
            if "image" in clip
            else clip["caption"].removeprefix("a ").replace(" moving", "")
        )
        draw.text((x0 + pad, y0 + h + pad + 1), caption, fill=(220, 220, 220))
        draw.text((x0 + pad, y0 + h + pad + 13), clip["verdict"], fill=(80, 220, 80) if ok else (240, 80, 80))
    sheet.save(path)
    return path


def format_table(result: dict[str, Any]) -> str:
    """The accuracies and the VAE's PSNR as a small table."""
    rows = [
        ("colour accuracy", f"{result['color_acc']:.1%}"),
        ("shape accuracy", f"{result['shape_acc']:.1%}"),
        ("direction accuracy", f"{result['direction_acc']:.1%}"),
        ("VAE reconstruction PSNR", f"{result['vae_psnr_db']:.2f} dB"),
        ("clips", str(result["n"])),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def main_eval(args: Sequence[str]) -> int:
    """``mmpipe eval RUN_DIR [--steps N] [--guidance G] [--clips N] [--batch N] [--seed S]``."""
    import argparse  # start-up: the CLI's own parser, imported when the command runs

    p = argparse.ArgumentParser(prog="mmpipe eval", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    defaults = EvalOptions()
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--guidance", type=float, default=defaults.guidance)
    p.add_argument("--clips", type=int, default=defaults.clips)
    p.add_argument("--batch", type=int, default=defaults.batch)
    p.add_argument("--seed", type=int, default=defaults.seed)
    ns = p.parse_args(list(args))  # a bad flag: argparse's usage and exit status 2
    try:
        options = EvalOptions(steps=ns.steps, guidance=ns.guidance, clips=ns.clips, batch=ns.batch, seed=ns.seed)
        check_eval_run(ns.run_dir)
    except ValueError as err:
        print(f"mmpipe eval: error: {err}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    result = evaluate(ns.run_dir, options)
    print(format_table(result))
    print(f"contact sheet: {ns.run_dir / EVAL_DIR / 'contact_sheet.png'}")
    print(json.dumps(result), flush=True)
    return 0


__all__ = ["GRID", "EvalOptions", "check_eval_run", "contact_sheet", "evaluate", "main_eval"]
