"""Per-rank records of every executed action, as JSON lines in ``RUN_DIR/events/rank<R>.jsonl``.

One record: ``{"rank", "step", "phase", "stage", "dst", "peer", "mb", "kind", "start", "end", "bytes"}``
(``dst`` / ``peer``: the consumer stage and the other rank of a transfer, else null), plus, on
ranks that offload activations, the action's ``offloaded_bytes`` (forward), ``offload_returned_bytes``
(backward), ``offload_write_s`` (the background writer's seconds) and ``offload_wait_s`` (seconds the
action waited on the tier: a forward on the writer, a backward on its reads) when non-zero;
times are ``time.perf_counter()`` seconds offset to the Unix epoch at recorder creation, so ranks
on one machine share a clock. On a CUDA rank an action's start and end are CUDA events recorded on
its stream, resolved against an anchor event once per step (:meth:`EventRecorder.flush`), so the
timeline shows when the GPU ran the work, not when the host launched it. The dashboard and the
simulator read the same format.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from mmpipe.sched.plan import Action

Mark = float | torch.cuda.Event  # a point in time: host seconds, or a CUDA event (device time)


class EventRecorder:
    """Appends action events of one rank; ``step`` and ``phase`` tag what follows."""

    def __init__(self, run_dir: Path, rank: int, device: torch.device | None = None) -> None:
        path = run_dir / "events" / f"rank{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self._stream = path.open("a")
        self._offset = time.time() - time.perf_counter()
        self.step = 0
        self.phase = "train"
        self.cuda = device is not None and device.type == "cuda"
        self._pending: list[tuple[dict[str, Any], torch.cuda.Event, torch.cuda.Event]] = []
        self._anchor = self._new_anchor() if self.cuda else None

    @staticmethod
    def _new_anchor() -> tuple[torch.cuda.Event, float]:
        """A CUDA event and the host time at which it completed (the device's work before it done)."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        event.synchronize()
        return event, time.perf_counter()

    def mark(self) -> Mark:
        """Now: on the current CUDA stream for a CUDA rank, on the host clock otherwise."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def record(self, action: Action, start: Mark, end: Mark, nbytes: int, **extra: float) -> None:
        """Write one action's event; ``extra``: non-zero figures of the action (e.g. the activation
        tier's ``offloaded_bytes``, ``offload_write_s`` and ``offload_wait_s``)."""
        event: dict[str, Any] = {
            "rank": self.rank,
            "step": self.step,
            "phase": self.phase,
            "stage": action.stage,
            "dst": action.dst,
            "peer": action.peer,
            "mb": action.mb,
            "kind": action.kind.value,
            "bytes": nbytes,
        }
        event.update({k: v for k, v in extra.items() if v})
        if isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event):
            self._pending.append((event, start, end))  # written once the device has run it (flush)
            return
        assert isinstance(start, float) and isinstance(end, float)
        event.update(start=start + self._offset, end=end + self._offset)
        self._stream.write(json.dumps(event) + "\n")

    def flush(self) -> None:
        """Resolve the CUDA events of the step (waiting for the device) and flush to disk (once per step)."""
        if self._pending:
            assert self._anchor is not None
            self._pending[-1][2].synchronize()
            anchor, wall = self._anchor
            for event, start, end in self._pending:
                event["start"] = wall + anchor.elapsed_time(start) / 1e3 + self._offset
                event["end"] = wall + anchor.elapsed_time(end) / 1e3 + self._offset
                self._stream.write(json.dumps(event) + "\n")
            self._pending.clear()
            self._anchor = self._new_anchor()  # re-anchored each step: no drift between the clocks
        self._stream.flush()

    def close(self) -> None:
        """Flush and close."""
        self.flush()
        self._stream.close()


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """All ranks' events of a run."""
    events = []
    for path in sorted((run_dir / "events").glob("rank*.jsonl")):
        events += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return events
