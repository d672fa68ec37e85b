"""Stage-level toy graphs for plan, schedule and simulator tests (what the generator reads)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class S:
    name: str
    frozen: bool


class G:
    """A stage-level graph: what the schedule generator reads."""

    def __init__(self, stages: dict[str, bool], edges: list[tuple[str, str]]) -> None:
        self.stages = {n: S(n, f) for n, f in stages.items()}
        self._edges = edges

    def topological_order(self) -> list[str]:
        return list(self.stages)

    def stage_edges(self) -> list[tuple[str, str]]:
        return self._edges


T2V = G({"text": True, "vae": True, "dit": False}, [("text", "dit"), ("vae", "dit")])
# understand-then-generate: a frozen vision tower, then two trainable stages, gradients cross two boundaries
U2G = G(
    {"vit": True, "llm": False, "connector": False, "dit": False},
    [("vit", "llm"), ("llm", "connector"), ("connector", "dit")],
)
FANOUT = G({"enc": False, "a": False, "b": False}, [("enc", "a"), ("enc", "b")])
