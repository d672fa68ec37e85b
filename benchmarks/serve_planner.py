"""The serving planner on paper, against xDiT's published HunyuanVideo figure, and its prediction for
the tiny local model that ``mmpipe generate`` / ``mmpipe serve`` run here.

1. ``hunyuan_8xh100``: HunyuanVideo (``hunyuan_t2v``: 13B DiT, 720p x 129 frames, 50 steps) on one
   8-GPU H100 SXM node (``configs/cluster/hgx_h100_8.yaml``), ``objective=latency``, against the same
   planner on 1, 2 and 4 of its GPUs, beside the latencies xDiT published for the same request
   (Tencent/HunyuanVideo README, "Latency (Sec) for 1280x720 (129 frames 50 steps) on 8xGPU":
   1904.08 s on 1 GPU, 934.09 / 514.08 / 337.58 s on 2 / 4 / 8, i.e. x2.04 / x3.70 / x5.64, with
   ``--ulysses-degree 8 --ring-degree 1`` on 8). HunyuanVideo's guidance is distilled into the DiT
   (``--embedded-cfg-scale``): one DiT forward a step, so the like-for-like request has true
   classifier-free guidance off (``guidance=1``); ``true_cfg`` is the same request with it on
   (two forwards a step, which CFG parallelism may split) for context. The prediction is the cost
   model's: efficiency 0.45 of the dense bf16 peak, not calibrated on an H100; NVLink at 450 GB/s a
   GPU a direction; the list of what is not modelled is in ``assumptions``.
2. ``t2v_tiny_local``: the tiny preset at ``mmpipe generate`` / ``mmpipe serve``'s default request
   (64x64, 17 frames, 20 steps, guidance 3.0) on ``cluster=local nproc=2`` (and on one rank), with
   the ``mmpipe profile`` calibration of this machine when there is one (``--calibration``, default
   ``$MMPIPE_CACHE/calibration-cpu.json``): the predicted single-request latency of the planner's
   choice and of the default generate placement (the guidance branches on the two ranks, cfg=2),
   to compare with a measured run.

    python benchmarks/serve_planner.py [--calibration FILE]

The last line is one JSON object ``{"hunyuan_8xh100": {...}, "t2v_tiny_local": {...}}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from mmpipe.assemble.planning import default_calibration_path
from mmpipe.assemble.serve_planning import serve_costs, serving_calibration
from mmpipe.config import DataConfig, ModelConfig, compose_config, from_dict
from mmpipe.sched.calibration import Calibration
from mmpipe.sched.cluster import Cluster
from mmpipe.sched.serve_planner import Objective, ServeCosts, ServePlan, plan_serving

XDIT_HUNYUAN = {  # GPUs -> seconds, Tencent/HunyuanVideo README (xDiT, 1280x720, 129 frames, 50 steps)
    1: 1904.08,
    2: 934.09,
    4: 514.08,
    8: 337.58,
}


def model_preset(name: str) -> ModelConfig:
    """A ``configs/model`` preset, composed as ``mmpipe plan model=NAME`` does."""
    return from_dict(ModelConfig, compose_config("plan", [f"model={name}"])["model"])


def fastest(costs: ServeCosts, cluster: Cluster, gpus: int, **kw: Any) -> ServePlan:
    """The lowest-latency plan on the first ``gpus`` devices of ``cluster``."""
    part = dataclasses.replace(cluster, name=f"{cluster.name}[:{gpus}]", world_size=gpus)
    return plan_serving(costs, part, objective=Objective.LATENCY, **kw)


def hunyuan() -> dict[str, Any]:
    t0 = time.perf_counter()
    costs = serve_costs(model_preset("hunyuan_t2v"), DataConfig())
    cost_s = time.perf_counter() - t0
    cluster = Cluster.preset("hgx_h100_8")
    plans = {n: fastest(costs, cluster, n, steps=50, guidance=1.0) for n in (1, 2, 4, 8)}
    one, eight = plans[1], plans[8]
    ulysses8 = next(a for a in eight.alternatives if a.name == "pure Ulysses")
    cfg_on = {n: fastest(costs, cluster, n, steps=50, guidance=6.0) for n in (1, 8)}
    row = {
        "request": "hunyuan_t2v 720x1280 x 129 frames, 50 steps, embedded guidance (one DiT forward a step)",
        "cluster": "hgx_h100_8 (one 8x H100 SXM node, NVLink)",
        "latency_1gpu_s": one.latency_s,
        "latency_8gpu_s": eight.latency_s,
        "speedup_8gpu": one.latency_s / eight.latency_s,
        "placement_8gpu": eight.placement,
        "predicted_by_gpus": {
            n: {"latency_s": p.latency_s, "speedup": one.latency_s / p.latency_s, "placement": p.placement}
            for n, p in plans.items()
        },
        "xdit_ulysses8_layout": {
            "placement": ulysses8.placement(),
            "latency_s": ulysses8.latency_s,
            "speedup": one.latency_s / ulysses8.latency_s,
        },
        "xdit_published": {
            "source": "Tencent/HunyuanVideo README, xDiT parallel inference table (ulysses 8 x ring 1 on 8)",
            "latency_s": XDIT_HUNYUAN,
            "speedup_8gpu": XDIT_HUNYUAN[1] / XDIT_HUNYUAN[8],
        },
        "predicted_over_published_speedup": (one.latency_s / eight.latency_s) / (XDIT_HUNYUAN[1] / XDIT_HUNYUAN[8]),
        "predicted_over_published_latency": {n: plans[n].latency_s / XDIT_HUNYUAN[n] for n in sorted(plans)},
        "stage_seconds_8gpu": {
            "text": eight.best.text_s,
            "denoise": eight.best.step_s * 50,
            "decode": eight.best.decode_s,
            "transfers": eight.best.transfer_s,
        },
        "true_cfg": {
            "guidance": 6.0,
            "latency_1gpu_s": cfg_on[1].latency_s,
            "latency_8gpu_s": cfg_on[8].latency_s,
            "speedup_8gpu": cfg_on[1].latency_s / cfg_on[8].latency_s,
            "placement_8gpu": cfg_on[8].placement,
        },
        "assumptions": dict(eight.assumptions),
        "cost_seconds": cost_s,
    }
    return row


def tiny_local(calibration: Path | None) -> dict[str, Any]:
    path = calibration or default_calibration_path()
    cal = serving_calibration(Calibration.load(path)) if path.is_file() else None
    data = DataConfig(frames=17, height=64, width=64)
    costs = serve_costs(model_preset("t2v_tiny"), data)
    request = {"steps": 20, "guidance": 3.0, "calibration": cal}
    two = plan_serving(costs, Cluster.local(2), objective=Objective.LATENCY, **request)
    one = plan_serving(costs, Cluster.local(1), objective=Objective.LATENCY, **request)
    default = next(a for a in two.alternatives if a.name == "pure CFG")  # generate's default on 2 ranks
    return {
        "request": "t2v_tiny 64x64 x 17 frames, 20 steps, guidance 3.0 (generate / serve defaults)",
        "cluster": "local nproc=2",
        "calibration": str(path) if cal is not None else None,
        "calibrated": cal is not None,
        "latency_s": two.latency_s,
        "placement": two.placement,
        "default_generate_placement": default.placement(),
        "default_generate_latency_s": default.latency_s,
        "latency_1rank_s": one.latency_s,
        "stage_seconds": {
            "text": two.best.text_s,
            "denoise_step": two.best.step_s,
            "decode": two.best.decode_s,
            "transfers": two.best.transfer_s,
        },
        "efficiency": dict(two.assumptions["efficiency"]),
    }


def measured_latency(placement: dict[str, Any], requests: int) -> dict[str, Any]:
    """One request at a time through ``mmpipe serve``'s engine with ``placement`` (the tiny preset,
    the default request): the median of the requests' latencies from submission to frames, after a
    warm-up request."""
    import statistics
    import tempfile
    import time

    from mmpipe.config import ServeConfig
    from mmpipe.serve.engine import Engine
    from mmpipe.serve.protocol import GenerationRequest

    den = placement["denoise"]
    layout = {k: den.get(k, 1) for k in ("cfg", "ulysses", "ring")} if isinstance(den, dict) else None
    if isinstance(den, dict) and layout == {"cfg": 1, "ulysses": 1, "ring": 1} and len(den["ranks"]) == 1:
        placement = {"text": den["ranks"], "denoise": den["ranks"], "decode": den["ranks"]}
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = ServeConfig(run_dir=tmp, port=0, placement=placement, threads=0, max_batch=1)
        with Engine(cfg) as engine:
            for i in range(requests + 1):
                start = time.perf_counter()
                job = engine.submit(GenerationRequest(prompt="a red circle moving left", seed=i))
                while not job.status.done:
                    time.sleep(0.005)
                assert job.status.value == "completed", job.error
                if i:
                    times.append(time.perf_counter() - start)
    return {"placement": placement, "latency_s": statistics.median(times), "latencies_s": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", type=Path, default=None, help="a `mmpipe profile` file for the local rows")
    parser.add_argument("--measure", type=int, default=0, help="serve this many requests per plan and compare")
    args = parser.parse_args()
    results = {"hunyuan_8xh100": hunyuan(), "t2v_tiny_local": tiny_local(args.calibration)}
    if args.measure:
        t = results["t2v_tiny_local"]
        rows = []
        for name, placement, predicted in [
            ("planner, 2 ranks", t["placement"], t["latency_s"]),
            ("one rank", {"denoise": {"ranks": [0]}}, t["latency_1rank_s"]),
            # hand-written alternatives on the same 2 ranks (no prediction asked of the planner)
            ("hand: Ulysses-2 replica", {"denoise": {"ranks": [0, 1], "ulysses": 2}}, None),
            ("hand: ring-2 replica", {"denoise": {"ranks": [0, 1], "ring": 2}}, None),
            (
                "hand: serve's CPU default (2 step-batched groups)",
                {"text": [0], "denoise": [0, 1], "decode": [0, 1]},
                None,
            ),
        ]:
            got = measured_latency(placement, args.measure) | {"plan": name}
            if predicted is not None:
                got |= {
                    "predicted_s": predicted,
                    "predicted_vs_measured": predicted / got["latency_s"],
                    "within_25pct": abs(predicted / got["latency_s"] - 1) <= 0.25,
                }
            rows.append(got)
        hand = [r for r in rows if r["plan"].startswith("hand")]
        best = min(hand, key=lambda r: r["latency_s"])
        t["measured"] = rows
        t["planner_vs_best_hand_written"] = {
            "best_hand_written": best["plan"],
            "ratio": rows[0]["latency_s"] / best["latency_s"],  # < 1: the planner's choice is faster
        }
    h = results["hunyuan_8xh100"]
    print(
        f"HunyuanVideo 720p x 129, 50 steps, 8x H100: predicted {h['latency_1gpu_s']:.0f} s -> "
        f"{h['latency_8gpu_s']:.1f} s (x{h['speedup_8gpu']:.2f}); xDiT published 1904.08 s -> 337.58 s (x5.64)",
        flush=True,
    )
    t = results["t2v_tiny_local"]
    print(
        f"t2v_tiny on 2 local ranks ({'calibrated' if t['calibrated'] else 'uncalibrated'}): "
        f"predicted {t['latency_s']:.3f} s a request",
        flush=True,
    )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
