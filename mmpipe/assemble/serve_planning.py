"""The serving planner on a config (``mmpipe plan mode=serve``): a preset's request costs and the
serving plan of :mod:`mmpipe.sched.serve_planner`.

A request's stages are costed from the preset's training graph (``planning_graph``, so full-size
presets stay architecture-only and the costs share the training planner's cache): its text encoder
and DiT forwards as they are, the VAE's decode measured apart (the training graph only encodes).
An image family's preset (``model.kind=t2i``: FLUX.1, Qwen-Image) has one request's stages as its
graph (:mod:`mmpipe.stages.image`), costed the same way. Wan 2.1 image-to-video's request also
runs the image encoder (in the text stage, as the serving engine places it) and the VAE's encode
of the first-frame condition (on the VAE's rank, counted with the decode).
A ``mmpipe profile`` calibration names the training graph's stages; the request's stages take the
entries of the modules they run (text: ``text``, denoise: ``dit``, decode: ``vae``, whose
efficiency was measured encoding).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from mmpipe.assemble.graphs import planning_graph
from mmpipe.assemble.planning import cluster_of, default_calibration_path
from mmpipe.config import DataConfig, ModelConfig, PlanConfig
from mmpipe.sched.calibration import Calibration
from mmpipe.sched.cost import StageCost, measure_decode_cost, measure_graph_costs
from mmpipe.sched.serve_planner import Objective, ServeCosts, ServePlan, plan_serving

#: the request's stage -> the training graph's stage whose module it runs (and whose calibration it takes)
TRAINING_STAGE = {"text": "text", "denoise": "dit", "decode": "vae"}


def serve_costs(model: ModelConfig, data: DataConfig) -> ServeCosts:
    """Per-sample costs of one request of ``model``'s video (or image) size (``model.video``, else
    ``data``'s)."""
    if model.kind not in ("t2v", "t2i"):
        raise ValueError(
            f"mode=serve plans text-to-video and text-to-image presets; model {model.name!r} has kind={model.kind!r}"
        )
    graph, shapes = planning_graph(model, data)
    costs = measure_graph_costs(graph, shapes)
    pixels = shapes["image"] if "image" in shapes else shapes["video"]
    decode, latents = measure_decode_cost(graph.stages["vae"], pixels)
    text = costs["text"]
    if "clip" in graph.stages:  # Wan 2.1 I2V (build_wan_i2v_training_graph's stages)
        text = _one_after_the_other(text, costs["clip"])
        # its training stage encodes twice (the clip, the first-frame condition); a request, the condition
        encode = costs["vae"]
        decode = dataclasses.replace(
            decode,
            forward_flops=decode.forward_flops + encode.forward_flops / 2,
            attention_flops=decode.attention_flops + encode.attention_flops / 2,
        )
    dit = graph.stages["dit"]
    return ServeCosts(
        name=model.name,
        text=text,
        denoise=costs["dit"],
        decode=decode,
        latent_elements=math.prod(latents),
        sequence_parallel=dit.capabilities.sequence_parallel,
    )


def _one_after_the_other(first: StageCost, second: StageCost) -> StageCost:
    """Two frozen stages' modules run on one rank, one after the other, as one stage: their FLOPs,
    parameters and outputs add up (the blocks are ``first``'s)."""
    return dataclasses.replace(
        first,
        forward_flops=first.forward_flops + second.forward_flops,
        attention_flops=first.attention_flops + second.attention_flops,
        params=first.params + second.params,
        output_bytes=first.output_bytes + second.output_bytes,
        activation_bytes=first.activation_bytes + second.activation_bytes,
    )


def serving_calibration(cal: Calibration) -> Calibration:
    """``cal`` (per training-graph stage) with the request's stage names (:data:`TRAINING_STAGE`)."""
    stages = {s: cal.stages[t] for s, t in TRAINING_STAGE.items() if t in cal.stages}
    return dataclasses.replace(cal, stages=stages)


def serve_plan_from_config(cfg: PlanConfig) -> ServePlan:
    """Plan serving ``cfg.model`` on ``cfg.cluster`` (``mmpipe plan mode=serve``)."""
    cal = serving_calibration(Calibration.load(cfg.calibration)) if cfg.calibration else None
    return plan_serving(
        serve_costs(cfg.model, cfg.data),
        cluster_of(cfg.cluster, cfg.nproc),
        steps=cfg.steps,
        guidance=cfg.guidance,
        slo_s=cfg.slo_s,
        objective=Objective(cfg.objective),
        calibration=cal,
    )


def serving_placement(
    model: ModelConfig, data: DataConfig, *, nproc: int, steps: int, guidance: float, device: str = "cpu"
) -> tuple[dict[str, Any], ServePlan]:
    """``mmpipe serve placement=auto``: the planner's choice for requests of ``data``'s size on
    ``nproc`` local ranks (the objective: requests/s), calibrated by ``mmpipe profile``'s file for
    ``device`` where there is one, as the engine's placement. A replica of one rank becomes the
    step-batched list placement (text on the first ranks, the DiT and the VAE on every one)."""
    path = default_calibration_path(device)
    cal = serving_calibration(Calibration.load(path)) if path.is_file() else None
    plan = plan_serving(
        serve_costs(model, data),
        cluster_of({"name": "local"}, nproc),
        steps=steps,
        guidance=guidance,
        objective=Objective.THROUGHPUT,
        calibration=cal,
    )
    placement: dict[str, Any] = dict(plan.placement)
    den = placement["denoise"]
    if den.get("cfg", 1) * den.get("ulysses", 1) * den.get("ring", 1) == 1:
        ranks = list(den["ranks"])
        placement = {"text": ranks[:1], "denoise": ranks, "decode": ranks}
    return placement, plan
