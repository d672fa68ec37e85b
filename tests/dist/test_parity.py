"""Distributed placements against the single-process run: losses and every trainable parameter.

Each run launches real worker processes (gloo on CPU) through the same ``train`` entry point the
CLI uses. Threads are pinned to 1 per rank in every run, so the CPU kernels reduce in the same
order everywhere and pipeline-only placements must agree bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel

from mmpipe.config import DataConfig, LaunchConfig, ModelConfig, RunConfig, StageParallelConfig, TrainConfig
from mmpipe.rundir import read_metrics
from mmpipe.runtime.checkpoint import load_latest_weights
from mmpipe.runtime.events import read_events
from mmpipe.train import train

STEPS = 3


def run(
    run_dir: Path,
    nproc: int,
    placement: dict | None,
    model: ModelConfig | None = None,
    batch_size: int = 4,
    parallel: dict[str, StageParallelConfig] | None = None,
    steps: int = STEPS,
    num_samples: int = 64,
) -> RunConfig:
    cfg = RunConfig(
        run_dir=str(run_dir),
        model=model or ModelConfig(),
        data=DataConfig(frames=9, height=32, width=32, num_samples=num_samples, val_samples=max(4, batch_size)),
        train=TrainConfig(
            steps=steps,
            batch_size=batch_size,
            micro_batches=2,
            warmup_steps=1,
            log_every=1,
            val_every=1000,
            ckpt_every=steps,
            progress=False,
            threads=1,
        ),
        launch=LaunchConfig(nproc=nproc, timeout_s=120),
        placement=placement,
        parallel=parallel or {},
    )
    train(cfg)
    return cfg


def dit_params(run_dir: Path) -> dict[str, torch.Tensor]:
    model = WanTransformer3DModel.from_pretrained(run_dir / "pipeline" / "transformer")
    load_latest_weights(run_dir, {"dit": model})
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ref")
    run(root, 1, {})
    return root


PIPELINE_ONLY = [
    pytest.param(2, {"text": [0], "vae": [0], "dit": [1]}, id="encoders0-dit1"),
    pytest.param(3, {"text": [0], "vae": [1], "dit": [2]}, id="text0-vae1-dit2-fan-in"),
]


@pytest.mark.parametrize(("nproc", "placement"), PIPELINE_ONLY)
def test_pipeline_placements_are_bitwise_identical(
    reference: Path, tmp_path: Path, nproc: int, placement: dict
) -> None:
    run(tmp_path, nproc, placement)
    ref, got = read_metrics(reference), read_metrics(tmp_path)
    assert [r.get("loss") for r in got] == [r.get("loss") for r in ref]
    assert [r.get("grad_norm") for r in got] == [r.get("grad_norm") for r in ref]
    assert got[-1]["val_loss"] == ref[-1]["val_loss"]
    pr, pg = dit_params(reference), dit_params(tmp_path)
    assert all(torch.equal(pr[k], pg[k]) for k in pr), [k for k in pr if not torch.equal(pr[k], pg[k])]
    assert pr.keys() == pg.keys()
    events = read_events(tmp_path)
    sends = [e for e in events if e["kind"] == "SEND" and e["phase"] == "train"]
    assert len(sends) == STEPS * 2 * 2  # text and vae each send one bundle per micro-batch
    assert all(e["bytes"] > 0 and e["end"] >= e["start"] for e in sends)
    assert {e["rank"] for e in events} == set(range(nproc))


def test_data_parallel_dit_matches_within_reordering_tolerance(reference: Path, tmp_path: Path) -> None:
    run(tmp_path, 3, {"text": [0], "vae": [0], "dit": {"ranks": [1, 2], "dp": 2}})
    ref, got = read_metrics(reference), read_metrics(tmp_path)
    # dp=2 sums each half micro-batch separately and averages the halves' gradients with a
    # reduce-scatter: the same math reassociated in float32 (~1e-7 relative per op), amplified
    # a little by three Adam steps. 1e-5 is far below any real divergence (a wrong slice or a
    # missing gradient average moves the loss by >1e-2).
    for r, g in zip(ref[1:], got[1:], strict=True):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-5)
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
    pr, pg = dit_params(reference), dit_params(tmp_path)
    # Adam's normalised step lr * m / (sqrt(v) + eps) turns that relative gradient noise into a
    # parameter drift for elements whose gradient is tiny (observed 1.3e-5 after three steps, with
    # the losses equal to 7 digits); 5e-5 is 2.5 % of one step (lr = 2e-3), and a wrong slice or a
    # missing gradient average moves parameters by whole steps.
    for k in pr:
        torch.testing.assert_close(pg[k], pr[k], rtol=1e-5, atol=5e-5, msg=k)


def test_replicated_data_parallel_dit_matches_the_single_process_run(reference: Path, tmp_path: Path) -> None:
    """``replicate``: the DiT whole on both ranks (DDP), its gradients all-reduced once per step
    instead of reduce-scattered: the single-process run within the data-parallel tolerance above,
    and the checkpoint (one copy of each tensor, however many ranks hold it) loads as the DiT's."""
    run(tmp_path, 3, {"text": [0], "vae": [0], "dit": {"ranks": [1, 2], "dp": 2, "replicate": True}})
    ref, got = read_metrics(reference), read_metrics(tmp_path)
    for r, g in zip(ref[1:], got[1:], strict=True):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-5)
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
    assert got[-1]["val_loss"] == pytest.approx(ref[-1]["val_loss"], rel=1e-5)
    pr, pg = dit_params(reference), dit_params(tmp_path)
    assert pr.keys() == pg.keys()
    for k in pr:
        torch.testing.assert_close(pg[k], pr[k], rtol=1e-5, atol=5e-5, msg=k)
    initial = WanTransformer3DModel.from_pretrained(tmp_path / "pipeline" / "transformer").state_dict()
    assert any(not torch.equal(initial[k], pg[k]) for k in initial)  # it trained
    plan = (tmp_path / "plan.txt").read_text()
    assert "place dit ranks=1,2 dp=2 replicate=1" in plan


def test_parameters_gathered_once_per_step_match_gathering_per_micro_batch(tmp_path: Path) -> None:
    """``gather_once``: FSDP2 keeps the DiT's gathered parameters from the step's first forward to its
    last backward; the gradients are reduce-scattered the same way, so training is bitwise the same."""
    dit = {"ranks": [1, 2], "dp": 2}
    run(tmp_path / "mb", 3, {"text": [0], "vae": [0], "dit": dit})
    run(tmp_path / "once", 3, {"text": [0], "vae": [0], "dit": dit | {"gather_once": True}})
    a, b = read_metrics(tmp_path / "mb"), read_metrics(tmp_path / "once")
    assert [r.get("loss") for r in a] == [r.get("loss") for r in b]
    assert [r.get("grad_norm") for r in a] == [r.get("grad_norm") for r in b]
    assert a[-1]["val_loss"] == b[-1]["val_loss"]
    pa, pb = dit_params(tmp_path / "mb"), dit_params(tmp_path / "once")
    assert all(torch.equal(pa[k], pb[k]) for k in pa), [k for k in pa if not torch.equal(pa[k], pb[k])]


def test_frozen_vae_split_unequally_over_two_ranks(tmp_path: Path) -> None:
    """Micro-batches of 3 clips: the VAE's two replicas encode 1 and 2 of them, in turn (the one
    with 1 clip in a micro-batch gets 2 in the next), the DiT rank receives exactly its rows from
    both, and training matches the single-process run."""
    run(tmp_path / "ref", 1, None, batch_size=6)
    run(tmp_path / "split", 3, {"text": [0], "vae": {"ranks": [0, 1], "dp": 2}, "dit": [2]}, batch_size=6)
    ref, got = read_metrics(tmp_path / "ref"), read_metrics(tmp_path / "split")
    # The VAE runs on 1 and 2 clips instead of 3 at once: its convolutions may block the batch
    # differently (float32 reassociation, ~1e-7), which three Adam steps keep far below 1e-5.
    for r, g in zip(ref[1:], got[1:], strict=True):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-5)
    pr, pg = dit_params(tmp_path / "ref"), dit_params(tmp_path / "split")
    # The latents differ by that reassociation; Adam's normalised step turns it into a drift of the
    # parameters whose gradient is tiny (the same bound as the data-parallel test above).
    for k in pr:
        torch.testing.assert_close(pg[k], pr[k], rtol=1e-5, atol=5e-5, msg=k)
    sends = [e for e in read_events(tmp_path / "split") if e["kind"] == "SEND" and e["stage"] == "vae"]
    by_mb = {(e["rank"], e["mb"]): e["bytes"] for e in sends if e["phase"] == "train"}
    one = by_mb[(0, 0)]
    assert by_mb == {(0, 0): one, (1, 0): 2 * one, (0, 1): 2 * one, (1, 1): one}  # 1 clip and 2 clips, in turn


def u2g_params(run_dir: Path) -> dict[str, torch.Tensor]:
    from mmpipe.stages.multimodal import Connector, ImageTextLM

    root = run_dir / "pipeline"
    modules = {
        "llm": ImageTextLM.load(root / "llm", vision_width=32),
        "connector": Connector.load(root / "connector"),
        "dit": WanTransformer3DModel.from_pretrained(root / "transformer"),
    }
    load_latest_weights(run_dir, modules)
    return {f"{s}.{k}": v.clone() for s, m in modules.items() for k, v in m.state_dict().items()}


U2G = ModelConfig(name="u2g_tiny", kind="u2g", text_encoder="qwen2")


@pytest.fixture(scope="module")
def u2g_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("u2g_ref")
    run(root, 1, None, U2G)
    return root


def test_understand_then_generate_over_three_ranks_is_bitwise_identical(u2g_reference: Path, tmp_path: Path) -> None:
    """Frozen vision tower on rank 0, trainable LLM + connector on rank 1, trainable DiT on rank 2:
    the DiT's context gradients cross to rank 1, the LLM's from the connector stay local."""
    run(tmp_path / "pp", 3, {"vision": [0], "vae": [0], "llm": [1], "connector": [1], "dit": [2]}, U2G)
    ref, got = read_metrics(u2g_reference), read_metrics(tmp_path / "pp")
    for r, g in zip(ref, got, strict=True):  # every logged loss, gradient norm and lr, bit for bit
        r.pop("samples_per_s", None), g.pop("samples_per_s", None)
        assert r == g
    assert {"grad_norm/llm", "grad_norm/connector", "grad_norm/dit"} <= set(got[1])
    assert got[1]["grad_norm/llm"] > 0  # gradients reached the LLM across the boundary
    pr, pg = u2g_params(u2g_reference), u2g_params(tmp_path / "pp")
    assert pr.keys() == pg.keys() and any(k.startswith("llm.") for k in pr)
    assert all(torch.equal(pr[k], pg[k]) for k in pr), [k for k in pr if not torch.equal(pr[k], pg[k])]
    from mmpipe.stages.multimodal import ImageTextLM

    initial = ImageTextLM.load(u2g_reference / "pipeline" / "llm", vision_width=32).state_dict()
    assert any(not torch.equal(initial[k], pr[f"llm.{k}"]) for k in initial)  # and the LLM actually trained


def test_understand_then_generate_with_fsdp_llm_feeding_a_one_rank_dit(u2g_reference: Path, tmp_path: Path) -> None:
    """LLM and connector FSDP-sharded over both ranks, the DiT on rank 1 only: rank 0 is one hop
    deeper than rank 1 for 1F1B, but the two share the LLM's and the connector's collectives, so
    both must run them in one order (this placement once crashed with a gloo "connection reset"
    when rank 0 gathered the LLM for micro-batch 1 while rank 1 gathered the connector for the
    backward of micro-batch 0). Matches the single-process run within reordering tolerance."""
    dp = {"ranks": [0, 1], "dp": 2}
    run(tmp_path / "dp", 2, {"vision": [0], "vae": [0], "llm": dp, "connector": dp, "dit": [1]}, U2G)
    ref, got = read_metrics(u2g_reference), read_metrics(tmp_path / "dp")
    # dp=2: each half micro-batch's gradient is summed separately and averaged by a reduce-scatter
    # (float32 reassociation, see test_data_parallel_dit_matches_within_reordering_tolerance).
    for r, g in zip(ref[1:], got[1:], strict=True):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-5)
        for key in ("grad_norm/llm", "grad_norm/connector", "grad_norm/dit"):
            assert g[key] == pytest.approx(r[key], rel=1e-5), key
    pr, pg = u2g_params(u2g_reference), u2g_params(tmp_path / "dp")
    for k in pr:
        torch.testing.assert_close(pg[k], pr[k], rtol=1e-5, atol=5e-5, msg=k)


WAN22 = ModelConfig(boundary_ratio=0.6)


def wan22_params(run_dir: Path) -> dict[str, torch.Tensor]:
    root = run_dir / "pipeline"
    modules = {
        "dit": WanTransformer3DModel.from_pretrained(root / "transformer"),
        "dit_2": WanTransformer3DModel.from_pretrained(root / "transformer_2"),
    }
    load_latest_weights(run_dir, modules)
    return {f"{s}.{k}": v.clone() for s, m in modules.items() for k, v in m.state_dict().items()}


def test_wan22_two_experts_on_their_own_ranks_are_bitwise_identical(tmp_path: Path) -> None:
    """Wan 2.2's two experts as two trainable stages, each on its noise range (``dit`` from the
    boundary up, ``dit_2`` below it): the encoders and the high-noise expert on rank 0, the low-noise
    expert on rank 1, against the single-process run; both experts train, and a trained run
    generates through the family graph with each expert's weights."""
    run(tmp_path / "ref", 1, None, WAN22)
    run(tmp_path / "pp", 2, {"text": [0], "vae": [0], "dit": [0], "dit_2": [1]}, WAN22)
    ref, got = read_metrics(tmp_path / "ref"), read_metrics(tmp_path / "pp")
    for r, g in zip(ref, got, strict=True):
        r.pop("samples_per_s", None), g.pop("samples_per_s", None)
        # The step's loss is the sum of both experts' micro-batch losses: one rank adds them in
        # micro-batch order, two ranks each expert's first and then reduce, so the float32 sum may
        # differ in its last bit; every gradient, norm and parameter is bitwise the same.
        for key in ("loss", "val_loss"):
            if key in r:
                assert g.pop(key) == pytest.approx(r.pop(key), rel=1e-6)
        assert r == g
    assert {"grad_norm/dit", "grad_norm/dit_2"} <= set(got[1]) and got[1]["grad_norm/dit_2"] > 0
    pr, pg = wan22_params(tmp_path / "ref"), wan22_params(tmp_path / "pp")
    assert all(torch.equal(pr[k], pg[k]) for k in pr), [k for k in pr if not torch.equal(pr[k], pg[k])]
    initial = WanTransformer3DModel.from_pretrained(tmp_path / "ref" / "pipeline" / "transformer_2").state_dict()
    assert any(not torch.equal(initial[k], pr[f"dit_2.{k}"]) for k in initial)  # the second expert trained

    from mmpipe.models.pipeline_graph import PipelineGraph
    from mmpipe.runtime.trained import load_trained_graph

    graph = load_trained_graph(tmp_path / "pp")
    assert isinstance(graph, PipelineGraph)
    experts = graph.denoise.module
    assert all(torch.equal(v, pg[f"dit_2.{k}"]) for k, v in experts["transformer_2"].state_dict().items())
    video = graph.generate(
        "a red circle moving left", height=32, width=32, num_frames=9, num_inference_steps=2, seed=0, progress=False
    )
    assert video.shape == (1, 9, 32, 32, 3)


def test_wan22_experts_each_sequence_parallel_match_one_process(tmp_path: Path) -> None:
    """Both Wan 2.2 experts Ulysses-split over the same two ranks (encoders on rank 0): each
    expert's stage takes the Wan DiT's sequence parallelism; training matches the 1-process run
    within the reassociation tolerance of the sequence-parallel tests."""
    run(tmp_path / "ref", 1, None, WAN22)
    split = StageParallelConfig(ulysses=2)
    placement = {"text": [0], "vae": [0], "dit": [0, 1], "dit_2": [0, 1]}
    run(tmp_path / "sp", 2, placement, WAN22, parallel={"dit": split, "dit_2": split})
    ref, got = read_metrics(tmp_path / "ref"), read_metrics(tmp_path / "sp")
    assert len(got) == len(ref)
    for r, g in zip(ref[1:], got[1:], strict=True):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-5)
        for key in ("grad_norm/dit", "grad_norm/dit_2"):
            assert g[key] == pytest.approx(r[key], rel=1e-5)
    pr, pg = wan22_params(tmp_path / "ref"), wan22_params(tmp_path / "sp")
    # atol as in test_data_parallel_dit_matches_within_reordering_tolerance: Adam's normalised step
    # turns the reassociation noise of an element with a tiny gradient into a drift (observed 2e-5
    # on one element of 16384 after three steps); a wrong split moves parameters by whole steps
    for k in pr:
        torch.testing.assert_close(pg[k], pr[k], rtol=1e-5, atol=5e-5, msg=k)


def test_data_parallel_ranks_serve_every_frozen_row_from_their_cache_after_one_epoch(tmp_path: Path) -> None:
    # 8 samples, 4 a step, micro-batches of 2 rows split over 2 data-parallel ranks: epoch 1 is
    # steps 1-2; a sample keeps its row (train.data.sample_indices' lanes), hence its rank, so in
    # steps 3-6 each rank's VAE rows all come from its own cache
    colocated = {s: {"ranks": [0, 1], "dp": 2} for s in ("text", "vae", "dit")}
    run(tmp_path, 2, colocated, steps=6, num_samples=8)
    served = [e for e in read_events(tmp_path) if e.get("frozen_cache_rows") and e["phase"] == "train"]
    vae = [e for e in served if e["stage"] == "vae"]
    assert {e["step"] for e in vae} == {3, 4, 5, 6}
    assert [sum(e["frozen_cache_rows"] for e in vae if e["rank"] == r) for r in (0, 1)] == [8, 8]
