"""Device selection: what ``device``, ``launch.backend`` and ``train.precision`` resolve to, and the
configurations refused before any worker starts (CPU tests; the GPU paths run in tests/*_cuda.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from cli_here import mmpipe_here

from mmpipe.assemble.placement import check_shared_gpu_groups
from mmpipe.config import LaunchConfig, RunConfig, TrainConfig
from mmpipe.devices import (
    DeviceType,
    Precision,
    rank_device,
    resolve_backend,
    resolve_device,
    resolve_nproc,
    run_devices,
)
from mmpipe.errors import PlanError
from mmpipe.runtime.executor import check_pair_order
from mmpipe.sched.plan import Action, DeviceGroup, Plan

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_auto_is_cuda_exactly_when_a_gpu_is_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 0)
    assert resolve_device("auto") is DeviceType.CPU
    fake_gpus(monkeypatch, 1)
    assert resolve_device("auto") is DeviceType.CUDA
    assert resolve_device("cpu") is DeviceType.CPU


def test_cuda_without_a_gpu_names_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 0)
    with pytest.raises(ValueError, match=r"device=cuda, but this machine has no usable CUDA device"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match=r"serve.device='tpu': expected auto, cpu or cuda"):
        resolve_device("tpu", key="serve.device")


def test_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_backend(DeviceType.CPU, "auto", local_ranks=4).name == "gloo"
    with pytest.raises(ValueError, match=r"launch.backend=nccl needs device=cuda"):
        resolve_backend(DeviceType.CPU, "nccl", local_ranks=1)
    fake_gpus(monkeypatch, 2)
    nccl = resolve_backend(DeviceType.CUDA, "auto", local_ranks=2)
    assert nccl.name == "cpu:gloo,cuda:nccl" and nccl.nccl and not nccl.staged
    with pytest.raises(ValueError, match=r"launch.nproc=3 ranks on this node but 2 CUDA device\(s\)"):
        resolve_backend(DeviceType.CUDA, "auto", local_ranks=3)
    shared = resolve_backend(DeviceType.CUDA, "gloo", local_ranks=3)  # ranks share GPUs
    assert shared.name == "gloo" and shared.staged
    assert [rank_device(DeviceType.CUDA, r) for r in range(3)] == [torch.device("cuda", i) for i in (0, 1, 0)]


def test_precision_is_bf16_on_cuda_and_fp32_on_cpu_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 1)
    assert run_devices(RunConfig()).precision is Precision.BF16
    assert run_devices(RunConfig(train=TrainConfig(precision="fp32"))).precision is Precision.FP32
    assert run_devices(RunConfig(device="cpu")).precision is Precision.FP32
    assert run_devices(RunConfig(device="cpu", train=TrainConfig(precision="bf16"))).precision is Precision.BF16
    staged = run_devices(RunConfig(launch=LaunchConfig(nproc=2, backend="gloo")))
    assert staged.wire() == torch.device("cpu")  # edge tensors through the host
    assert run_devices(RunConfig(device="cpu")).wire() is None


def test_shared_gpu_ranks_refuse_data_and_sequence_parallel_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 1)
    staged = RunConfig(launch=LaunchConfig(nproc=2, backend="gloo"))
    fsdp = {"text": DeviceGroup((0,)), "dit": DeviceGroup((0, 1), 2)}
    check_shared_gpu_groups(staged, {"text": DeviceGroup((0,)), "dit": DeviceGroup((1,))})  # pipelined: fine
    with pytest.raises(PlanError, match=r"placement.dit: 2 ranks .* need launch.backend=nccl"):
        check_shared_gpu_groups(staged, fsdp)
    check_shared_gpu_groups(RunConfig(device="cpu", launch=LaunchConfig(nproc=2, backend="gloo")), fsdp)


def _plan(rank0: str, rank1: str) -> Plan:
    placement = (("a", DeviceGroup((0,))), ("b", DeviceGroup((1,))))
    actions = tuple(tuple(Action.parse(x) for x in acts.split()) for acts in (rank0, rank1))
    return Plan(world_size=2, placement=placement, micro_batches=2, actions=actions)


def test_nccl_pair_order_check() -> None:
    check_pair_order(_plan("a->b:SEND:mb0@r1 a->b:SEND:mb1@r1", "a->b:RECV:mb0@r0 a->b:RECV:mb1@r0"))
    with pytest.raises(PlanError, match=r"rank 1 receives rank 0's messages in another order"):
        check_pair_order(_plan("a->b:SEND:mb0@r1 a->b:SEND:mb1@r1", "a->b:RECV:mb1@r0 a->b:RECV:mb0@r0"))


@no_cuda
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "device=cuda"], "device=cuda, but this machine has no usable CUDA device"),
        (["train", "launch.backend=nccl"], "launch.backend=nccl needs device=cuda"),
        (["train", "device=gpu"], "device='gpu'"),
        (["train", "train.precision=fp16"], "train.precision='fp16'"),
    ],
)
def test_device_errors_leave_nothing_behind(
    tmp_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = mmpipe_here(*args, f"run_dir={tmp_path / 'run'}", cwd=tmp_path, capsys=capsys)
    assert code == 2, err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("backend", "bound"), [("gloo", False), ("cpu:gloo,cuda:nccl", True)])
def test_only_nccl_groups_are_bound_to_the_gpu(monkeypatch: pytest.MonkeyPatch, backend: str, bound: bool) -> None:
    """A GPU-bound default group makes new_group split it, which gloo cannot (the shared-GPU run on
    the H200 failed so at its first new_group)."""
    import torch.distributed as dist

    from mmpipe.runtime import mesh

    seen: dict[str, object] = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(backend=backend, **kw))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")  # recorded, so that the test's setting is undone
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    assert mesh.init_distributed(30.0, backend, torch.device("cuda", 0)) == (0, 2)
    assert seen["backend"] == backend
    assert (seen["device_id"] == torch.device("cuda", 0)) is bound
    assert (os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "1") is bound


def test_nproc_zero_is_one_rank_per_gpu_or_core(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = RunConfig(launch=LaunchConfig(nproc=0), device="cpu")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert resolve_nproc(cfg).launch.nproc == 3
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert resolve_nproc(RunConfig(launch=LaunchConfig(nproc=0), device="auto")).launch.nproc == 8
    assert resolve_nproc(RunConfig(launch=LaunchConfig(nproc=2))).launch.nproc == 2  # an explicit count stays
    with pytest.raises(ValueError, match=r"launch.nproc=-1: expected 0 \(one rank per GPU or core\)"):
        LaunchConfig(nproc=-1)
