"""The serving planner: constraints on every configuration it considers, latency monotone in the
device count, the SLO and its refusal, the decode cost it adds to the cost model, and
``mmpipe plan mode=serve`` on a full-size preset."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mmpipe.assemble.graphs import planning_graph
from mmpipe.assemble.serve_planning import serve_costs, serving_calibration
from mmpipe.cli import main
from mmpipe.config import DataConfig, ModelConfig, PlanConfig, RunConfig, compose_config, from_dict
from mmpipe.models.wan import build_t2v_training_graph
from mmpipe.sched.calibration import Calibration
from mmpipe.sched.cluster import Cluster, Level
from mmpipe.sched.cost import StageCost, measure_decode_cost, measure_graph_costs
from mmpipe.sched.serve_planner import (
    FAMILIES,
    Objective,
    ServeCosts,
    ServeOption,
    _Pricer,
    check_layout,
    plan_serving,
)

GB = 1e9


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMPIPE_CACHE", str(tmp_path / "cache"))


def stage(flops: float, params: float, *, out: int = 1 << 20, heads: int = 0, frames: int = 0) -> StageCost:
    tokens = frames * 1560 if frames else 0
    return StageCost(
        forward_flops=flops,
        backward_flops=0.0,
        attention_flops=0.4 * flops if frames else 0.0,
        params=int(params),
        output_bytes=out,
        activation_bytes=0,
        block_flops=0.9 * flops if frames else 0.0,
        block_activation_bytes=0,
        block_input_bytes=30 * tokens * 1536 * 2,
        blocks=30 if frames else 0,
        tokens=tokens,
        hidden=1536 if frames else 0,
        heads=heads,
        split_units=frames,
    )


def costs(*, heads: int = 12, frames: int = 21, sp: bool = True, dit_flops: float = 3e14) -> ServeCosts:
    """A Wan-1.3B-sized request: 13B-FLOP text, a DiT forward of ``dit_flops``, a 3e14-FLOP decode."""
    return ServeCosts(
        name="synthetic",
        text=stage(5e12, 5.7 * GB, out=4 << 20),
        denoise=stage(dit_flops, 1.4 * GB, heads=heads, frames=frames),
        decode=stage(3e14, 0.13 * GB, out=200 << 20),
        latent_elements=16 * frames * 60 * 104,
        sequence_parallel=sp,
    )


def node_cluster(n: int, *, node: int = 8) -> Cluster:
    return Cluster(
        name=f"h100x{n}",
        device="H100",
        world_size=n,
        peak_flops=989e12,
        memory_bytes=80 * GB,
        levels=(Level(name="node", size=node, bandwidth=450e9),),
        network_bandwidth=50e9,
    )


def all_options(c: ServeCosts, cluster: Cluster, *, guided: bool, disaggregate: bool = True) -> list[ServeOption]:
    pricer = _Pricer(c, cluster, None, steps=10, guided=guided, disaggregate=disaggregate)
    return list(pricer.options(4))


def assert_valid(o: ServeOption, c: ServeCosts, cluster: Cluster, *, guided: bool) -> None:
    check_layout(c, cfg=o.cfg, ulysses=o.ulysses, ring=o.ring, guided=guided)  # raises on a broken rule
    assert o.ulysses == 1 or c.denoise.heads % o.ulysses == 0
    assert o.ring * o.ulysses <= c.frames
    assert c.sequence_parallel or o.ring == o.ulysses == 1
    assert guided or o.cfg == 1
    assert o.nproc <= cluster.world_size
    p = o.placement()
    ranks = p["denoise"]["ranks"]
    assert ranks == list(range(o.dp * o.replica))
    assert (p["denoise"]["cfg"], p["denoise"]["ring"], p["denoise"]["ulysses"], p["denoise"]["dp"]) == (
        o.cfg,
        o.ring,
        o.ulysses,
        o.dp,
    )
    assert p["text"] == p["decode"]
    if o.aux:
        assert p["text"] == list(range(len(ranks), o.nproc))
    else:  # each replica's first rank: what `mmpipe serve` runs
        assert p["text"] == ranks[:: o.replica]


@pytest.mark.parametrize(
    ("heads", "frames", "sp", "guided"),
    [(12, 21, True, True), (24, 33, True, False), (16, 5, True, True), (30, 13, False, True), (48, 2, True, True)],
)
def test_every_configuration_considered_respects_the_constraints(
    heads: int, frames: int, sp: bool, guided: bool
) -> None:
    c = costs(heads=heads, frames=frames, sp=sp)
    for cluster in (node_cluster(8), node_cluster(24)):
        options = all_options(c, cluster, guided=guided)
        assert options
        for o in options:
            assert_valid(o, c, cluster, guided=guided)
        # a replica no wider than a node stays inside one
        for o in options:
            if o.replica <= 8:
                assert all((i * o.replica) // 8 == ((i + 1) * o.replica - 1) // 8 for i in range(o.dp))
        plan = plan_serving(c, cluster, steps=10, guidance=5.0 if guided else 1.0, max_batch_limit=4)
        for o in (plan.best, *plan.alternatives):
            assert_valid(o, c, cluster, guided=guided)


def test_check_layout_names_the_rule_a_layout_breaks() -> None:
    c = costs(heads=12, frames=21)
    with pytest.raises(ValueError, match="ulysses=5 does not divide the DiT's 12 attention heads"):
        check_layout(c, cfg=1, ulysses=5, ring=1, guided=True)
    with pytest.raises(ValueError, match="ring x ulysses = 24 ranks split 21 latent frames"):
        check_layout(c, cfg=1, ulysses=12, ring=2, guided=True)
    with pytest.raises(ValueError, match="guidance is off"):
        check_layout(c, cfg=2, ulysses=1, ring=1, guided=False)
    with pytest.raises(ValueError, match="takes no sequence parallelism"):
        check_layout(costs(sp=False), cfg=1, ulysses=1, ring=2, guided=True)
    check_layout(c, cfg=2, ulysses=6, ring=3, guided=True)


def test_kinds_that_cannot_run_are_named_with_the_reason() -> None:
    plan = plan_serving(costs(sp=False), node_cluster(8), steps=10, guidance=1.0)
    assert "guidance is off" in plan.unavailable["pure CFG"]
    assert "no sequence parallelism" in plan.unavailable["pure Ulysses"]
    assert "no sequence parallelism" in plan.unavailable["pure ring"]
    assert {a.name for a in plan.alternatives} == {"one rank", "data parallel only"}
    assert plan.best.ring == plan.best.ulysses == plan.best.cfg == 1


@pytest.mark.parametrize("guidance", [1.0, 5.0])
def test_more_devices_never_predict_a_higher_latency(guidance: float) -> None:
    c = costs(heads=24, frames=33)
    latencies = [
        plan_serving(c, node_cluster(n), steps=10, guidance=guidance, objective=Objective.LATENCY).latency_s
        for n in range(1, 19)
    ]
    assert all(b <= a for a, b in zip(latencies, latencies[1:], strict=False)), latencies
    assert latencies[-1] < latencies[0] / 4  # and the parallel splits pay off


def test_latency_objective_is_the_minimum_over_every_configuration() -> None:
    c, cluster = costs(), node_cluster(8)
    plan = plan_serving(c, cluster, steps=10, guidance=5.0, objective=Objective.LATENCY, max_batch_limit=4)
    fastest = min(o.latency_s for o in all_options(c, cluster, guided=True, disaggregate=False))
    assert plan.latency_s == pytest.approx(fastest, rel=1e-5)
    assert plan.max_batch == 1


def test_slo_picks_the_most_throughput_that_meets_it_and_refuses_clearly() -> None:
    c, cluster = costs(), node_cluster(8)
    options = all_options(c, cluster, guided=True, disaggregate=False)
    single = plan_serving(c, cluster, steps=10, guidance=5.0, max_batch_limit=4, objective=Objective.LATENCY)
    slo = 1.5 * single.latency_s
    plan = plan_serving(c, cluster, steps=10, guidance=5.0, slo_s=slo, max_batch_limit=4)
    assert plan.latency_s <= slo
    assert plan.requests_per_s == pytest.approx(max(o.requests_per_s for o in options if o.latency_s <= slo), rel=1e-5)
    # without the goal the throughput plan is data parallel and slower per request than the goal allows
    free = plan_serving(c, cluster, steps=10, guidance=5.0, max_batch_limit=4)
    assert free.requests_per_s >= plan.requests_per_s and free.latency_s > slo
    with pytest.raises(ValueError) as err:
        plan_serving(c, cluster, steps=10, guidance=5.0, slo_s=single.latency_s / 2)
    msg = str(err.value)
    assert f"meets slo_s={single.latency_s / 2:g}: the best predicted latency is {single.latency_s:.4g} s" in msg
    assert "raise slo_s or add devices" in msg


def test_guidance_doubles_the_work_and_cfg_parallelism_halves_it_back() -> None:
    c, one = costs(), node_cluster(1)
    off = plan_serving(c, one, steps=10, guidance=1.0, objective=Objective.LATENCY)
    on = plan_serving(c, one, steps=10, guidance=5.0, objective=Objective.LATENCY)
    assert on.best.step_s == pytest.approx(2 * off.best.step_s, rel=1e-6)
    two = plan_serving(c, node_cluster(2), steps=10, guidance=5.0, objective=Objective.LATENCY)
    cfg = next(a for a in two.alternatives if a.name == "pure CFG")
    assert (cfg.cfg, cfg.dp) == (2, 1)
    assert off.best.step_s < cfg.step_s < 1.01 * off.best.step_s  # plus one prediction all-gather a step


def test_batching_trades_latency_for_throughput_only_where_it_buys_some() -> None:
    """Uncalibrated, a step's time is linear in its batch: batching buys nothing and is not chosen.
    A fixed cost per forward (what ``mmpipe profile`` measures) makes it pay."""
    c, cluster = costs(), node_cluster(1)
    assert plan_serving(c, cluster, steps=10, guidance=5.0).max_batch == 1
    cal = Calibration("H100", 989e12, {"denoise": {"forward": 0.45, "forward_overhead_s": 0.5}})
    plan = plan_serving(c, cluster, steps=10, guidance=5.0, calibration=cal, max_batch_limit=4)
    assert plan.max_batch == 4 and plan.latency_s > plan.best.single_latency_s


def test_serving_calibration_takes_the_entries_of_the_modules_the_stages_run() -> None:
    cal = Calibration("cpu", 1e11, {"text": {"forward": 0.1}, "vae": {"forward": 0.2}, "dit": {"forward": 0.7}})
    got = serving_calibration(cal)
    assert dict(got.stages) == {"text": {"forward": 0.1}, "denoise": {"forward": 0.7}, "decode": {"forward": 0.2}}


def test_meta_decode_counts_equal_real_counts(tiny_wan_dir: Path) -> None:
    vae = build_t2v_training_graph(tiny_wan_dir, text_len=16).stages["vae"]
    cost, latents = measure_decode_cost(vae, ((1, 3, 9, 32, 32), torch.float32))
    module = vae.module.to(torch.bfloat16)
    counter = FlopCounterMode(display=False)
    # the math backend decomposes attention into counted matmuls (the fused CPU kernel has no formula)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        z = module.encode(torch.zeros(1, 3, 9, 32, 32, dtype=torch.bfloat16)).latent_dist.mode()
        with counter:
            video = module.decode(z, return_dict=False)[0]
    assert latents == tuple(z.shape)
    assert cost.forward_flops == counter.get_total_flops() > 0
    assert cost.output_bytes == video.numel() * video.element_size()
    assert measure_decode_cost(vae, ((1, 3, 9, 32, 32), torch.float32)) == (cost, latents)  # cached


def test_plan_config_names_a_bad_or_misplaced_serve_key() -> None:
    def config(*overrides: str) -> PlanConfig:
        return from_dict(PlanConfig, compose_config("plan", list(overrides)))

    assert config("mode=serve", "slo_s=30", "objective=latency").slo_s == 30.0
    for overrides, key in [
        (("mode=serve", "objective=fast"), "objective='fast'"),
        (("mode=serve", "slo_s=-1"), "slo_s=-1"),
        (("mode=serve", "steps=0"), "steps"),
        (("mode=serve", "global_batch=8"), "global_batch=8 applies to mode=train only"),
        (("slo_s=10",), "slo_s=10.0 applies to mode=serve only"),
        (("mode=deploy",), "mode='deploy'"),
    ]:
        with pytest.raises(ValueError, match=key.replace("(", r"\(")):
            config(*overrides)


def test_cli_serve_plan_of_a_full_size_preset_parses(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "mode=serve", "model=wan1_3b_t2v", "cluster=h200_8", "json=true"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == "serve" and out["model"] == "wan1_3b_t2v" and out["world_size"] == 8
    den = out["placement"]["denoise"]
    assert den["ranks"] == list(range(out["nproc"])) and out["nproc"] <= 8
    assert math.prod(den[k] for k in ("cfg", "ring", "ulysses", "dp")) == out["nproc"]
    assert 12 % den["ulysses"] == 0 and den["ring"] * den["ulysses"] <= 21  # 12 heads, 81 frames = 21 latent
    assert out["latency_s"] > 0 and out["requests_per_s"] > 0 and 1 <= out["max_batch"] <= 8
    assert {a["name"] for a in out["alternatives"]} == set(FAMILIES)
    for a in out["alternatives"]:
        assert a["requests_per_s"] <= out["requests_per_s"] * (1 + 1e-5)
    assumed = out["assumptions"]
    assert assumed["efficiency"]["denoise"] == 0.45 and not assumed["calibrated"] and assumed["not_modelled"]
    # the same request under a latency goal it cannot meet: exit status 2, the best latency named
    assert main(["plan", "mode=serve", "model=wan1_3b_t2v", "cluster=h200_8", "slo_s=0.5"]) == 2
    err = capsys.readouterr().err
    assert "meets slo_s=0.5: the best predicted latency is" in err


@pytest.mark.parametrize(("preset", "latents"), [("flux1_dev", 16 * 128 * 128), ("qwen_image", 16 * 166 * 166)])
def test_cli_serve_plan_of_an_image_preset_splits_no_sequence(
    preset: str, latents: int, capsys: pytest.CaptureFixture[str]
) -> None:
    costs = serve_costs(from_dict(ModelConfig, compose_config("plan", [f"model={preset}"])["model"]), DataConfig())
    assert not costs.sequence_parallel and costs.latent_elements == latents  # one 16-channel frame, 8x
    assert costs.text.forward_flops > 0 and costs.decode.forward_flops > 0 and costs.denoise.backward_flops == 0
    assert main(["plan", "mode=serve", f"model={preset}", "cluster=h200_64", "json=true"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == preset and out["requests_per_s"] > 0 and out["latency_s"] > 0
    for option in (out, *out["alternatives"]):
        den = option["placement"]["denoise"]
        assert den["ulysses"] == den["ring"] == 1 and den["cfg"] in (1, 2)
        assert den["ranks"] == list(range(den["cfg"] * den["dp"]))
    for kind in ("pure Ulysses", "pure ring"):
        assert "its DiT takes no sequence parallelism" in out["unavailable"][kind]
    assert {a["name"] for a in out["alternatives"]} == {"one rank", "data parallel only", "pure CFG"}


def test_plans_of_an_image_preset_refuse_training_naming_the_kind(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "model=flux1_dev", "cluster=h200_64"]) == 2
    err = capsys.readouterr().err
    assert "model.kind='t2i' (model 'flux1_dev'): image families are planned with mode=serve only" in err
    with pytest.raises(ValueError, match="model.kind='t2i' .* mmpipe does not train image families"):
        from_dict(RunConfig, compose_config("train", ["model=qwen_image"]))


def test_wan_i2v_requests_add_the_image_encoder_and_the_condition_encode() -> None:
    model = from_dict(ModelConfig, compose_config("plan", ["model=wan21_i2v_14b"])["model"])
    graph, shapes = planning_graph(model, DataConfig())
    stages = measure_graph_costs(graph, shapes)
    costs = serve_costs(model, DataConfig())
    # the text stage runs the text and the image encoder (WanI2VFamily.text_components)
    text, clip = stages["text"], stages["clip"]
    assert costs.text.params == text.params + clip.params
    assert costs.text.forward_flops == text.forward_flops + clip.forward_flops
    assert costs.text.output_bytes == text.output_bytes + clip.output_bytes
    # the VAE's rank encodes the first-frame condition once (the training stage encodes the clip too)
    decode, _ = measure_decode_cost(graph.stages["vae"], shapes["video"])
    assert costs.decode.forward_flops == decode.forward_flops + stages["vae"].forward_flops / 2
    assert costs.denoise == stages["dit"] and costs.sequence_parallel and costs.frames == 21


def test_plan_serving_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="steps=0"):
        plan_serving(costs(), node_cluster(1), steps=0, guidance=1.0)
    with pytest.raises(ValueError, match="slo_s=0"):
        plan_serving(costs(), node_cluster(1), steps=1, guidance=1.0, slo_s=0)
    small = dataclasses.replace(node_cluster(1), memory_bytes=1 * GB)
    with pytest.raises(ValueError, match="no configuration of synthetic fits h100x1: 1 GB per device"):
        plan_serving(costs(), small, steps=1, guidance=1.0)
