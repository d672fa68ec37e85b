"""Graph building, validation messages, execution and printing, on toy linear stages."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch import nn

from mmpipe import Graph, Stage, TensorSpec


class Linear(Stage):
    """``x (B, d_in) -> y (B, d_out)``; with ``two_inputs`` it sums ``x`` and ``z``."""

    kind = "linear"

    def __init__(self, name: str, d_in: int, d_out: int, *, frozen: bool = False, two_inputs: bool = False):
        super().__init__(name, frozen=frozen)
        self.d_in, self.d_out, self.two_inputs = d_in, d_out, two_inputs

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        ports = {"x": TensorSpec(("B", self.d_in), torch.float32)}
        if self.two_inputs:
            ports["z"] = TensorSpec(("B", self.d_in), torch.float32)
        return ports

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        return {"y": TensorSpec(("B", self.d_out), torch.float32)}

    def build(self) -> nn.Module:
        torch.manual_seed(len(self.name))
        return nn.Linear(self.d_in, self.d_out)

    def forward(self, module: nn.Module, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        x = inputs["x"] + inputs["z"] if self.two_inputs else inputs["x"]
        return {"y": module(x) * options.get("scale", 1.0)}


def chain() -> Graph:
    g = Graph("chain")
    g.add_input("x", TensorSpec(("B", 4), torch.float32))
    g.add_stage(Linear("enc", 4, 8, frozen=True))
    g.add_stage(Linear("head", 8, 2))
    g.connect("input.x", "enc.x")
    g.connect("enc.y", "head.x")
    return g


def test_run_matches_manual_composition_and_freezes_frozen_stages() -> None:
    g = chain()
    x = torch.randn(3, 4)
    out = g.run({"x": x}, {"head": {"scale": 2.0}})
    enc, head = g.stages["enc"].module, g.stages["head"].module
    torch.testing.assert_close(out["head"]["y"], head(enc(x)) * 2.0, rtol=0, atol=0)
    assert not out["enc"]["y"].requires_grad  # frozen: no autograd graph
    assert out["head"]["y"].requires_grad
    assert [s.name for s in g.trainable_stages()] == ["head"]


def test_fan_out_and_fan_in() -> None:
    g = Graph("diamond")
    g.add_input("x", TensorSpec(("B", 4), torch.float32))
    g.add_stage(Linear("a", 4, 4))
    g.add_stage(Linear("b", 4, 4))
    g.add_stage(Linear("c", 4, 4))
    g.add_stage(Linear("join", 4, 1, two_inputs=True))
    g.connect("input.x", "a.x")
    g.connect("a.y", "b.x")  # a feeds two consumers
    g.connect("a.y", "c.x")
    g.connect("b.y", "join.x")
    g.connect("c.y", "join.z")
    assert g.topological_order() == ["a", "b", "c", "join"]
    x = torch.randn(2, 4)
    m = {n: g.stages[n].module for n in "abc"}
    expected = g.stages["join"].module(m["b"](m["a"](x)) + m["c"](m["a"](x)))
    torch.testing.assert_close(g.run({"x": x})["join"]["y"], expected, rtol=0, atol=0)


def test_cycle_is_named() -> None:
    g = Graph("loop")
    g.add_stage(Linear("a", 4, 4))
    g.add_stage(Linear("b", 4, 4))
    g.connect("a.y", "b.x")
    g.connect("b.y", "a.x")
    with pytest.raises(ValueError, match=r"cycle: (a -> b -> a|b -> a -> b)"):
        g.validate()


@pytest.mark.parametrize(
    ("src", "dst", "message"),
    [
        ("enc.nope", "head.x", "stage 'enc' has no output port 'nope'; its output ports: ['y']"),
        ("enc.y", "head.nope", "stage 'head' has no input port 'nope'; its input ports: ['x']"),
        ("ghost.y", "head.x", "unknown stage 'ghost'"),
        ("input.ghost", "enc.x", "unknown graph input 'ghost'"),
        ("enc", "head.x", "edge endpoint 'enc' must be 'stage.port'"),
    ],
)
def test_unknown_ports_are_named(src: str, dst: str, message: str) -> None:
    g = Graph()
    g.add_stage(Linear("enc", 4, 8))
    g.add_stage(Linear("head", 8, 2))
    with pytest.raises(ValueError) as err:
        g.connect(src, dst)
    assert message in str(err.value)


def test_unconnected_required_input_is_named() -> None:
    g = Graph()
    g.add_stage(Linear("enc", 4, 8))
    with pytest.raises(ValueError, match="stage 'enc': required input port 'x' is not connected"):
        g.validate()


def test_shape_and_dtype_mismatch_are_named() -> None:
    g = Graph()
    g.add_input("ids", TensorSpec(("B", 4), torch.int64))
    g.add_stage(Linear("enc", 4, 8))
    g.add_stage(Linear("head", 6, 2))
    with pytest.raises(ValueError, match=r"edge enc\.y -> head\.x: shape/dtype mismatch: dim 1: \(B, 8\) != \(B, 6\)"):
        g.connect("enc.y", "head.x")
    with pytest.raises(ValueError, match=r"edge input\.ids -> enc\.x: .*dtype torch.int64 != torch.float32"):
        g.connect("input.ids", "enc.x")


def test_port_fed_twice_and_duplicate_stage() -> None:
    g = chain()
    with pytest.raises(ValueError, match=r"input port head\.x is already fed by enc\.y"):
        g.connect("input.x", "head.x")
    with pytest.raises(ValueError, match="stage 'enc' is added twice"):
        g.add_stage(Linear("enc", 4, 8))


def test_runtime_values_are_checked_against_specs() -> None:
    g = chain()
    with pytest.raises(ValueError, match=r"stage 'enc': input port 'x': dim 1"):
        g.run({"x": torch.randn(3, 5)})
    with pytest.raises(ValueError, match=r"missing inputs \['x'\]"):
        g.run({})


def test_print_shows_stages_ports_edges_modes_and_parameters() -> None:
    g = chain()
    for stage in g.stages.values():
        _ = stage.module  # build
    text = str(g)
    assert "[linear] enc (frozen, 40 params)" in text
    assert "[linear] head (trainable, 18 params)" in text
    assert "in : x(B, 8):float32" in text
    assert "enc.y -> head.x" in text and "input.x -> enc.x" in text
