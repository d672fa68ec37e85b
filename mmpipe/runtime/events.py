"""Per-rank records of every executed action, as JSON lines in ``RUN_DIR/events/rank<R>.jsonl``.

One record: ``{"rank", "step", "phase", "stage", "dst", "peer", "mb", "kind", "start", "end", "bytes"}``
(``dst`` / ``peer``: the consumer stage and the other rank of a transfer, else null), plus, on
ranks that offload activations, the action's ``offloaded_bytes`` (forward), ``offload_returned_bytes``
(backward), ``offload_write_s`` (the background writer's seconds) and ``offload_wait_s`` (seconds the
action waited on the tier: a forward on the writer, a backward on its reads) when non-zero;
times are ``time.perf_counter()`` seconds offset to the Unix epoch at recorder creation, so ranks
on one machine share a clock. The dashboard and the simulator read the same format.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from mmpipe.sched.plan import Action


class EventRecorder:
    """Appends action events of one rank; ``step`` and ``phase`` tag what follows."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        path = run_dir / "events" / f"rank{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self._stream = path.open("a")
        self._offset = time.time() - time.perf_counter()
        self.step = 0
        self.phase = "train"

    def record(self, action: Action, start: float, end: float, nbytes: int, **extra: float) -> None:
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
            "start": start + self._offset,
            "end": end + self._offset,
            "bytes": nbytes,
        }
        event.update({k: v for k, v in extra.items() if v})
        self._stream.write(json.dumps(event) + "\n")

    def flush(self) -> None:
        """Flush to disk (once per step)."""
        self._stream.flush()

    def close(self) -> None:
        """Flush and close."""
        self._stream.close()


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """All ranks' events of a run."""
    events = []
    for path in sorted((run_dir / "events").glob("rank*.jsonl")):
        events += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return events
