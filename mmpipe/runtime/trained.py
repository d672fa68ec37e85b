"""A trained run as an inference graph: its pipeline directory with the DiT weights of its latest
checkpoint and its kernel choice, for ``mmpipe generate`` and ``mmpipe serve ckpt=RUN_DIR``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, cast

from diffusers import WanTransformer3DModel
from torch import nn

from mmpipe.config import RunConfig
from mmpipe.devices import DeviceType
from mmpipe.errors import loading_errors
from mmpipe.kernels import registry as kernels
from mmpipe.models import check_training_pipeline_dir
from mmpipe.models.loading import from_diffusers
from mmpipe.models.pipeline_graph import PipelineGraph
from mmpipe.models.u2g import load_u2g_graph
from mmpipe.models.wan import T2VGraph
from mmpipe.rundir import latest_checkpoint, load_run_config, pipeline_dir
from mmpipe.runtime.checkpoint import load_latest_weights
from mmpipe.stages.wan_kernels import use_kernels


def check_trained_run(run_dir: Path, *, key: str = "ckpt") -> None:
    """Refuse, before any weights load or worker starts, a ``run_dir`` that
    :func:`load_trained_graph` cannot use: no run config, a missing or unusable pipeline directory,
    or no checkpoint yet (``ValueError`` naming ``key``)."""
    cfg = load_run_config(run_dir)
    check_training_pipeline_dir(pipeline_dir(cfg.model, run_dir), key=f"{key}={str(run_dir)!r}: pipeline")
    if latest_checkpoint(run_dir) is None:
        raise ValueError(f"{key}={str(run_dir)!r}: the run has no checkpoint yet (train.ckpt_every saves them)")


def load_trained_graph(run_dir: Path, device: DeviceType = DeviceType.CPU) -> T2VGraph | PipelineGraph:
    """The run's inference graph on ``device`` (bf16 text encoder and DiT on CUDA, as
    :func:`~mmpipe.models.wan.place_graph` places them) with the DiT weights of its latest
    checkpoint and the run's ``model.kernels`` resolved for ``device``. A two-expert Wan 2.2 run
    gives the family graph, its experts the weights of the stages ``dit`` and ``dit_2``; an
    understand-then-generate run (``model.kind=u2g``) its :class:`~mmpipe.models.u2g.U2GGraph`, with
    the trained ``llm``, ``connector`` and ``dit`` (on CPU)."""
    cfg = load_run_config(run_dir)
    choice = generation_kernels(cfg, device)  # an unavailable kernel is an error before any load
    if cfg.model.kind == "u2g":
        if device is not DeviceType.CPU:
            raise ValueError(f"ckpt={str(run_dir)!r}: an understand-then-generate run generates on CPU only")
        with loading_errors(f"ckpt={str(run_dir)!r}"):
            u2g = load_u2g_graph(pipeline_dir(cfg.model, run_dir), text_len=cfg.model.text_len)
            instruct: Any = u2g.instruct.module  # the training stages' own modules: the checkpoint's llm and connector
            load_latest_weights(
                run_dir, {"llm": instruct["llm"], "connector": instruct["connector"], "dit": u2g.denoise.module}
            )
        apply_kernels(u2g, choice)
        return u2g
    with loading_errors(f"ckpt={str(run_dir)!r}"):
        graph: Any = from_diffusers(
            pipeline_dir(cfg.model, run_dir), max_sequence_length=cfg.model.text_len, device=device.value
        )
        # The training graph's DiT stage is named "dit" ("dit_2": Wan 2.2's second expert); its weights
        # become the denoiser's (DCP copies the saved float32 tensors into the placed ones, casting).
        denoisers: Any = graph.denoise.module
        if isinstance(graph, PipelineGraph):  # Wan 2.2's two experts, LTX-Video, HunyuanVideo
            stages = {"dit": denoisers["transformer"]}
            if "transformer_2" in denoisers:
                stages["dit_2"] = denoisers["transformer_2"]
            load_latest_weights(run_dir, stages)
        else:
            load_latest_weights(run_dir, {"dit": denoisers})
    apply_kernels(graph, choice)
    return graph


def generation_kernels(cfg: RunConfig, device: DeviceType) -> kernels.KernelChoice:
    """The run's ``model.kernels`` resolved for the device that generates (``auto``: Triton on
    CUDA), not for the one it trained on: a run trained on CPU generates with Triton on a GPU."""
    choice = kernels.KernelChoice(**dataclasses.asdict(cfg.model.kernels))
    return kernels.resolve(choice, device.value)


def apply_kernels(graph: T2VGraph | PipelineGraph, choice: kernels.KernelChoice) -> None:
    """Swap the kernels of ``choice`` into the denoiser's Wan DiT, each expert's (in place); other
    families' DiTs keep diffusers' own (mmpipe's kernels cover the Wan DiT)."""
    if choice == kernels.KernelChoice():
        return
    module: Any = graph.denoise.module
    for dit in module.values() if isinstance(graph, PipelineGraph) else [module]:
        if isinstance(dit, WanTransformer3DModel):
            use_kernels(cast(nn.Module, dit), choice)
