"""The planner's calibration: per stage and direction, the fraction of the device's peak FLOP/s a
machine achieved (``mmpipe profile`` measures it), plus the step overhead and the transport's
latency and bandwidth."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What ``mmpipe profile`` measured on one device kind.

    Per stage: the achieved fraction of peak FLOP/s of its forward and backward
    (``forward``/``backward``), a fixed cost per action (``forward_overhead_s`` /
    ``backward_overhead_s``: launch and framework time that does not scale with the batch) and its
    optimizer step (``step_s``); per run: the per-step overhead outside actions and the transport's
    per-message latency and bandwidth.

    An action's time need not be one line in its samples (the tiny VAE's encode takes about as long
    for 1 clip as for 2, then grows): ``profile`` measures it at several micro-batch sizes and keeps
    one line per pair of neighbouring sizes. The line through the two largest is ``forward`` /
    ``forward_overhead_s``; one through smaller sizes is ``forward_upto_<n>`` /
    ``forward_overhead_s_upto_<n>``, which prices actions of fewer than ``n`` samples (:meth:`line`).
    """

    device: str
    peak_flops: float
    stages: Mapping[str, Mapping[str, float]]
    step_overhead_s: float = 0.0
    latency_s: float | None = None
    bandwidth: float | None = None
    collective_latency_s: float | None = None
    collective_bandwidth: float | None = None

    def lines(self, stage: str, direction: str, default: float) -> list[tuple[float, float, float]]:
        """The lines measured for ``stage``'s ``direction`` (``forward`` / ``backward``), as (the
        samples an action priced by it stays below, efficiency, fixed seconds), smallest first; the
        line through the two largest sizes last, unbounded (``default`` efficiency where the stage has
        none)."""
        entry = self.stages.get(stage, {})
        prefix = f"{direction}_upto_"
        bounded = sorted(
            (float(bound), float(entry[k]), float(entry.get(f"{direction}_overhead_s_upto_{bound}", 0.0)))
            for k in entry
            if k.startswith(prefix)
            for bound in [k.removeprefix(prefix)]
        )
        top = (math.inf, float(entry.get(direction, default)), float(entry.get(f"{direction}_overhead_s", 0.0)))
        return [*bounded, top]

    def line(self, stage: str, direction: str, samples: float, default: float) -> tuple[float, float]:
        """The efficiency and fixed seconds of ``stage``'s ``direction`` for an action of ``samples``
        samples: the first of :meth:`lines` whose bound exceeds ``samples``, else the last."""
        *smaller, (_, eff, fixed) = self.lines(stage, direction, default)
        return next(((e, f) for bound, e, f in smaller if samples < bound), (eff, fixed))

    def value(self, stage: str, key: str) -> float:
        return float(self.stages.get(stage, {}).get(key, 0.0))

    def collective_seconds(self, nbytes: float, ranks: int) -> float | None:
        """A ring collective of ``nbytes`` over ``ranks`` ranks at the measured transport (measured
        between two ranks; a ring over more takes ``ranks - 1`` such steps); None when unmeasured."""
        if self.collective_latency_s is None or not self.collective_bandwidth or ranks <= 1:
            return None
        return (ranks - 1) * (self.collective_latency_s + nbytes / self.collective_bandwidth)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        raw = dataclasses.asdict(self) | {"stages": {k: dict(v) for k, v in self.stages.items()}}
        path.write_text(json.dumps(raw, indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        try:
            raw = json.loads(Path(path).read_text())
            return cls(
                str(raw["device"]),
                float(raw["peak_flops"]),
                {str(k): {str(a): float(b) for a, b in v.items()} for k, v in raw["stages"].items()},
                float(raw.get("step_overhead_s", 0.0)),
                raw.get("latency_s"),
                raw.get("bandwidth"),
                raw.get("collective_latency_s"),
                raw.get("collective_bandwidth"),
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{str(path)!r} is not a calibration file written by `mmpipe profile`: {e}") from e
