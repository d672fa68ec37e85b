"""The activation budget planner: the cheapest per-block policy that fits, counted for several
micro-batches in flight; its choice fits in the estimator and in a real run of the Wan DiT stage."""

from __future__ import annotations

import pytest
import torch
from test_memory_policy import _inputs, _stage

from mmpipe.memory.budget import BlockPricing, choose_policies
from mmpipe.memory.policy import apply_block_policies, count_saved_bytes
from mmpipe.memory.tiers import FileTier
from mmpipe.sched.cost import StageCost, measure_stage_cost


def _cost(**kw: float) -> StageCost:
    base = dict(
        forward_flops=1e12, backward_flops=2e12, attention_flops=0.0, params=0, output_bytes=0,
        activation_bytes=1100, block_flops=1e12, block_activation_bytes=1000, block_input_bytes=100,
        blocks=10, tokens=1, hidden=1, heads=1,
    )  # fmt: skip
    base.update(kw)
    return StageCost(**base)  # type: ignore[arg-type]


def _pricing(offload_bytes_per_s: float = 1e3, **kw: float) -> BlockPricing:
    return BlockPricing.from_cost(_cost(), flops_per_s=1e12, offload_bytes_per_s=offload_bytes_per_s, **kw)


def _brute_force(p: BlockPricing, budget: float, inflight: int) -> tuple[float, int] | None:
    """(least added seconds, fewest bytes at it) over every (recompute, offload) count."""
    fits = [
        (p.added_s(r, o), p.resident_bytes(r, o, inflight=inflight))
        for r in range(p.blocks + 1)
        for o in range(p.blocks - r + 1)
        if p.resident_bytes(r, o, inflight=inflight) <= budget and inflight * o * p.block_bytes <= p.tier_bytes
    ]
    return min(fits) if fits else None


def test_keeps_everything_when_it_fits_and_counts_micro_batches_in_flight() -> None:
    pricing = _pricing()
    # 1100 saved bytes per micro-batch in flight, and the block the backward works on (100)
    assert pricing.resident_bytes(0, 0, inflight=3) == 3 * 1100 + 100
    choice = choose_policies(pricing, budget_bytes=3400, inflight=3)
    assert (choice.recompute, choice.offload, choice.added_s) == (0, 0, 0.0)
    tighter = choose_policies(pricing, budget_bytes=3000, inflight=3)
    assert tighter.resident_bytes <= 3000 and tighter.recompute + tighter.offload >= 1


def test_picks_the_cheaper_mechanism() -> None:
    # recompute: 0.1 s a block; offload: 2 x 100 bytes at 1 kB/s = 0.2 s a block -> recompute
    slow_disk = choose_policies(_pricing(1e3), budget_bytes=700, inflight=1)
    assert slow_disk.offload == 0 and slow_disk.recompute > 0
    # offload at 1 MB/s: 0.0002 s a block -> offload
    fast_disk = choose_policies(_pricing(1e6), budget_bytes=700, inflight=1)
    assert fast_disk.recompute == 0 and fast_disk.offload > 0
    # copies hidden behind 1 s of compute (a GPU's side stream): offloading costs nothing, and 5
    # blocks fit 700 bytes (100 outside the blocks, 100 the working block, 5 x 100 kept)
    hidden = choose_policies(_pricing(1e3, hidden_s=1.0), budget_bytes=700, inflight=1)
    assert (hidden.recompute, hidden.offload, hidden.added_s) == (0, 5, 0.0)
    # a tier that holds 2 blocks' bytes: the rest is recomputed
    small_tier = choose_policies(_pricing(1e6, tier_bytes=200), budget_bytes=700, inflight=1)
    assert small_tier.offload == 2 and small_tier.recompute > 0
    for c in (slow_disk, fast_disk, hidden, small_tier):
        assert c.resident_bytes <= 700 and len(c.policies()) == 10
    assert choose_policies(_pricing(1e6), budget_bytes=700, inflight=1, offload=False).offload == 0


@pytest.mark.parametrize("offload_bytes_per_s", [1e2, 1e3, 2e3, 1e4, 1e6])
@pytest.mark.parametrize("hidden_s", [0.0, 0.15, 0.5])
@pytest.mark.parametrize("tier_bytes", [float("inf"), 450.0])
@pytest.mark.parametrize("inflight", [1, 2, 3])
def test_the_search_is_exact(offload_bytes_per_s: float, hidden_s: float, tier_bytes: float, inflight: int) -> None:
    """Against every count: the same least added time, then the fewest bytes, at every budget."""
    pricing = _pricing(offload_bytes_per_s, hidden_s=hidden_s, tier_bytes=tier_bytes)
    for budget in range(100 * inflight, 1200 * inflight, 37):
        want = _brute_force(pricing, budget, inflight)
        if want is None:
            with pytest.raises(ValueError, match="no activation policy fits"):
                choose_policies(pricing, budget_bytes=budget, inflight=inflight)
            continue
        got = choose_policies(pricing, budget_bytes=budget, inflight=inflight)
        assert got.added_s == pytest.approx(want[0]) and got.resident_bytes <= budget, (budget, got, want)


def test_nothing_fits_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"no activation policy fits a budget of .* GiB: at least"):
        choose_policies(_pricing(1e6), budget_bytes=50, inflight=2)


def test_choice_fits_in_the_estimator_and_in_a_real_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    stage = _stage()
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in _inputs().items()}
    cost = measure_stage_cost(stage, shapes, dtype=torch.float32, seed=3)
    pricing = BlockPricing.from_cost(cost, flops_per_s=1e10, offload_bytes_per_s=1e9)
    keep = pricing.resident_bytes(0, 0, inflight=1)
    budget = int(0.6 * keep)
    choice = choose_policies(pricing, budget_bytes=budget, inflight=1)
    assert choice.resident_bytes <= budget and choice.offload + choice.recompute > 0
    apply_block_policies(list(stage.module.blocks), choice.policies(), tier=FileTier(tmp_path), min_bytes=0)  # type: ignore[union-attr]
    with count_saved_bytes() as held:
        loss = stage.forward(stage.module, _inputs(), seed=3)["loss"]
    loss.backward()
    assert held[0] <= budget, (held[0], choice)


def _run_config(tmp_path, gb: float):  # type: ignore[no-untyped-def]
    from mmpipe.config import DataConfig, LaunchConfig, ModelConfig, RunConfig, StageMemoryConfig, TrainConfig

    return RunConfig(
        run_dir=str(tmp_path / "run"),
        model=ModelConfig(dit_layers=4, dit_heads=16),  # the budgets below are sized for this DiT
        data=DataConfig(frames=17, height=64, width=64, num_samples=32, val_samples=8),
        train=TrainConfig(steps=2, batch_size=8, micro_batches=4, progress=False, threads=1),
        launch=LaunchConfig(nproc=2),
        placement={"text": [0], "vae": [0], "dit": [1]},
        memory={"dit": StageMemoryConfig(policy="auto", budget_gb=gb)},
    )


def test_memory_auto_in_a_run_config_sets_the_plans_fractions(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from mmpipe.assemble.placement import make_plans
    from mmpipe.errors import PlanError
    from mmpipe.train.prepare import prepare_run

    _, graph, _ = prepare_run(_run_config(tmp_path, 1.0))
    roomy, _ = make_plans(graph, _run_config(tmp_path, 1.0))
    assert roomy.groups["dit"].recompute == roomy.groups["dit"].offload == 0  # everything fits: keep
    # ~0.07 GiB of parameters, gradients and Adam moments plus ~0.02 GiB of activations
    tight, _ = make_plans(graph, _run_config(tmp_path, 0.08))
    assert tight.groups["dit"].recompute + tight.groups["dit"].offload > 0
    assert tight.actions == roomy.actions  # policies change no action
    with pytest.raises(PlanError, match=r"memory.dit.budget_gb=0.05: no activation policy fits"):
        make_plans(graph, _run_config(tmp_path, 0.05))
    # the value as the user wrote it (not rounded through bytes), a tiny budget in significant digits (1073 bytes)
    with pytest.raises(
        PlanError, match=r"budget_gb=1e-06: .* budget of 9\.99e-07 GiB: at least 0\.0\d+ GiB with 1 micro-batch in"
    ):
        make_plans(graph, _run_config(tmp_path, 1e-6))


def test_memory_config_errors_name_the_values() -> None:
    from mmpipe.config import StageMemoryConfig

    with pytest.raises(ValueError, match="policy=auto needs a positive budget_gb, got -1"):
        StageMemoryConfig(policy="auto", budget_gb=-1)
    with pytest.raises(ValueError, match="budget_gb=3.0 is only used with policy=auto"):
        StageMemoryConfig(policy="keep", budget_gb=3.0)


def test_policy_per_block_from_the_config(tiny_wan_dir) -> None:
    """``memory.dit.blocks`` reaches the plan as one letter per block (fractions counted for the cost
    model); ``selective`` covers every block; bad lists are refused before anything starts."""
    from mmpipe.assemble.placement import make_plans
    from mmpipe.config import LaunchConfig, RunConfig, StageMemoryConfig, from_dict
    from mmpipe.errors import PlanError
    from mmpipe.models.wan import build_t2v_training_graph

    graph = build_t2v_training_graph(tiny_wan_dir, text_len=16)

    def dit(memory: dict) -> object:
        plan, _ = make_plans(graph, RunConfig(launch=LaunchConfig(nproc=2), memory=memory))
        return plan.groups["dit"]

    group = dit({"dit": StageMemoryConfig(blocks=["offload", "recompute"])})  # the tiny DiT's 2 blocks
    assert (group.blocks, group.recompute, group.offload) == ("or", 0.5, 0.5)
    group = dit({"dit": StageMemoryConfig(blocks=["selective", "keep"])})
    assert (group.blocks, group.recompute, group.offload) == ("sk", 0.0, 0.0)
    assert dit({"dit": StageMemoryConfig(policy="selective")}).blocks == "ss"
    with pytest.raises(PlanError, match="memory.dit.blocks names 3 policies; stage 'dit' has 2 repeated blocks"):
        dit({"dit": StageMemoryConfig(blocks=["offload", "keep", "keep"])})
    with pytest.raises(PlanError, match="memory.text.blocks: stage 'text' runs no backward"):
        dit({"text": StageMemoryConfig(blocks=["keep", "keep"])})
    with pytest.raises(ValueError, match=r"memory.dit.blocks\[1\]='bogus': expected one of"):
        from_dict(RunConfig, {"memory": {"dit": {"blocks": ["keep", "bogus"]}}})
    with pytest.raises(ValueError, match="give a policy or a list per block"):
        StageMemoryConfig(policy="recompute", blocks=["keep"])


def test_auto_without_a_budget_needs_a_gpu(tmp_path) -> None:
    """``memory.dit.policy=auto`` with no ``budget_gb`` budgets against the GPU; CPU ranks must give one."""
    from mmpipe.assemble.placement import device_budget_gb
    from mmpipe.config import RunConfig, StageMemoryConfig
    from mmpipe.errors import PlanError
    from mmpipe.sched.plan import DeviceGroup

    cfg = RunConfig(run_dir=str(tmp_path), device="cpu", memory={"dit": StageMemoryConfig(policy="auto")})
    with pytest.raises(PlanError, match=r"memory.dit.policy=auto: give memory.dit.budget_gb on CPU ranks"):
        device_budget_gb(None, "dit", {"dit": DeviceGroup((0,))}, cfg)  # type: ignore[arg-type]


def test_cuda_peaks_by_architecture() -> None:
    from mmpipe.sched.cluster import cuda_peak_flops

    assert cuda_peak_flops(9, 0) == 989e12  # H100 / H200 dense bf16
    assert cuda_peak_flops(7, 5) == 100e12  # unknown: nominal


def test_a_tier_that_writes_one_block_at_a_time_holds_one_more_block() -> None:
    """The file tier keeps the block being written in memory: offloading counts it once."""
    plain, filed = _pricing(1e6), _pricing(1e6, pending_blocks=1)
    assert filed.resident_bytes(0, 0, inflight=2) == plain.resident_bytes(0, 0, inflight=2)
    assert filed.resident_bytes(0, 3, inflight=2) == plain.resident_bytes(0, 3, inflight=2) + 100
    # so the same budget takes one more offloaded block (or a recomputed one) with the file tier
    a, b = (choose_policies(p, budget_bytes=700, inflight=1) for p in (plain, filed))
    assert b.recompute + b.offload == a.recompute + a.offload + 1 and b.resident_bytes <= 700
