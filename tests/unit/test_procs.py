"""Workers from the preloading forkserver see the launcher's environment as it is at launch."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

from mmpipe.runtime import procs
from mmpipe.runtime.launch import elastic_owned

VAR = "MMPIPE_TEST_PROCS_VAR"


def _report(queue: Any, env: dict[str, str] | None) -> None:
    if env is not None:
        procs.adopt_environment(env)
    import sys

    queue.put((os.environ.get(VAR), "torch" in sys.modules, threading.active_count()))


def _child(env: dict[str, str] | None) -> tuple[str | None, bool, int]:
    ctx = procs.context()
    queue = ctx.Queue()
    p = ctx.Process(target=_report, args=(queue, env))
    p.start()
    out = queue.get(timeout=120)
    p.join(timeout=30)
    assert p.exitcode == 0
    return out


def test_a_variable_set_after_the_server_started_reaches_the_child(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VAR, "early")
    value, preloaded, threads = _child(procs.environment())  # starts the server, if no test has yet
    assert preloaded and threads == 1  # torch came from the server; a fork carries no threads
    assert value == "early"
    monkeypatch.setenv(VAR, "late")
    assert _child(procs.environment())[0] == "late"
    monkeypatch.delenv(VAR)
    assert _child(procs.environment())[0] is None
    # What adopt_environment is for: the server's environment was frozen when it started.
    assert _child(None)[0] != "late"


def test_the_elastic_agents_variables_win_over_the_launchers(monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = dict(os.environ, MASTER_PORT="29500", RANK="7", TORCHELASTIC_RUN_ID="stale", **{VAR: "launcher"})
    monkeypatch.setenv("MASTER_PORT", "41000")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-2")
    monkeypatch.setenv(VAR, "server")
    monkeypatch.setenv("MMPIPE_TEST_PROCS_GONE", "x")
    procs.adopt_environment(launcher, keep=elastic_owned)
    assert (os.environ["MASTER_PORT"], os.environ["RANK"], os.environ["TORCHELASTIC_RUN_ID"]) == ("41000", "1", "run-2")
    assert os.environ[VAR] == "launcher" and "MMPIPE_TEST_PROCS_GONE" not in os.environ
