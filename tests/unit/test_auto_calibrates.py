"""``placement=auto`` on a machine with no calibration for the model calibrates first (once, cached in
``$MMPIPE_CACHE``), before the run directory is written; bad input still fails before any of it.

The calibration itself (``mmpipe profile``'s runs in a child process) is replaced here by a spy that
writes a calibration and counts its calls; ``tests/e2e/test_auto_calibrates_for_real.py`` runs the real one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from mmpipe.config import DataConfig, LaunchConfig, ModelConfig, RunConfig, TrainConfig
from mmpipe.errors import WorkerFailure
from mmpipe.sched.calibration import Calibration
from mmpipe.sched.cluster import Cluster
from mmpipe.train import prepare
from mmpipe.train.profile import merged, save_atomic

U2G = ModelConfig(name="u2g_tiny", kind="u2g", text_encoder="qwen2")
T2V_STAGES = ("text", "vae", "dit")
U2G_STAGES = ("vision", "llm", "connector", "vae", "dit")


def auto_config(run_dir: Path, model: ModelConfig | None = None) -> RunConfig:
    return RunConfig(
        run_dir=str(run_dir),
        model=model or ModelConfig(),
        data=DataConfig(frames=9, height=32, width=32, val_samples=4),
        train=TrainConfig(steps=2, batch_size=4, micro_batches=2, progress=False),
        launch=LaunchConfig(nproc=2),
        placement="auto",
    )


def calibration(stages: tuple[str, ...], latency: float | None = 1e-4) -> Calibration:
    entry = {"forward": 0.2, "backward": 0.2, "forward_overhead_s": 1e-3, "backward_overhead_s": 1e-3}
    return Calibration("cpu", Cluster.local(1).peak_flops, {s: dict(entry) for s in stages}, 0.01, latency, 1e9)


class Spy:
    """Stands in for ``prepare.run_calibration``: merges a calibration of ``stages`` into the file and
    counts its calls."""

    def __init__(self, stages: tuple[str, ...] = T2V_STAGES, fail: bool = False) -> None:
        self.stages, self.fail, self.calls = stages, fail, 0

    def __call__(self, model: ModelConfig, data: DataConfig, path: Path) -> None:
        self.calls += 1
        if self.fail:
            raise WorkerFailure("placement=auto: calibrating 't2v_tiny' on this machine failed (exit code 1)")
        cal = calibration(self.stages)
        save_atomic(merged(Calibration.load(path), cal) if path.is_file() else cal, path)  # as calibrate_into does


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MMPIPE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "calibration-cpu.json"


def test_auto_calibrates_once_then_plans_from_the_cached_file(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    spy = Spy()
    monkeypatch.setattr(prepare, "run_calibration", spy)
    run_dir, _, cfg = prepare.prepare_run(auto_config(tmp_path / "a"))
    assert spy.calls == 1 and cache.is_file()
    line = f"placement=auto: no calibration for t2v_tiny on this machine; calibrating (mmpipe profile) -> {cache}"
    assert capsys.readouterr().out.splitlines() == [line]
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())["placement"]
    assert isinstance(cfg.placement, dict) and saved == cfg.placement and set(saved) == set(T2V_STAGES)

    prepare.prepare_run(auto_config(tmp_path / "b"))  # the next run reuses the cached calibration
    assert spy.calls == 1 and "calibrating" not in capsys.readouterr().out


def test_a_calibration_without_the_models_stages_is_made_for_it(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calibration(T2V_STAGES).save(cache)  # `mmpipe profile` of the default model only
    spy = Spy(U2G_STAGES)
    monkeypatch.setattr(prepare, "run_calibration", spy)
    prepare.prepare_run(auto_config(tmp_path / "u2g", U2G))
    assert spy.calls == 1
    prepare.prepare_run(auto_config(tmp_path / "t2v"))  # still covered
    assert spy.calls == 1


def test_a_failed_calibration_leaves_no_run_directory_and_no_file(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prepare, "run_calibration", Spy(fail=True))
    with pytest.raises(WorkerFailure, match="calibrating 't2v_tiny'"):
        prepare.prepare_run(auto_config(tmp_path / "run"))
    assert not (tmp_path / "run").exists() and not cache.exists()


def test_a_file_that_is_no_calibration_fails_before_calibrating(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache.parent.mkdir(parents=True)
    cache.write_text("{not json")
    spy = Spy()
    monkeypatch.setattr(prepare, "run_calibration", spy)
    with pytest.raises(ValueError, match="is not a calibration file written by `mmpipe profile`"):
        prepare.prepare_run(auto_config(tmp_path / "run"))
    assert spy.calls == 0 and not (tmp_path / "run").exists()
    assert cache.read_text() == "{not json"  # the user's file is never overwritten


def test_a_placement_given_in_full_never_calibrates(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = Spy()
    monkeypatch.setattr(prepare, "run_calibration", spy)
    cfg = auto_config(tmp_path / "run")
    cfg.placement = {"text": [0], "vae": [0], "dit": [1]}
    prepare.prepare_run(cfg)
    assert spy.calls == 0 and not cache.exists()


@pytest.mark.parametrize(("given", "expected"), [(0, 1), (2, 2)])
def test_auto_micro_batches_are_the_planners(tmp_path: Path, cache: Path, given: int, expected: int) -> None:
    """``train.micro_batches=0`` with ``placement=auto``: the planner's count, which on a calibration
    where every call has a large fixed cost is one micro-batch a step; a given count is kept."""
    cal = calibration(T2V_STAGES)
    for entry in cal.stages.values():
        entry["forward_overhead_s"] = entry["backward_overhead_s"] = 0.5
    cal.save(cache)
    cfg = auto_config(tmp_path / "run")
    cfg.train = dataclasses.replace(cfg.train, micro_batches=given)
    run_dir, _, resolved = prepare.prepare_run(cfg)
    assert resolved.train.micro_batches == expected
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["micro_batches"] == expected
    assert f"micro_batches {expected}" in (run_dir / "plan.txt").read_text().splitlines()


def test_merging_keeps_what_was_measured_and_adds_the_new_stages() -> None:
    old = calibration(T2V_STAGES, latency=None)
    new = Calibration("cpu", old.peak_flops, {s: {"forward": 0.5} for s in U2G_STAGES}, 0.5, 2e-4, 5e8)
    out = merged(old, new)
    assert set(out.stages) == set(T2V_STAGES) | set(U2G_STAGES)
    assert out.stages["dit"] == old.stages["dit"] and out.stages["llm"] == {"forward": 0.5}
    assert out.step_overhead_s == old.step_overhead_s and out.bandwidth == old.bandwidth
    assert out.latency_s == 2e-4  # what the old file lacked


def test_profile_fits_a_line_and_calls_flat_or_shrinking_times_fixed_cost() -> None:
    from mmpipe.train.profile import PER_SAMPLE_FLOOR, fit_action

    assert fit_action(0.03, 0.05, 1, 2) == pytest.approx((0.02, 0.01))  # 20 ms a sample + 10 ms fixed
    # noise made 2 samples no slower than 1 (a fixed-cost VAE): the floor per sample, the rest fixed
    # (it was all per sample, so data parallelism over such a stage looked twice as fast)
    per_sample, fixed = fit_action(0.110, 0.105, 1, 2)
    assert per_sample == pytest.approx(PER_SAMPLE_FLOOR * 0.105 / 2) and fixed == pytest.approx(0.105 * 0.95)
    assert fit_action(0.100, 0.1001, 1, 2)[1] == pytest.approx(0.1001 * 0.95)  # growth within the floor


def test_the_sharded_step_overhead_is_a_median_step_not_a_mean() -> None:
    # Two-rank FSDP run, rank 0's DiT: 2 micro-batches of 10 ms forwards and 20 ms backwards, a 15 ms
    # optimizer step; in one step the first forward also waited 300 ms for the other rank (a gather
    # behind a late peer). The single-rank run: 8 / 16 ms actions, a 5 ms step; the cost model prices
    # 4 ms of collectives itself. Extra per step: 15 - 5 - 4 = 6 ms, whatever one late step waited.
    from mmpipe.train.profile import sharded_extra

    events = []
    for step in (3, 4, 5, 6, 7):
        wait = 0.3 if step == 5 else 0.0
        t = 0.0
        for kind, seconds in (("F", 0.01 + wait), ("F", 0.01), ("B", 0.02), ("B", 0.02), ("STEP", 0.015)):
            events.append({"stage": "dit", "rank": 0, "kind": kind, "step": step, "start": t, "end": t + seconds})
            t += seconds
        events.append(
            {"stage": "dit", "rank": 1, "kind": "F", "step": step, "start": 0.0, "end": 0.5}
        )  # rank 1: not read
    single = {("dit", "F"): 0.008, ("dit", "B"): 0.016, ("dit", "STEP"): 0.005}
    got = sharded_extra(events, "dit", single, 2, 0.004)
    assert got == pytest.approx(
        {"sharded_forward_overhead_s": 0.002, "sharded_backward_overhead_s": 0.004, "sharded_step_overhead_s": 0.006}
    )
    assert sharded_extra(events, "vae", single, 2, 0.0) is None  # not in the single-rank run
