"""Training LTX-Video, HunyuanVideo and CogVideoX pipeline directories (``model.path=DIR``) through ``mmpipe train``
(Wan 2.1 image-to-video's: ``test_wan_i2v_training.py``).

Per family: the stages encode exactly as the diffusers pipeline does, the DiT stage's loss is finite
and reaches every parameter, and a pure pipeline split (encoders on rank 0, the DiT on rank 1) trains
bitwise like the single-process run (threads pinned to 1 per rank, as in ``test_parity``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import (
    CogVideoXPipeline,
    CogVideoXTransformer3DModel,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideoPipeline,
    HunyuanVideoTransformer3DModel,
    LTXPipeline,
    LTXVideoTransformer3DModel,
)
from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift

from mmpipe.config import DataConfig, LaunchConfig, ModelConfig, RunConfig, TrainConfig
from mmpipe.graph import Graph
from mmpipe.models import build_training_graph, check_training_pipeline_dir, training_stages
from mmpipe.models.cogvideox import save_tiny_cogvideox_pipeline
from mmpipe.models.hunyuan import save_tiny_hunyuan_pipeline
from mmpipe.models.ltx import save_tiny_ltx_pipeline
from mmpipe.rundir import read_metrics
from mmpipe.runtime.checkpoint import load_latest_weights
from mmpipe.runtime.events import read_events
from mmpipe.train import train
from mmpipe.train.data import Collator

STEPS = 3
TEXT_LEN = 16
PROMPTS = ["a red circle moving left", "a blue square moving up"]

FAMILIES: dict[str, tuple[Callable[[Path], Path], Any, Any]] = {
    "ltx": (lambda p: save_tiny_ltx_pipeline(p, seed=0), LTXPipeline, LTXVideoTransformer3DModel),
    "hunyuan": (lambda p: save_tiny_hunyuan_pipeline(p, seed=0), HunyuanVideoPipeline, HunyuanVideoTransformer3DModel),
    "cogvideox": (
        lambda p: save_tiny_cogvideox_pipeline(p, seed=0, variant="2b"),
        CogVideoXPipeline,
        CogVideoXTransformer3DModel,
    ),
}


def _text_len(root: Path) -> int:
    """``model.text_len``: CogVideoX pads prompts to its transformer's ``max_text_seq_length`` (226 in
    the tiny preset too), which its sin-cos positions cover; the others take ``TEXT_LEN``."""
    index = root / "model_index.json"
    if index.is_file() and json.loads(index.read_text()).get("_class_name") == "CogVideoXPipeline":
        return int(json.loads((root / "transformer" / "config.json").read_text())["max_text_seq_length"])
    return TEXT_LEN


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    name = request.param
    return name, FAMILIES[name][0](tmp_path_factory.mktemp(name) / "pipeline")


def _graph(root: Path) -> Graph:
    return build_training_graph(ModelConfig(path=str(root), text_len=_text_len(root)), root)


def _batch(graph: Graph, root: Path) -> dict[str, torch.Tensor]:
    video = torch.rand((len(PROMPTS), 3, 9, 32, 32), generator=torch.Generator().manual_seed(0)) * 2 - 1
    collate = Collator(graph, root, _text_len(root))
    return collate([{"caption": c, "video": v} for c, v in zip(PROMPTS, video, strict=True)])


def test_stages_encode_as_the_pipeline_does(family_dir: tuple[str, Path]) -> None:
    """The text and VAE stages' outputs are the pipeline's own ``encode_prompt`` and latents."""
    name, root = family_dir
    graph = _graph(root)
    assert tuple(graph.stages) == training_stages(ModelConfig(path=str(root))) == ("text", "vae", "dit")
    batch = _batch(graph, root)
    pipe: Any = FAMILIES[name][1].from_pretrained(root)
    text, vae = graph.stages["text"], graph.stages["vae"]
    with torch.no_grad():
        got = text.forward(text.module, batch)
        latents = vae.forward(vae.module, batch)["latents"]
        z = pipe.vae.encode(batch["video"]).latent_dist.mode()
        if name == "ltx":
            embeds, mask, _, _ = pipe.encode_prompt(
                PROMPTS, do_classifier_free_guidance=False, max_sequence_length=TEXT_LEN
            )
            want = pipe._normalize_latents(
                z, pipe.vae.latents_mean, pipe.vae.latents_std, pipe.vae.config.scaling_factor
            )
            rope = graph.stages["dit"].rope_interpolation_scale
            assert rope == (pipe.vae_temporal_compression_ratio / 25, *(2 * [pipe.vae_spatial_compression_ratio]))
        elif name == "hunyuan":
            embeds, pooled, mask = pipe.encode_prompt(PROMPTS, max_sequence_length=TEXT_LEN)
            assert torch.equal(got["pooled"], pooled)
            want = z * pipe.vae.config.scaling_factor
        else:  # CogVideoX: no text mask; latents frames-first, as the transformer takes them
            embeds, _ = pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False, max_sequence_length=226)
            mask = None
            want = (z * pipe.vae.config.scaling_factor).permute(0, 2, 1, 3, 4)
            assert embeds.shape[1] == pipe.transformer.config.max_text_seq_length == 226
    assert torch.equal(got["context"], embeds)
    if mask is not None:
        assert torch.equal(got["context_mask"].bool(), mask.bool())
        assert not got["context_mask"].bool().all()  # padding is masked
    # Two separately loaded copies of the VAE may pick different CPU convolution paths (last-bit
    # differences, seen with HunyuanVideo's VAE); the normalisation itself is the pipeline's formula.
    torch.testing.assert_close(latents, want, rtol=0, atol=1e-6)


def test_dit_loss_is_finite_and_backpropagates(family_dir: tuple[str, Path]) -> None:
    name, root = family_dir
    graph = _graph(root)
    batch = _batch(graph, root)
    text, vae, dit = (graph.stages[s] for s in ("text", "vae", "dit"))
    with torch.no_grad():
        inputs = {**text.forward(text.module, batch), **vae.forward(vae.module, batch)}
    module = dit.module.train()
    loss = dit.forward(module, inputs, seed=5)["loss"]
    assert loss.shape == () and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in module.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads if g is not None) > 0
    again = dit.forward(module, inputs, seed=5)["loss"]  # a pure function of (parameters, inputs, seed)
    assert torch.equal(again.detach(), loss.detach())


def test_ltx_dit_shift_follows_the_scheduler(tmp_path: Path) -> None:
    """A scheduler with ``use_dynamic_shifting`` (the released LTX-Video's) shifts each draw by
    ``exp(mu)`` of the latent grid, as the sampler shifts its sigmas."""
    root = save_tiny_ltx_pipeline(tmp_path / "pipeline", seed=0)
    dit = _graph(root).stages["dit"]
    assert dit.flow_shift((3, 8, 8)) == 1.0  # the tiny scheduler: shift=1, static
    _dynamic_shift(root)
    dit = _graph(root).stages["dit"]
    want = math.exp(calculate_shift(3 * 8 * 8, 256, 4096, 0.95, 2.05))
    assert dit.flow_shift((3, 8, 8)) == pytest.approx(want) and want != 1.0


@pytest.mark.parametrize("name", ["ltx", "cogvideox"])
def test_wan_kernels_on_another_dit_are_refused_before_any_worker(tmp_path: Path, name: str) -> None:
    from mmpipe.config import KernelConfig

    root = FAMILIES[name][0](tmp_path / name)
    model = ModelConfig(path=str(root), text_len=_text_len(root), kernels=KernelConfig(norm_modulate="triton"))
    with pytest.raises(ValueError, match=r"stage 'dit': model.kernels asks for mmpipe's Triton kernels, which are"):
        train(RunConfig(run_dir=str(tmp_path / "run"), model=model))
    assert not (tmp_path / "run").exists()


def _dynamic_shift(root: Path) -> None:
    """Give the pipeline directory the released LTX-Video's scheduler: a shift of the latent grid."""
    FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05).save_config(
        root / "scheduler"
    )


def _run(
    run_dir: Path,
    root: Path,
    nproc: int,
    placement: dict | None,
    parallel: dict[str, Any] | None = None,
    memory: dict[str, Any] | None = None,
) -> None:
    extra = {"memory": memory} if memory is not None else {}
    train(
        RunConfig(
            run_dir=str(run_dir),
            model=ModelConfig(path=str(root), text_len=_text_len(root)),
            data=DataConfig(frames=9, height=32, width=32, num_samples=64, val_samples=4),
            train=TrainConfig(
                steps=STEPS,
                batch_size=4,
                micro_batches=2,
                warmup_steps=1,
                log_every=1,
                val_every=1000,
                ckpt_every=STEPS,
                progress=False,
                threads=1,
            ),
            launch=LaunchConfig(nproc=nproc, timeout_s=120),
            placement=placement,
            parallel=parallel or {},
            **extra,
        )
    )


def _dit_params(run_dir: Path, root: Path, cls: Any) -> dict[str, torch.Tensor]:
    model = cls.from_pretrained(root / "transformer")
    load_latest_weights(run_dir, {"dit": model})
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_pipeline_split_trains_bitwise_like_one_process(family_dir: tuple[str, Path], tmp_path: Path) -> None:
    """Text and VAE on rank 0, the DiT on rank 1, against one process: the same losses, gradient
    norms and DiT parameters, bit for bit; and the DiT trained."""
    name, root = family_dir
    cls = FAMILIES[name][2]
    _run(tmp_path / "ref", root, 1, None)
    _run(tmp_path / "pp", root, 2, {"text": [0], "vae": [0], "dit": [1]})
    ref, got = read_metrics(tmp_path / "ref"), read_metrics(tmp_path / "pp")
    assert len(ref) == len(got) and any("loss" in r for r in ref)
    assert [r.get("loss") for r in got] == [r.get("loss") for r in ref]
    assert [r.get("grad_norm") for r in got] == [r.get("grad_norm") for r in ref]
    assert got[-1]["val_loss"] == ref[-1]["val_loss"]
    assert all(r["grad_norm"] > 0 for r in ref if "grad_norm" in r)
    pr, pg = _dit_params(tmp_path / "ref", root, cls), _dit_params(tmp_path / "pp", root, cls)
    assert pr.keys() == pg.keys()
    assert all(torch.equal(pr[k], pg[k]) for k in pr), [k for k in pr if not torch.equal(pr[k], pg[k])]
    initial = cls.from_pretrained(root / "transformer").state_dict()
    assert any(not torch.equal(initial[k], pr[k]) for k in initial)  # the DiT trained
    sends = [e for e in read_events(tmp_path / "pp") if e["kind"] == "SEND" and e["phase"] == "train"]
    assert len(sends) == STEPS * 2 * 2 and all(e["rank"] == 0 for e in sends)  # text and vae, each micro-batch
    # the trained run generates (mmpipe generate / serve ckpt=RUN_DIR) with the trained DiT
    from mmpipe.models.pipeline_graph import PipelineGraph
    from mmpipe.runtime.trained import check_trained_run, load_trained_graph

    check_trained_run(tmp_path / "pp")
    graph: Any = load_trained_graph(tmp_path / "pp")
    assert isinstance(graph, PipelineGraph)
    assert all(torch.equal(v, pg[k]) for k, v in graph.denoise.module["transformer"].state_dict().items())
    width = 64 if name == "ltx" else 32
    video = graph.generate(
        "a red circle moving left",
        height=32,
        width=width,
        num_frames=9,
        num_inference_steps=2,
        seed=0,
        output_type="np",
        progress=False,
    )
    assert video.shape == (1, 9, 32, width, 3)


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ({"_class_name": "FluxPipeline"}, "_class_name='FluxPipeline' is not supported; supported: "),
        ({"_class_name": "QwenImagePipeline"}, "_class_name='QwenImagePipeline' is not supported; supported: "),
        (
            {"_class_name": "CogVideoXImageToVideoPipeline"},
            "_class_name='CogVideoXImageToVideoPipeline' is not supported; supported: ",
        ),
        # WanImageToVideoPipeline layouts: test_wan_i2v_training
        ({"_class_name": "WanPipeline", "expand_timesteps": True}, "expand_timesteps=True"),
    ],
    ids=["flux", "qwen-image", "cogvideox-i2v", "wan-ti2v"],
)
def test_unsupported_pipeline_is_refused_before_any_worker(tmp_path: Path, meta: dict, message: str) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    components = ("text_encoder", "tokenizer", "transformer", "vae", "scheduler")
    (bad / "model_index.json").write_text(json.dumps(meta | {c: ["diffusers", "X"] for c in components}))
    for c in components:
        (bad / c).mkdir()
    with pytest.raises(ValueError, match="model.path=") as err:
        _run(tmp_path / "run", bad, 2, None)
    assert message in str(err.value)
    if "supported: " in message:
        supported = (
            "['WanPipeline', 'LTXPipeline', 'HunyuanVideoPipeline', 'CogVideoXPipeline', 'WanImageToVideoPipeline']"
        )
        assert supported in str(err.value)
    assert not (tmp_path / "run").exists()


def test_cogvideox_is_accepted_and_its_text_len_checked(tmp_path: Path) -> None:
    """A ``CogVideoXPipeline`` directory is a training pipeline; its graph refuses a ``model.text_len``
    other than the transformer's ``max_text_seq_length`` and sequence parallelism, and draws its
    noise and integer timesteps for the whole micro-batch (a row slice sees the same draw)."""
    root = save_tiny_cogvideox_pipeline(tmp_path / "pipeline", seed=0, variant="2b")
    assert check_training_pipeline_dir(root) == root
    with pytest.raises(ValueError, match="model.text_len=16: .*max_text_seq_length=226; set model.text_len=226"):
        build_training_graph(ModelConfig(path=str(root), text_len=16), root)
    with pytest.raises(ValueError, match="set model.text_len=226"):  # mmpipe train: before anything is written
        train(RunConfig(run_dir=str(tmp_path / "run"), model=ModelConfig(path=str(root), text_len=16)))
    assert not (tmp_path / "run").exists()
    dit = _graph(root).stages["dit"]
    with pytest.raises(ValueError, match="cannot be sequence parallel"):
        dit.check_sequence_parallel(2, 1)
    from mmpipe.stages.dit import sample_v_prediction

    x = torch.zeros(4, 3, 4, 2, 4)
    noise, t = sample_v_prediction(x, seed=3, num_train_timesteps=1000)
    assert t.dtype == torch.int64 and bool(((t >= 0) & (t < 1000)).all())
    part, t_part = sample_v_prediction(x[1:3], seed=3, num_train_timesteps=1000, rows=(1, 3, 4))
    assert torch.equal(part, noise[1:3]) and torch.equal(t_part, t[1:3])


def test_hunyuan_dit_with_the_real_mask_and_pooled_vector_split_by_ulysses(tmp_path: Path) -> None:
    """The pipeline-directory HunyuanVideo DiT (Llama context with its mask, CLIP's pooled vector)
    Ulysses-split over two ranks: joint sequence-parallel attention over the video tokens and the
    masked text matches the 1-process run within the reassociation tolerance of the
    sequence-parallel tests (a lost shard or a wrong mask moves the loss by far more)."""
    root = save_tiny_hunyuan_pipeline(tmp_path / "hunyuan", seed=0)
    _assert_split_dit_matches_one_process(tmp_path, root, HunyuanVideoTransformer3DModel, ulysses=2)


def _assert_split_dit_matches_one_process(tmp_path: Path, root: Path, cls: Any, **split: int) -> None:
    """Encoders on rank 0, the DiT split (``split``: ``ulysses=2`` or ``ring=2``) over ranks 0 and 1,
    against one process: losses and gradient norms within rel 1e-5, every DiT parameter within
    1e-5 (the reassociation tolerance of the sequence-parallel tests)."""
    from mmpipe.config import StageParallelConfig

    _run(tmp_path / "ref", root, 1, None)
    _run(tmp_path / "sp", root, 2, {"text": [0], "vae": [0], "dit": [0, 1]}, {"dit": StageParallelConfig(**split)})
    ref, got = read_metrics(tmp_path / "ref"), read_metrics(tmp_path / "sp")
    assert len(got) == len(ref)
    for r, g in zip(ref[1:], got[1:], strict=True):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-5)
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
    pr, pg = _dit_params(tmp_path / "ref", root, cls), _dit_params(tmp_path / "sp", root, cls)
    for k in pr:
        torch.testing.assert_close(pg[k], pr[k], rtol=1e-5, atol=1e-5, msg=k)


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_ltx_dit_split_over_two_ranks_matches_one_process(tmp_path: Path, mode: str) -> None:
    """The LTX-Video DiT, its latent frames split over two ranks (Ulysses or ring), with the released
    model's grid-dependent shift: each rank packs its frames, the rotary tables are the whole clip's
    cut to its tokens and the shift is the whole grid's, so the 1-process run's losses, gradient norms
    and parameters come out within the reassociation tolerance of the sequence-parallel tests (a
    rank's frames at the wrong rotary positions, or a shift of its own frames, move them far more).
    The DiT shares rank 0 with the encoders: the ring's exchanges run on a group of their own (on
    the default group a ring receive matched the encoders' send to rank 1 and both ranks hung)."""
    root = save_tiny_ltx_pipeline(tmp_path / "ltx", seed=0)
    _dynamic_shift(root)
    _assert_split_dit_matches_one_process(tmp_path, root, LTXVideoTransformer3DModel, **{mode: 2})


@pytest.mark.parametrize("policy", ["recompute", "offload"])
def test_memory_policies_train_like_keeping_every_activation(
    family_dir: tuple[str, Path], tmp_path: Path, policy: str
) -> None:
    """``memory.dit.policy`` on a family's DiT blocks (recompute, or offload to the spill file): the
    same losses, gradient norms and DiT parameters as keeping every activation, bit for bit
    (CogVideoX: its tiny DiT has two blocks); the tiny HunyuanVideo and LTX DiTs have one block a
    list, which the policies refuse by name (the released models have dozens)."""
    from mmpipe.config import StageMemoryConfig
    from mmpipe.errors import PlanError

    name, root = family_dir
    cls = FAMILIES[name][2]
    if name in ("hunyuan", "ltx"):  # their tiny DiTs have one block a list: nothing repeats to wrap
        with pytest.raises(PlanError, match="stage 'dit': recompute / offload need repeated blocks"):
            _run(tmp_path / policy, root, 1, None, memory={"dit": StageMemoryConfig(policy=policy)})
        return
    _run(tmp_path / "keep", root, 1, None)
    _run(tmp_path / policy, root, 1, None, memory={"dit": StageMemoryConfig(policy=policy)})
    ref, got = read_metrics(tmp_path / "keep"), read_metrics(tmp_path / policy)
    assert [r.get("loss") for r in got] == [r.get("loss") for r in ref]
    assert [r.get("grad_norm") for r in got] == [r.get("grad_norm") for r in ref]
    pr, pg = _dit_params(tmp_path / "keep", root, cls), _dit_params(tmp_path / policy, root, cls)
    assert all(torch.equal(pr[k], pg[k]) for k in pr)
