"""What a training rank records for the dashboard, besides its action events: memory samples, a
``torch.profiler`` window, and the merged all-ranks Chrome / Perfetto trace of the DAG timeline;
and what ``mmpipe generate`` records (:func:`record_generation`: an event per stage call and per
denoiser call, memory samples, the trace), so that every run can be reported.

- ``RUN_DIR/memory/rank<R>.jsonl``: one record every :data:`MEMORY_INTERVAL_S` seconds (and one at
  the end), ``{"rank", "time", "step", "rss", "rss_peak"}`` in bytes, plus ``cuda_allocated``,
  ``cuda_reserved`` and ``cuda_peak`` once the process has initialised CUDA; ``time`` is Unix
  seconds, the events' clock.
- ``RUN_DIR/profiler/rank<R>.<ns>.pt.trace.json``: ``profile.enabled=true`` (:class:`TraceConfig`)
  profiles training steps ``[wait + warmup, wait + warmup + active)``; the executor names every
  action's range after the action (``dit:F:mb0``, ``text->dit:SEND:mb1@r1``).
- ``RUN_DIR/trace.json``: every rank's events as one Chrome trace (a process per rank, a thread
  per phase, flow arrows from each send to its receive, memory counters), for ``chrome://tracing``
  or https://ui.perfetto.dev.

DESIGN.md names ``mmpipe/profiling/`` for this; it lives next to its only reader, the report, so
that ``mmpipe.profiling`` is not mistaken for ``mmpipe profile`` (the planner's calibration).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmpipe.config import TraceConfig
from mmpipe.report.analysis import read_memory
from mmpipe.runtime.events import EventRecorder, read_events
from mmpipe.sched.plan import Action, ActionKind

MEMORY_INTERVAL_S = 0.2
PROFILER_DIR = "profiler"
TRACE_FILE = "trace.json"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> tuple[int, int]:
    """(current, peak) resident set size of this process in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[1]) * _PAGE
    except OSError:  # no procfs: the high-water mark is the best available figure
        current = peak
    return current, max(peak, current)


def memory_sample(rank: int, step: int) -> dict[str, Any]:
    """One memory record of this process (CUDA figures only once CUDA is initialised)."""
    current, peak = rss_bytes()
    sample: dict[str, Any] = {"rank": rank, "time": time.time(), "step": step, "rss": current, "rss_peak": peak}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        sample |= {
            "cuda_allocated": torch.cuda.memory_allocated(),
            "cuda_reserved": torch.cuda.memory_reserved(),
            "cuda_peak": torch.cuda.max_memory_allocated(),
        }
    return sample


class MemorySampler:
    """Appends :func:`memory_sample` records of one rank from a daemon thread; ``step_fn`` tags them."""

    def __init__(self, run_dir: Path, rank: int, step_fn: Callable[[], int], interval_s: float = MEMORY_INTERVAL_S):
        path = run_dir / "memory" / f"rank{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.rank, self.step_fn, self.interval_s = rank, step_fn, interval_s
        self._stream = path.open("a")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"mmpipe-memory-rank{rank}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        """Write one record now."""
        line = json.dumps(memory_sample(self.rank, self.step_fn())) + "\n"
        with self._lock:
            if not self._stream.closed:
                self._stream.write(line)
                self._stream.flush()

    def close(self) -> None:
        """Stop the thread, write a last record and close the file."""
        self._stop.set()
        self._thread.join()
        self.sample()
        with self._lock:
            self._stream.close()


class RankRecording:
    """A training rank's memory sampler and, with ``profile.enabled``, its profiler window."""

    def __init__(self, cfg: TraceConfig, run_dir: Path, rank: int, step_fn: Callable[[], int]) -> None:
        self.memory = MemorySampler(run_dir, rank, step_fn)
        self.profiler: torch.profiler.profile | None = None
        if cfg.enabled:
            self.profiler = build_profiler(cfg, run_dir / PROFILER_DIR, rank)
            self.profiler.start()

    def step(self) -> None:
        """After each training step: advance the profiler's schedule."""
        if self.profiler is not None:
            self.profiler.step()

    def close(self) -> None:
        """Stop profiling (writing a trace the window left unwritten) and sampling."""
        if self.profiler is not None:
            self.profiler.stop()
            _leak_results(self.profiler)
            self.profiler = None
        self.memory.close()


def build_profiler(cfg: TraceConfig, out_dir: Path, rank: int) -> torch.profiler.profile:
    """``torch.profiler`` with ``cfg``'s wait / warmup / active schedule, written for TensorBoard."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(out_dir), worker_name=f"rank{rank}"),
        profile_memory=False,
    )


def top_kernels(fn: Callable[[], Any], *, top: int = 12) -> list[dict[str, Any]]:
    """Run ``fn`` once under ``torch.profiler`` and return its ``top`` operators by self time: on a
    GPU the device kernels (``device_ms``), else CPU operators (``cpu_ms``), each with its call count.
    For benchmarks that must say where their time goes."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)
    unit = "device_ms" if cuda else "cpu_ms"
    rows = [{"name": e.key[:120], unit: getattr(e, key, 0.0) / 1e3, "calls": e.count} for e in events[:top]]
    _leak_results(prof)
    return rows


def _leak_results(prof: torch.profiler.profile) -> None:
    """Keep the profiler's kineto result alive until the process ends, deliberately.

    With torch 2.13 on CPU ranks of a gloo group, freeing a ``ProfilerResult`` after its trace is
    written crashes the worker at random (SIGSEGV: ``free()`` of a bad pointer in
    ``libkineto::MemoryTraceLogger::~MemoryTraceLogger``, reached from the garbage collector);
    single-process runs do not. PyTorch leaks profiler state for a similar crash (pytorch#151625).
    One window's result is a few megabytes, once per run.
    """
    result = getattr(prof.profiler, "kineto_results", None) if prof.profiler is not None else None
    if result is not None:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(result))


# ---- a generation run ----------------------------------------------------------------------------
@contextmanager
def record_generation(graph: Any, run_dir: Path, *, per_call: tuple[str, ...] = ()) -> Iterator[Path]:
    """Record what ``graph`` runs inside the block as a one-rank run in ``run_dir`` (phase
    ``generate``): an ``F`` event per stage call (``mb``: the call's number), except for the stages
    in ``per_call``, whose every module call is an event (the denoiser: one per sampling step and
    guidance branch); memory samples; ``trace.json`` at the end. Stages are wrapped, not changed:
    their ``forward`` is restored on exit."""

    recorder = EventRecorder(run_dir, 0)
    recorder.phase = "generate"
    memory = MemorySampler(run_dir, 0, lambda: 0)
    calls: dict[str, int] = defaultdict(int)

    def record(stage: str, start: float) -> None:
        recorder.record(Action(stage, ActionKind.F, calls[stage]), start, time.perf_counter(), 0)
        calls[stage] += 1

    def timed(stage: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                record(stage, start)

        return run

    wrapped: list[tuple[Any, Any]] = []  # (stage, the forward it had as an instance attribute)
    hooks = []
    for name, stage in graph.stages.items():
        if name in per_call:
            started: list[float] = []
            # a family graph's denoiser holds its experts in a ModuleDict: each one's calls count
            modules = list(stage.module.values()) if isinstance(stage.module, nn.ModuleDict) else [stage.module]
            for module in modules:
                hooks.append(module.register_forward_pre_hook(lambda m, a, s=started: s.append(time.perf_counter())))
                hooks.append(module.register_forward_hook(lambda m, a, o, n=name, s=started: record(n, s.pop())))
        else:
            wrapped.append((stage, stage.__dict__.get("forward")))
            stage.forward = timed(name, stage.forward)
    try:
        yield run_dir
    finally:
        for stage, own in wrapped:
            if own is None:
                del stage.forward  # the class's method again
            else:
                stage.forward = own
        for hook in hooks:
            hook.remove()
        recorder.close()
        memory.close()
        write_chrome_trace(run_dir)


# ---- the merged Chrome / Perfetto trace ----------------------------------------------------------
_PHASE_TID = {"train": 0, "val": 1, "serve": 0, "generate": 0}


def chrome_trace(events: list[dict[str, Any]], memory: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Every rank's action events as one Chrome trace (``traceEvents`` in microseconds from the first event)."""
    if not events:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    t0 = min(e["start"] for e in events)
    out: list[dict[str, Any]] = []
    for rank in sorted({e["rank"] for e in events}):
        out.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
        for phase, tid in _PHASE_TID.items():
            out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": phase}})
    for e in events:
        out.append(
            {
                "ph": "X",
                "name": event_name(e),
                "cat": e["kind"],
                "pid": e["rank"],
                "tid": _PHASE_TID.get(e["phase"], 2),
                "ts": (e["start"] - t0) * 1e6,
                "dur": (e["end"] - e["start"]) * 1e6,
                "args": {k: e[k] for k in ("stage", "dst", "peer", "mb", "step", "bytes") if e.get(k) is not None},
            }
        )
    out += _flows(events, t0)
    for m in memory or []:
        out.append({"ph": "C", "name": "memory", "pid": m["rank"], "ts": (m["time"] - t0) * 1e6,
                    "args": {"rss_mib": m["rss"] / 2**20}})  # fmt: skip
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def event_name(e: dict[str, Any]) -> str:
    """An event's action in the plan's text form (``dit:F:mb0``, ``text->dit:SEND:mb1@r1``)."""
    name = f"{e['stage']}->{e['dst']}" if e.get("dst") else e["stage"]
    mb = f":mb{e['mb']}" if e.get("mb") is not None else ""
    peer = f"@r{e['peer']}" if e.get("peer") is not None else ""
    return f"{name}:{e['kind']}{mb}{peer}"


_RECEIVER = {"SEND": "RECV", "SENDG": "RECVG"}


def _flows(events: list[dict[str, Any]], t0: float) -> list[dict[str, Any]]:
    """Flow arrows from each send to the receive of the same message (k-th send matches k-th receive)."""
    recvs: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e["kind"] in _RECEIVER.values():
            recvs[(e["phase"], e["step"], e["kind"], e["stage"], e["dst"], e["mb"], e["peer"], e["rank"])].append(e)
    counts: dict[tuple, int] = defaultdict(int)
    out: list[dict[str, Any]] = []
    for e in events:
        if e["kind"] not in _RECEIVER:
            continue
        key = (e["phase"], e["step"], _RECEIVER[e["kind"]], e["stage"], e["dst"], e["mb"], e["rank"], e["peer"])
        matches = recvs.get(key, [])
        if counts[key] >= len(matches):
            continue
        r = matches[counts[key]]
        counts[key] += 1
        flow_id = len(out) // 2
        common = {"name": event_name(e), "cat": "transfer", "id": flow_id}
        out.append(common | {"ph": "s", "pid": e["rank"], "tid": _PHASE_TID.get(e["phase"], 2),
                             "ts": (e["start"] - t0) * 1e6})  # fmt: skip
        # The arrow ends where the receive returns (just inside its slice, which the "f" event binds to).
        arrive = max((r["start"] - t0) * 1e6, (r["end"] - t0) * 1e6 - 1.0)
        out.append(common | {"ph": "f", "bp": "e", "pid": r["rank"], "tid": _PHASE_TID.get(r["phase"], 2),
                             "ts": arrive})  # fmt: skip
    return out


def write_chrome_trace(run_dir: Path) -> Path:
    """Write ``RUN_DIR/trace.json`` from the run's events and memory samples."""

    path = run_dir / TRACE_FILE
    path.write_text(json.dumps(chrome_trace(read_events(run_dir), read_memory(run_dir))))
    return path
