"""Where a serving group's stages run and in which precision: the default placement of a device,
and a group's stage modules placed on its device.

On CPU nothing changes: the modules as loaded (float32), the two-group placement. On
CUDA the text encoder and the DiT compute in bf16 and the VAE in float32, the precision of
diffusers' Wan examples (``WanPipeline.from_pretrained(dir, torch_dtype=torch.bfloat16)`` with a
float32 ``AutoencoderKLWan``); the parameters a diffusers model keeps in float32 when loaded in
bf16 (``_keep_in_fp32_modules``: Wan's time embedder, norms, modulation tables) stay float32.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLWan, WanPipeline

from mmpipe.devices import DeviceType
from mmpipe.models.wan import component_dtypes, place_module


def default_placement(device: DeviceType, gpus: int) -> dict[str, list[int]]:
    """The placement a user who names none gets on ``device`` (``gpus``: the CUDA devices present).

    CPU: two groups (text on group 0, DiT and VAE replicas on groups 0 and 1), each a
    process with half the cores, so one group's DiT runs while the other encodes or decodes.
    CUDA: one group per GPU running every stage. Processes sharing a GPU only time-slice it (no
    concurrent kernels across processes without MPS), each holds its own CUDA context and weights,
    and their edge tensors cross through host memory; one process per GPU keeps a request's tensors
    on the device and batches every request's DiT rows (continuous batching) into one forward.
    """
    if device is DeviceType.CPU:
        return {"text": [0], "denoise": [0, 1], "decode": [0, 1]}
    groups = list(range(max(1, gpus)))
    return {"text": list(groups), "denoise": list(groups), "decode": list(groups)}


def resolve_placement(placement: dict[str, list[int]] | None, device: DeviceType, gpus: int) -> dict[str, list[int]]:
    """The placement to run: ``placement`` as given, or the device's default where none was (``None``)."""
    return placement if placement is not None else default_placement(device, gpus)


COMPONENTS = {"text": "text_encoder", "denoise": "transformer", "decode": "vae"}  # stage -> WanPipeline component


def place_stages(graph: Any, device: torch.device, stages: Collection[str]) -> None:
    """Move the modules of ``stages`` (of ``text``, ``denoise``, ``decode``) of the inference graph onto
    ``device`` in its serving precision (:func:`mmpipe.models.wan.component_dtypes`); the other
    stages' modules stay on the host, where a group that never runs them leaves them. On CPU
    nothing is touched (float32, as loaded)."""

    if device.type == "cpu":
        return
    dtypes = component_dtypes(device)
    for name in sorted(stages):
        place_module(getattr(graph, name).module, device, dtypes.get(COMPONENTS[name]))


def load_wan_pipeline(path: str | Path) -> Any:
    """The ``WanPipeline`` of a directory, on the host, in CUDA's serving precision, loaded as diffusers'
    Wan examples load it (bf16, the VAE float32), so that its weights are bitwise a diffusers
    baseline's and no float32 copy of a large text encoder is ever made."""

    vae = AutoencoderKLWan.from_pretrained(path, subfolder="vae", torch_dtype=torch.float32)
    return WanPipeline.from_pretrained(path, vae=vae, torch_dtype=torch.bfloat16)
