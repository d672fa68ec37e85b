"""The launcher reports the worker error that caused the others, not a peer's lost connection."""

from __future__ import annotations

import json
from pathlib import Path

from mmpipe.runtime.launch import _recorded_failure
from mmpipe.train.worker import record_failure


def test_root_cause_is_the_earliest_error_that_is_not_a_lost_connection(tmp_path: Path) -> None:
    record_failure(tmp_path, 1, ValueError("aten.addmm got mixed Tensor and DTensor"))
    record_failure(tmp_path, 0, RuntimeError("rank 0 failed at step 3: Connection closed by peer [127.0.0.1]:1413"))
    record_failure(tmp_path, 2, RuntimeError("later error"))
    data = json.loads((tmp_path / "errors" / "rank2.json").read_text())
    data["time"] += 10
    (tmp_path / "errors" / "rank2.json").write_text(json.dumps(data))
    got = _recorded_failure(tmp_path)
    assert got is not None and got["rank"] == 1 and "DTensor" in got["message"]
    assert not list((tmp_path / "errors").glob("*.json"))  # consumed: a restarted run starts clean


def test_only_lost_connections_defer_to_the_agent(tmp_path: Path) -> None:
    record_failure(tmp_path, 1, RuntimeError("Connection closed by peer [127.0.0.1]:9"))
    assert _recorded_failure(tmp_path) is None
    assert _recorded_failure(tmp_path / "missing") is None
