"""Training Wan 2.1 image-to-video (``WanImageToVideoPipeline`` directories, ``model.path=DIR``)
through ``mmpipe train``, each clip conditioning on its own first frame.

The CLIP and VAE stages give exactly what the pipeline gives for the same first frame
(``encode_image``, ``prepare_latents``' condition); a pure pipeline split (encoders on rank 0, the
DiT on rank 1) trains bitwise like the single-process run (threads pinned to 1 per rank, as in
``test_parity``); the trained run generates from an image; the layouts training does not cover are
refused before any worker starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
from diffusers.image_processor import VaeImageProcessor

from mmpipe.config import DataConfig, GenerateConfig, LaunchConfig, ModelConfig, RunConfig, TrainConfig
from mmpipe.models import build_training_graph, check_training_pipeline_dir, training_stages
from mmpipe.models.wan_i2v import I2V_TEXT_LEN, save_tiny_wan_i2v_pipeline
from mmpipe.rundir import read_metrics
from mmpipe.runtime.checkpoint import load_latest_weights
from mmpipe.runtime.events import read_events
from mmpipe.stages.multimodal import ImageProcessing
from mmpipe.train import train
from mmpipe.train.data import Collator

STEPS = 3
PROMPTS = ["a red circle moving left", "a blue square moving up"]


@pytest.fixture(scope="module")
def i2v_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_wan_i2v_pipeline(tmp_path_factory.mktemp("wan_i2v") / "pipeline", variant="wan21")


def _model(root: Path) -> ModelConfig:
    return ModelConfig(path=str(root), text_len=I2V_TEXT_LEN)


def _clips(n: int, size: tuple[int, int] = (32, 32)) -> torch.Tensor:
    return torch.rand((n, 3, 9, *size), generator=torch.Generator().manual_seed(0)) * 2 - 1


def _pil(frame_B3HW: torch.Tensor) -> list[Any]:
    """The first frames as the 8-bit images the pipeline is given (diffusers' own conversion)."""
    return VaeImageProcessor.numpy_to_pil(VaeImageProcessor.pt_to_numpy(VaeImageProcessor.denormalize(frame_B3HW)))


def test_clip_and_condition_are_the_pipelines(i2v_dir: Path) -> None:
    """``clip.image_embeds`` is ``encode_image`` of the first frames (as 8-bit images) and
    ``vae.condition`` is ``prepare_latents``' condition for them, ``vae.latents`` the clips'."""
    graph = build_training_graph(_model(i2v_dir), i2v_dir)
    assert tuple(graph.stages) == training_stages(_model(i2v_dir)) == ("text", "clip", "vae", "dit")
    batch = Collator(graph, i2v_dir, I2V_TEXT_LEN)([{"caption": c, "video": v} for c, v in zip(PROMPTS, _clips(2))])
    pipe: Any = WanImageToVideoPipeline.from_pretrained(i2v_dir)
    clip, vae = graph.stages["clip"], graph.stages["vae"]
    video = batch["video"]
    with torch.no_grad():
        embeds = clip.forward(clip.module, batch)["image_embeds"]
        out = vae.forward(vae.module, batch)
        want_embeds = pipe.encode_image(_pil(video[:, :, 0]), torch.device("cpu"))
        # prepare_latents repeats one image's condition batch_size times: one frame at a time
        want_condition = torch.cat(
            [pipe.prepare_latents(f[None], 1, 16, 32, 32, 9, torch.float32, "cpu", None)[1] for f in video[:, :, 0]]
        )
        want_latents = pipe.vae.encode(video).latent_dist.mode()
    assert torch.equal(embeds, want_embeds)
    assert out["condition"].shape == want_condition.shape == (2, 20, 3, 4, 4)
    assert torch.equal(out["condition"][:, :4], want_condition[:, :4])  # the mask
    # two separately loaded copies of the VAE (see test_family_training)
    torch.testing.assert_close(out["condition"], want_condition, rtol=0, atol=1e-6)
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1, 1)
    torch.testing.assert_close(out["latents"], (want_latents - mean) * inv_std, rtol=0, atol=1e-6)


@pytest.mark.parametrize("size", [(32, 32), (48, 80), (64, 40)], ids=["as-is", "down-wide", "down-tall"])
def test_image_processing_is_the_processors(i2v_dir: Path, size: tuple[int, int]) -> None:
    """The tensor steps equal the pipeline's ``image_processor`` on the 8-bit frame, bitwise: the
    resize is Pillow's fixed-point bicubic, the crop, rescale and normalisation its dtypes."""
    pipe: Any = WanImageToVideoPipeline.from_pretrained(i2v_dir)
    frames = _clips(3, size)[:, :, 0]
    steps = ImageProcessing.from_processor(pipe.image_processor)
    image = ((frames / 2 + 0.5).clamp(0, 1) * 255).round()
    want = pipe.image_processor(images=_pil(frames), return_tensors="pt")["pixel_values"]
    got = steps(image)
    assert got.dtype == want.dtype and torch.equal(got, want)


def _run(
    run_dir: Path,
    root: Path,
    nproc: int,
    placement: dict | None,
    parallel: dict[str, Any] | None = None,
    *,
    text_len: int = I2V_TEXT_LEN,
) -> None:
    train(
        RunConfig(
            run_dir=str(run_dir),
            model=ModelConfig(path=str(root), text_len=text_len),
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
        )
    )


def _dit_params(
    run_dir: Path, root: Path, stage: str = "dit", component: str = "transformer"
) -> dict[str, torch.Tensor]:
    model = WanTransformer3DModel.from_pretrained(root / component)
    load_latest_weights(run_dir, {stage: model})
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_pipeline_split_trains_bitwise_like_one_process_and_generates(i2v_dir: Path, tmp_path: Path) -> None:
    """Text, CLIP and VAE on rank 0, the DiT on rank 1, against one process: the same losses,
    gradient norms and DiT parameters, bit for bit; the DiT trained; the trained run generates
    from an image (``load_trained_graph``, and ``mmpipe generate ckpt=RUN image=FILE``)."""
    _run(tmp_path / "ref", i2v_dir, 1, None)
    _run(tmp_path / "pp", i2v_dir, 2, {"text": [0], "clip": [0], "vae": [0], "dit": [1]})
    ref, got = read_metrics(tmp_path / "ref"), read_metrics(tmp_path / "pp")
    assert len(ref) == len(got) and any("loss" in r for r in ref)
    assert [r.get("loss") for r in got] == [r.get("loss") for r in ref]
    assert [r.get("grad_norm") for r in got] == [r.get("grad_norm") for r in ref]
    assert got[-1]["val_loss"] == ref[-1]["val_loss"]
    assert all(r["grad_norm"] > 0 for r in ref if "grad_norm" in r)
    pr, pg = _dit_params(tmp_path / "ref", i2v_dir), _dit_params(tmp_path / "pp", i2v_dir)
    assert pr.keys() == pg.keys()
    assert all(torch.equal(pr[k], pg[k]) for k in pr), [k for k in pr if not torch.equal(pr[k], pg[k])]
    initial = WanTransformer3DModel.from_pretrained(i2v_dir / "transformer").state_dict()
    assert any(not torch.equal(initial[k], pr[k]) for k in initial)  # the DiT trained
    # the image path trained too: CLIP's projection into the blocks' added key / value
    assert not torch.equal(initial["blocks.0.attn2.add_k_proj.weight"], pr["blocks.0.attn2.add_k_proj.weight"])
    sends = [e for e in read_events(tmp_path / "pp") if e["kind"] == "SEND" and e["phase"] == "train"]
    assert len(sends) == STEPS * 2 * 3 and all(e["rank"] == 0 for e in sends)  # text, clip, vae; each micro-batch

    from mmpipe.generate import generate
    from mmpipe.models.pipeline_graph import PipelineGraph
    from mmpipe.models.wan_i2v import WanI2VFamily
    from mmpipe.runtime.trained import check_trained_run, load_trained_graph

    check_trained_run(tmp_path / "pp")
    graph: Any = load_trained_graph(tmp_path / "pp")
    assert isinstance(graph, PipelineGraph) and isinstance(graph.family, WanI2VFamily)
    assert all(torch.equal(v, pg[k]) for k, v in graph.denoise.module["transformer"].state_dict().items())
    image = _pil(_clips(1)[:, :, 0])[0]
    kw = dict(height=32, width=32, num_frames=9, num_inference_steps=2, seed=0, output_type="np", progress=False)
    video = graph.generate(image=image, prompt="a red circle moving left", **kw)
    assert video.shape == (1, 9, 32, 32, 3)
    image.save(tmp_path / "first.png")
    cfg = GenerateConfig(
        ckpt=str(tmp_path / "pp"), image=str(tmp_path / "first.png"), steps=2, out=str(tmp_path / "samples")
    )
    written = generate(cfg)
    assert written["gif"].is_file()
    with pytest.raises(ValueError, match="give its first frame, image=FILE"):
        generate(GenerateConfig(ckpt=str(tmp_path / "pp"), steps=2))


def test_a_clip_transformer_without_its_image_encoder_is_refused(i2v_dir: Path, tmp_path: Path) -> None:
    import json
    import shutil

    root = Path(shutil.copytree(i2v_dir, tmp_path / "no_clip"))
    index = json.loads((root / "model_index.json").read_text())
    index["image_encoder"] = [None, None]
    (root / "model_index.json").write_text(json.dumps(index))
    message = r"image_dim=16\) but model_index.json names no image_encoder"
    with pytest.raises(ValueError, match=message):
        check_training_pipeline_dir(root)
    with pytest.raises(ValueError, match="model.path=.*" + message):
        _run(tmp_path / "run", root, 2, None)
    assert not (tmp_path / "run").exists()


def test_text_len_other_than_512_is_refused(i2v_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model.text_len=16: .*set model.text_len=512"):
        train(RunConfig(run_dir=str(tmp_path / "run"), model=ModelConfig(path=str(i2v_dir), text_len=16)))
    assert not (tmp_path / "run").exists()


def test_dit_split_by_ulysses_splits_the_condition_with_the_latents(i2v_dir: Path, tmp_path: Path) -> None:
    """The DiT Ulysses-split over two ranks, each receiving its frames of both the latents and the
    condition, matches the 1-process run within the reassociation tolerance of the sequence-parallel
    tests (a condition not split with the latents fails to run: the channel concatenation needs
    the same frames)."""
    dit = build_training_graph(_model(i2v_dir), i2v_dir).stages["dit"]
    assert dict(dit.sequence_inputs) == {"latents": 2, "condition": 2}
    _assert_ulysses_matches_one_process(tmp_path, i2v_dir, I2V_TEXT_LEN)


def _assert_ulysses_matches_one_process(tmp_path: Path, root: Path, text_len: int) -> None:
    """The encoders on rank 0, the DiT Ulysses-split over ranks 0 and 1, against one process: losses
    and gradient norms within rel 1e-5, the DiT's parameters within 5e-5, the tolerance of the
    sequence-parallel runtime tests (tests/dist/test_sequence_parallel_runtime.py): AdamW scales a
    near-zero gradient element's reassociation difference up to a step's size (at 1e-5, one element
    of 1024 landed 1.14e-5 off after the frozen encode's norms changed by float32 rounding)."""
    from mmpipe.config import StageParallelConfig

    _run(tmp_path / "ref", root, 1, None, text_len=text_len)
    stages = training_stages(ModelConfig(path=str(root), text_len=text_len))
    placement = {s: [0, 1] if s == "dit" else [0] for s in stages}
    _run(tmp_path / "sp", root, 2, placement, {"dit": StageParallelConfig(ulysses=2)}, text_len=text_len)
    ref, got = read_metrics(tmp_path / "ref"), read_metrics(tmp_path / "sp")
    assert len(got) == len(ref)
    for r, g in zip(ref[1:], got[1:], strict=True):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-5)
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
    pr, pg = _dit_params(tmp_path / "ref", root), _dit_params(tmp_path / "sp", root)
    for k in pr:
        torch.testing.assert_close(pg[k], pr[k], rtol=1e-5, atol=5e-5, msg=k)


# ---- FLF2V (first and last frames), Wan 2.2 I2V (two experts, no CLIP), TI2V (expand_timesteps) -----


@pytest.fixture(scope="module", params=["flf2v", "wan22", "ti2v"])
def variant_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    root = save_tiny_wan_i2v_pipeline(tmp_path_factory.mktemp(request.param) / "pipeline", variant=request.param)
    return request.param, root


@pytest.fixture(scope="module")
def ti2v_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_wan_i2v_pipeline(tmp_path_factory.mktemp("ti2v") / "pipeline", variant="ti2v")


WAN22_TEXT_LEN = 16  # no CLIP tokens share the context: any length


def _wan22_model(root: Path) -> ModelConfig:
    return ModelConfig(path=str(root), text_len=WAN22_TEXT_LEN)


def test_flf2v_clip_and_condition_are_the_pipelines(tmp_path: Path) -> None:
    """FLF2V: ``clip.image_embeds`` is ``encode_image([first, last])`` of each clip's frames (its
    two rows side by side on the token axis) and ``vae.condition`` is ``prepare_latents``'
    condition with ``last_image``, its mask bitwise."""
    root = save_tiny_wan_i2v_pipeline(tmp_path / "flf2v", variant="flf2v")
    graph = build_training_graph(_model(root), root)
    assert tuple(graph.stages) == ("text", "clip", "vae", "dit")
    batch = Collator(graph, root, I2V_TEXT_LEN)(
        [{"caption": c, "video": v} for c, v in zip(PROMPTS, _clips(2), strict=True)]
    )
    pipe: Any = WanImageToVideoPipeline.from_pretrained(root)
    clip, vae = graph.stages["clip"], graph.stages["vae"]
    video = batch["video"]
    with torch.no_grad():
        embeds = clip.forward(clip.module, batch)["image_embeds"]
        condition = vae.forward(vae.module, batch)["condition"]
        for i in range(len(PROMPTS)):
            first, last = _pil(video[i : i + 1, :, 0])[0], _pil(video[i : i + 1, :, -1])[0]
            want = pipe.encode_image([first, last], torch.device("cpu"))  # (2, N, D): as __call__ takes it
            torch.testing.assert_close(embeds[i], want.flatten(0, 1), rtol=0, atol=1e-6)
            f, l = video[i : i + 1, :, 0], video[i : i + 1, :, -1]
            want_condition = pipe.prepare_latents(f, 1, 16, 32, 32, 9, torch.float32, "cpu", None, None, l)[1]
            assert torch.equal(condition[i : i + 1, :4], want_condition[:, :4])  # the mask: frame 0 and the last
            torch.testing.assert_close(condition[i : i + 1], want_condition, rtol=0, atol=1e-6)
    # the mask's last latent frame: ones on its last channel only (where pixel frame 8 of 9 falls)
    assert torch.equal(condition[:, :4, -1, 0, 0], torch.tensor([[0.0, 0.0, 0.0, 1.0]] * 2))


def test_i2v_variants_train_bitwise_split_and_generate(variant_dir: tuple[str, Path], tmp_path: Path) -> None:
    """FLF2V (CLIP of the first and last frames), Wan 2.2 I2V (``dit`` / ``dit_2``, the condition
    concatenated, no CLIP) and TI2V (one DiT, the clean first frame) split encoders | DiT(s) over two
    ranks train bitwise like one process (losses, every stage's gradient norm, every expert's
    parameters); the trained run generates from its frame(s) with every expert's trained weights."""
    variant, root = variant_dir
    text_len = I2V_TEXT_LEN if variant == "flf2v" else WAN22_TEXT_LEN
    stages = training_stages(ModelConfig(path=str(root), text_len=text_len))
    two = "dit_2" in stages
    assert (
        stages
        == {
            "flf2v": ("text", "clip", "vae", "dit"),
            "wan22": ("text", "vae", "dit", "dit_2"),
            "ti2v": ("text", "vae", "dit"),
        }[variant]
    )
    _run(tmp_path / "ref", root, 1, None, text_len=text_len)
    split = {s: [0] if s in ("text", "clip", "vae") else [1] for s in stages}
    _run(tmp_path / "pp", root, 2, split, text_len=text_len)
    ref, got = read_metrics(tmp_path / "ref"), read_metrics(tmp_path / "pp")
    assert len(ref) == len(got) and any("loss" in r for r in ref)
    # the loss, the gradient norm of each trained stage (grad_norm/dit, grad_norm/dit_2 with two experts)
    keys = {k for r in ref for k in r if k == "loss" or k == "val_loss" or k.startswith("grad_norm")}
    assert {"loss", "val_loss"} < keys and len(keys) == (4 if two else 3), keys
    for key in keys:
        assert [r.get(key) for r in got] == [r.get(key) for r in ref], key
    trained = {}
    for stage, component in (("dit", "transformer"), *((("dit_2", "transformer_2"),) if two else ())):
        ref_w, pp_w = (_dit_params(run_dir, root, stage, component) for run_dir in (tmp_path / "ref", tmp_path / "pp"))
        initial = WanTransformer3DModel.from_pretrained(root / component).state_dict()
        assert all(torch.equal(ref_w[k], pp_w[k]) for k in initial), stage
        assert any(not torch.equal(initial[k], ref_w[k]) for k in initial), f"{stage} did not train"
        trained[component] = pp_w

    from mmpipe.runtime.trained import load_trained_graph

    graph: Any = load_trained_graph(tmp_path / "pp")  # every expert holds its stage's trained weights
    for component, weights in trained.items():
        assert all(torch.equal(v, weights[k]) for k, v in graph.denoise.module[component].state_dict().items())
    frames = _pil(torch.cat([_clips(1)[:, :, 0], _clips(1)[:, :, -1]]))
    images = {"image": frames[0]} | ({"last_image": frames[1]} if variant == "flf2v" else {})
    kw = dict(height=32, width=32, num_frames=9, num_inference_steps=2, seed=0, output_type="np", progress=False)
    assert graph.generate(prompt="a red circle moving left", **images, **kw).shape == (1, 9, 32, 32, 3)
    if variant == "flf2v":  # mmpipe generate takes both frames, and refuses the run without the last
        from mmpipe.generate import generate

        frames[0].save(tmp_path / "first.png")
        frames[1].save(tmp_path / "last.png")
        files = {"ckpt": str(tmp_path / "pp"), "steps": 2, "out": str(tmp_path / "samples")}
        written = generate(
            GenerateConfig(image=str(tmp_path / "first.png"), last_image=str(tmp_path / "last.png"), **files)
        )
        assert written["gif"].is_file()
        with pytest.raises(ValueError, match="trained Wan FLF2V: give its last frame too, last_image=FILE"):
            generate(GenerateConfig(image=str(tmp_path / "first.png"), **files))


def test_ti2v_objective_keeps_the_first_frame_clean(ti2v_dir: Path) -> None:
    """TI2V's DiT sees the clip's first latent frame clean with its tokens at timestep 0, the
    others noised at the drawn timestep (one timestep per token, as the pipeline passes them), and
    the loss is the mean over the noised frames only."""
    from mmpipe.stages.dit import sample_flow_matching

    dit = build_training_graph(_wan22_model(ti2v_dir), ti2v_dir).stages["dit"]
    assert set(dit.inputs) == {"latents", "context"}  # no condition port: the latents carry the image
    x0 = torch.randn((2, 16, 3, 4, 4), generator=torch.Generator().manual_seed(1))
    context = torch.randn((2, WAN22_TEXT_LEN, 32), generator=torch.Generator().manual_seed(2))
    seen: dict[str, torch.Tensor] = {}

    def spy(module: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        seen.update(hidden=kwargs["hidden_states"], timestep=kwargs["timestep"], pred=out[0])

    handle = dit.module.register_forward_hook(spy, with_kwargs=True)
    try:
        loss = dit.forward(dit.module, {"latents": x0, "context": context}, seed=5)["loss"]
    finally:
        handle.remove()
    noise, sigma = sample_flow_matching(x0, seed=5, shift=dit.shift)
    s = sigma.view(-1, 1, 1, 1, 1)
    assert torch.equal(seen["hidden"][:, :, 0], x0[:, :, 0])  # the image's frame, clean
    assert torch.equal(seen["hidden"][:, :, 1:], ((1 - s) * x0 + s * noise)[:, :, 1:])
    per_frame = 2 * 2  # 4 x 4 latents in 2 x 2 patches
    assert seen["timestep"].shape == (2, 3 * per_frame)
    assert torch.equal(seen["timestep"][:, :per_frame], torch.zeros(2, per_frame))
    assert torch.equal(seen["timestep"][:, per_frame:], (sigma * 1000)[:, None].expand(2, 2 * per_frame))
    want = (seen["pred"] - (noise - x0)).square()[:, :, 1:].mean()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="at least 2 latent frames, got 1"):
        dit.forward(dit.module, {"latents": x0[:, :, :1], "context": context})


def test_ti2v_ulysses_split_matches_one_process(ti2v_dir: Path, tmp_path: Path) -> None:
    """The TI2V DiT Ulysses-split over two ranks (3 latent frames: the image's frame and one more on
    rank 0, one on rank 1), each rank's per-token timesteps its own tokens', the first frame out of
    rank 0's share of the loss: the 1-process run's losses, gradient norms and parameters within the
    reassociation tolerance of the sequence-parallel tests."""
    _assert_ulysses_matches_one_process(tmp_path, ti2v_dir, WAN22_TEXT_LEN)
