"""The frozen-output cache, the cosine learning rate and caption dropout of ``mmpipe train``."""

from __future__ import annotations

import math

import pytest
import torch

from mmpipe.config import ModelConfig, RunConfig, TrainConfig
from mmpipe.data.datasets import input_keys
from mmpipe.runtime.frozen_cache import FrozenOutputCache
from mmpipe.train.data import dropped_captions, sample_indices, without_caption
from mmpipe.train.loop import lr_factor


def test_cache_serves_a_micro_batch_only_when_every_row_is_kept() -> None:
    cache = FrozenOutputCache(max_bytes=10_000)
    out = {"latents": torch.arange(24.0).view(3, 2, 4)}
    cache.put("vae", ["a", "b", "c"], out)
    assert len(cache) == 3 and cache.bytes == 3 * 8 * 4
    got = cache.get("vae", ["c", "a"], torch.device("cpu"))
    assert got is not None and torch.equal(got["latents"], out["latents"][[2, 0]])
    assert cache.get("vae", ["a", "z"], torch.device("cpu")) is None  # one row missing: recompute all
    assert cache.get("text", ["a"], torch.device("cpu")) is None  # keyed per stage
    assert (cache.hits, cache.misses) == (2, 3)
    out["latents"].zero_()  # rows are copies, not views of the batch
    assert cache.get("vae", ["b"], torch.device("cpu"))["latents"].sum() > 0  # type: ignore[index]


def test_cache_stops_keeping_at_its_budget_and_skips_what_it_cannot_split() -> None:
    cache = FrozenOutputCache(max_bytes=2 * 16)
    cache.put("vae", [0, 1, 2], {"z": torch.ones(3, 4)})
    assert len(cache) == 2 and cache.bytes == 32
    cache.put("text", [0, 1], {"z": torch.ones(3, 4)})  # rows do not match the keys
    cache.put("text", [0], {"z": torch.ones(1, 1), "n": 3})  # a non-tensor output
    assert len(cache) == 2
    with pytest.raises(ValueError, match="positive byte budget"):
        FrozenOutputCache(0)


def test_frozen_prefix_is_the_frozen_stages_fed_by_the_data() -> None:
    from mmpipe.assemble.graphs import planning_graph
    from mmpipe.config import DataConfig

    graph, _ = planning_graph(ModelConfig(), DataConfig())
    assert sorted(graph.frozen_prefix()) == ["text", "vae"]
    u2g, _ = planning_graph(ModelConfig(name="u2g_tiny", kind="u2g"), DataConfig())
    assert all(u2g.stages[s].frozen for s in u2g.frozen_prefix())
    assert "dit" not in u2g.frozen_prefix()


def test_cosine_schedule_warms_up_then_decays_to_zero() -> None:
    f = [lr_factor(s, warmup=4, steps=104, schedule="cosine") for s in range(104)]
    assert f[:4] == [0.2, 0.4, 0.6, 0.8] and f[4] == 1.0
    assert f[54] == pytest.approx(0.5) and f[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 99 / 100)))
    assert all(a >= b for a, b in zip(f[4:], f[5:], strict=False))
    assert [lr_factor(s, warmup=4, steps=104, schedule="constant") for s in (3, 4, 103)] == [0.8, 1.0, 1.0]


def test_caption_dropout_is_seeded_by_step_and_roughly_its_fraction() -> None:
    a = dropped_captions(3, 8, 0.25, seed=0)
    assert a == dropped_captions(3, 8, 0.25, seed=0) and len(a) == 8
    assert dropped_captions(3, 8, 0.0, seed=0) == [False] * 8
    share = sum(sum(dropped_captions(s, 8, 0.1, seed=0)) for s in range(500)) / 4000
    assert 0.08 < share < 0.12
    assert without_caption({"caption": "a red circle moving left", "video": 1}) == {"caption": "", "video": 1}


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("caption_dropout", 1.0, "train.caption_dropout=1.0"),
        ("caption_dropout", -0.1, "train.caption_dropout=-0.1"),
        ("cache_frozen_gb", -1.0, "train.cache_frozen_gb=-1.0"),
        ("lr_schedule", "linear", "train.lr_schedule='linear'"),
    ],
)
def test_bad_train_options_name_the_key(key: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match.replace(".", r"\.").replace("(", r"\(")):
        TrainConfig(**{key: value})  # type: ignore[arg-type]


def test_auto_placement_discounts_the_cached_stages() -> None:
    from mmpipe.assemble.graphs import planning_graph
    from mmpipe.assemble.planning import frozen_compute_fraction

    cfg = RunConfig(train=TrainConfig(steps=400, batch_size=8, caption_dropout=0.1))
    graph, _ = planning_graph(cfg.model, cfg.data)
    frac = frozen_compute_fraction(graph, cfg)
    # the VAE's latents do not depend on the caption: each sample once; the text encoder's output
    # each sample's caption once and the empty caption once
    assert frac == {"text": pytest.approx(1025 / 3200), "vae": pytest.approx(1024 / 3200)}
    off = RunConfig(train=TrainConfig(cache_frozen_gb=0.0))
    assert frozen_compute_fraction(graph, off) == {}


def test_lanes_keep_each_sample_on_one_row_of_its_micro_batch_every_epoch() -> None:
    n, batch, lanes = 24, 8, 4  # micro-batches of 4 rows
    steps = [sample_indices(s, batch, n, seed=3, lanes=lanes) for s in range(3 * n // batch)]
    rows: dict[int, set[int]] = {}
    for indices in steps:
        for g, i in enumerate(indices):
            rows.setdefault(i, set()).add(g % lanes)
    assert sorted(rows) == list(range(n)) and all(len(r) == 1 for r in rows.values())  # one row each
    epochs = [sorted(sum(steps[e * 3 : e * 3 + 3], [])) for e in range(3)]
    assert all(e == list(range(n)) for e in epochs)  # every sample once an epoch
    assert sum(steps[0:3], []) != sum(steps[3:6], [])  # reshuffled each epoch
    # one lane: the whole set shuffled each epoch (torch.randperm seeded by seed and epoch)
    flat = sum((sample_indices(s, batch, n, seed=3) for s in range(6)), [])
    assert flat[:n] == torch.randperm(n, generator=torch.Generator().manual_seed(3 * 100_003)).tolist()
    assert sample_indices(0, 2, 1, seed=0, lanes=2) == [0, 0]  # a set smaller than the lanes
    with pytest.raises(ValueError, match="3 lanes do not divide a batch of 8"):
        sample_indices(0, 8, n, seed=0, lanes=3)


def test_input_keys_tie_the_video_to_the_sample_and_the_text_to_the_caption() -> None:
    ports = ["input_ids", "attention_mask", "video"]
    kept, dropped = input_keys(ports, "train", 5, False), input_keys(ports, "train", 5, True)
    assert kept["video"] == dropped["video"] == ("train", 5)  # the VAE's row does not depend on the caption
    assert kept["input_ids"] == ("train", 5) and dropped["input_ids"] == dropped["attention_mask"] == ""
    assert input_keys(ports, "train", 9, True)["input_ids"] == ""  # every empty caption is one key
    assert input_keys(["pixel_values"], "val", 1, False) == {"pixel_values": ("val", 1)}
