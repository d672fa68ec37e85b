"""The executor alone on a fan-out graph: every parameter's gradient against single-process autograd.

``enc`` (trainable) feeds two trainable heads ``a`` and ``b``, each ending in its own loss, so the
gradient of ``enc``'s output is the sum of two contributions that arrive from other ranks.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mmpipe.graph import Graph, Stage, TensorSpec
from mmpipe.runtime import procs
from mmpipe.runtime.executor import Executor
from mmpipe.runtime.launch import free_port
from mmpipe.runtime.mesh import MeshOwner
from mmpipe.sched.plan import ActionKind
from mmpipe.sched.results import parse_placement
from mmpipe.sched.schedule import build_plan

MICRO, ROWS = 2, 4


class Mlp(Stage):
    kind = "mlp"

    def __init__(self, name: str, d_in: int, d_out: int, *, loss: bool) -> None:
        super().__init__(name, frozen=False)
        self.d_in, self.d_out, self.loss = d_in, d_out, loss

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        return {"x": TensorSpec(("B", self.d_in), torch.float32)}

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        return (
            {"loss": TensorSpec((), torch.float32)}
            if self.loss
            else {"y": TensorSpec(("B", self.d_out), torch.float32)}
        )

    def build(self) -> nn.Module:
        torch.manual_seed(sum(map(ord, self.name)))
        return nn.Sequential(nn.Linear(self.d_in, self.d_out), nn.Tanh(), nn.Linear(self.d_out, self.d_out))

    def forward(self, module: nn.Module, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        y = module(inputs["x"])
        return {"loss": y.square().mean()} if self.loss else {"y": y}


def fanout_graph() -> Graph:
    g = Graph("fanout")
    g.add_input("x", TensorSpec(("B", 4), torch.float32))
    g.add_stage(Mlp("enc", 4, 8, loss=False))
    g.add_stage(Mlp("a", 8, 3, loss=True))
    g.add_stage(Mlp("b", 8, 5, loss=True))
    g.connect("input.x", "enc.x")
    g.connect("enc.y", "a.x")
    g.connect("enc.y", "b.x")
    return g


def micro_batch(mb: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(ROWS, 4, generator=torch.Generator().manual_seed(100 + mb))}


def reference_grads() -> dict[str, torch.Tensor]:
    g = fanout_graph()
    for m in range(MICRO):
        out = g.run(micro_batch(m))
        ((out["a"]["loss"] + out["b"]["loss"]) / MICRO).backward()
    return {f"{s}.{k}": p.grad.clone() for s, st in g.stages.items() for k, p in st.module.named_parameters()}


def _worker(rank: int, world: int, port: int, placement: dict, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    graph = fanout_graph()
    plan = build_plan(graph, parse_placement(placement), MICRO, world_size=world)
    executor = Executor(graph, plan, MeshOwner(plan, rank, world), batch_size=ROWS)
    actions = tuple(a for a in plan.actions[rank] if a.kind != ActionKind.STEP)  # keep the gradients
    executor.run(actions, micro_batch, lambda stage, mb, rows: {})
    grads = {}
    for s, module in executor.modules.items():
        for k, p in module.named_parameters():
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[f"{s}.{k}"] = grad.numpy().copy()
    # numpy arrays pickle by value; a tensor would travel as a shared-memory handle that the parent
    # can only open while this process lives (it may read the queue after this process has exited)
    out.put((rank, grads))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize(
    ("world", "placement"),
    [
        (3, {"enc": [0], "a": [1], "b": [2]}),
        (3, {"enc": [0], "a": {"ranks": [1, 2], "dp": 2}, "b": [0]}),
        (2, {"enc": {"ranks": [0, 1], "dp": 2}, "a": [1], "b": [0]}),
    ],
    ids=["heads-on-two-ranks", "head-a-dp2", "enc-dp2"],
)
def test_fan_out_gradients_match_single_process(world: int, placement: dict) -> None:
    ctx = procs.context()
    queue = ctx.Queue()
    port = free_port()
    workers = [ctx.Process(target=_worker, args=(r, world, port, placement, queue)) for r in range(world)]
    for p in workers:
        p.start()
    results = [queue.get(timeout=120) for _ in workers]
    for p in workers:
        p.join(timeout=60)
        assert p.exitcode == 0
    grads: dict[str, torch.Tensor] = {}
    for _, g in sorted(results, key=lambda r: r[0]):
        grads.update({k: torch.from_numpy(v) for k, v in g.items()})
    ref = reference_grads()
    assert grads.keys() == ref.keys()
    dp = any(isinstance(v, dict) for v in placement.values())
    for k in ref:
        if dp:
            # dp halves sum their rows separately and are averaged by a reduce-scatter: float32
            # reassociation, ~1e-7 relative; 1e-5 catches any missing or double-counted slice.
            torch.testing.assert_close(grads[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)
        else:
            # Same ops per stage; only the order of summing the two heads' contributions to
            # enc's output gradient may differ from autograd's: allow float32 rounding there.
            torch.testing.assert_close(grads[k], ref[k], rtol=1e-6, atol=1e-7, msg=k)


def test_dataclass_is_frozen() -> None:
    plan = build_plan(fanout_graph(), parse_placement({"enc": [0], "a": [0], "b": [0]}), 1, world_size=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.micro_batches = 3  # type: ignore[misc]


def _stalled_worker(rank: int, port: int, out: Any) -> None:
    import datetime

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=3))
    graph = fanout_graph()
    plan = build_plan(graph, parse_placement({"enc": [0], "a": [1], "b": [1]}), MICRO, world_size=2)
    executor = Executor(graph, plan, MeshOwner(plan, rank, 2), batch_size=ROWS)
    if rank == 0:  # rank 0 never sends: rank 1's first receive must time out, not hang
        out.put((rank, "idle"))
        time.sleep(8)
        return
    try:
        executor.run(plan.actions[rank], micro_batch, lambda stage, mb, rows: {})
        out.put((rank, "finished"))
    except Exception as err:  # the error a user sees
        out.put((rank, str(err)))


def test_a_missing_peer_becomes_an_error_with_the_plan_table() -> None:
    ctx = procs.context()
    queue = ctx.Queue()
    port = free_port()
    workers = [ctx.Process(target=_stalled_worker, args=(r, port, queue)) for r in range(2)]
    for p in workers:
        p.start()
    messages = dict(queue.get(timeout=60) for _ in workers)
    for p in workers:
        p.join(timeout=30)
    text = messages[1]
    assert "rank 1 failed at step 0 (enc->a:RECV:mb0@r0)" in text
    assert "<-- ERROR HERE (rank 1)" in text


class _Unpatchify(nn.Module):
    """Returns a view of its result, as diffusers' DiTs do (``reshape`` / ``permute`` at the end)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).permute(1, 0)


def _shard_and_step(rank: int, world: int, hook: bool) -> tuple[list[str], torch.Tensor]:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from mmpipe.runtime.executor import own_outputs

    module = _Unpatchify()
    if hook:
        module.register_forward_hook(own_outputs)
    fully_shard(module, mesh=init_device_mesh("cpu", (world,)))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = module(torch.arange(8.0).view(2, 4))
        out.square().sum().backward()
    grad = module.proj.weight.grad.full_tensor()  # type: ignore[union-attr]
    return [str(w.message) for w in seen if "returned a view tensor" in str(w.message)], grad


def test_a_sharded_stage_returning_a_view_gets_its_own_output_and_the_same_gradients() -> None:
    """FSDP2 warns on every forward of a sharded module that returns a view; the executor's hook
    hands it a copy: no warning, the same gradients."""
    from workers import run_workers

    plain = run_workers(_shard_and_step, 2, False)
    owned = run_workers(_shard_and_step, 2, True)
    assert all(warned for warned, _ in plain)  # the warning this guards against still exists
    assert all(not warned for warned, _ in owned)
    for (_, a), (_, b) in zip(plain, owned, strict=True):
        assert torch.equal(a, b)
