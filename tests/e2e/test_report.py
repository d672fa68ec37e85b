"""``mmpipe report`` on a real 2-rank training run: the HTML renders in headless Chromium without
console errors, one timeline row per rank and a non-blank screenshot; torch-tb-profiler loads the
``profile.enabled`` traces; the merged Chrome trace pairs every send with its receive.

Chromium is Debian's ``chromium`` package (``.ci/run`` installs it). Without it these tests skip
locally and fail under CI (``CI`` set), so CI cannot pass them vacuously.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from cli_here import mmpipe_here
from PIL import Image

from mmpipe.config import DataConfig, LaunchConfig, RunConfig, TraceConfig, TrainConfig
from mmpipe.runtime.events import read_events
from mmpipe.train import train

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--enable-logging=stderr",
    "--v=0",
    "--virtual-time-budget=5000",  # let plotly finish drawing before the dump / screenshot
]
CONSOLE = re.compile(r":CONSOLE[:(]\d+\)?\] (.*)")


def chromium() -> str:
    """The Chromium binary; fails under CI when it is missing, skips elsewhere."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        message = "chromium is not installed (apt-get install chromium; .ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def run_chromium(page: Path, tmp: Path, *args: str) -> tuple[str, list[str]]:
    """Load ``page`` headless; (stdout, console messages). The page logs nothing when it works, so
    every console message (errors, uncaught exceptions, warnings) counts against it."""
    cmd = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp / 'chromium-profile'}", *args, page.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, [m.group(1) for m in CONSOLE.finditer(proc.stderr)]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 2-rank pipelined training run (encoders on rank 0, DiT on rank 1) with a profiler window."""
    root = tmp_path_factory.mktemp("report") / "two-ranks"
    cfg = RunConfig(
        run_dir=str(root),
        data=DataConfig(frames=9, height=32, width=32, num_samples=64, val_samples=4),
        train=TrainConfig(
            steps=3,
            batch_size=4,
            micro_batches=2,
            warmup_steps=1,
            log_every=1,
            val_every=1000,
            ckpt_every=1000,
            progress=False,
            threads=1,
        ),
        launch=LaunchConfig(nproc=2, timeout_s=120),
        placement={"text": [0], "vae": [0], "dit": [1]},
        profile=TraceConfig(enabled=True, wait=0, warmup=1, active=1),
    )
    train(cfg)
    return root


@pytest.fixture(scope="module")
def report(run_dir: Path) -> Path:
    """``mmpipe report RUN_DIR`` through the console script."""
    proc = subprocess.run(
        [sys.executable, "-m", "mmpipe.cli", "report", str(run_dir)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = run_dir / "report.html"
    assert f"report: {path}" in proc.stdout
    return path


class _TickLabels(HTMLParser):
    """The y-axis tick labels plotly drew inside the element with id ``div_id``."""

    def __init__(self, div_id: str) -> None:
        super().__init__()
        self.div_id, self.depth, self.in_tick, self.labels = div_id, 0, 0, []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if self.depth or a.get("id") == self.div_id:
            self.depth += 1
        if self.depth and tag == "g" and "ytick" in (a.get("class") or "").split():
            self.in_tick = self.depth

    def handle_endtag(self, tag: str) -> None:
        if self.depth:
            if self.in_tick == self.depth:
                self.in_tick = 0
            self.depth -= 1

    def handle_data(self, data: str) -> None:
        if self.in_tick and data.strip():
            self.labels.append(data.strip())


def test_console_detection_catches_a_broken_page(tmp_path: Path) -> None:
    # The renderer test below relies on Chromium reporting console output; prove it does.
    page = tmp_path / "broken.html"
    page.write_text("<html><body><script>console.error('bad'); undefinedFunction();</script></body></html>")
    _, console = run_chromium(page, tmp_path, "--dump-dom")
    assert any("bad" in m for m in console) and any("undefinedFunction" in m for m in console), console


def test_report_of_a_two_rank_run_renders_in_chromium(report: Path, tmp_path: Path) -> None:
    text = report.read_text()
    assert not re.search(r"<(script|link)[^>]+(src|href)=", text)  # self-contained: nothing loaded
    dom, console = run_chromium(report, tmp_path, "--dump-dom")
    assert console == []
    ticks = _TickLabels("timeline-0")
    ticks.feed(dom)
    assert sorted(ticks.labels) == ["rank 0", "rank 1"]  # one timeline row per rank
    assert 'class="main-svg"' in dom  # plotly drew (the static HTML has no SVG)
    shot = tmp_path / "report.png"
    _, console = run_chromium(report, tmp_path, f"--screenshot={shot}", "--window-size=1280,2400")
    assert console == []
    image = Image.open(shot).convert("L")
    histogram = image.histogram()
    non_white = 1 - histogram[255] / sum(histogram)
    assert non_white > 0.05, f"screenshot is nearly blank ({non_white:.1%} non-white pixels)"
    assert sum(1 for count in histogram if count) > 20  # text, bars and lines, not a flat fill


def test_report_figures_of_the_run(report: Path, run_dir: Path) -> None:
    text = report.read_text()
    for needle in ('id="headline"', 'id="ranks-0"', 'id="stages-0"', "text -&gt; dit", "vae -&gt; dit", "memory-0",
                   "loss-0", "simulator replay"):  # fmt: skip
        assert needle in text, needle
    memory = [json.loads(line) for p in sorted((run_dir / "memory").glob("rank*.jsonl")) for line in p.open()]
    assert {m["rank"] for m in memory} == {0, 1} and all(m["rss_peak"] >= m["rss"] > 0 for m in memory)


def test_tensorboard_traces_load_with_torch_tb_profiler(run_dir: Path) -> None:
    from torch_tb_profiler import io
    from torch_tb_profiler.profiler.loader import RunLoader

    traces = run_dir / "profiler"
    files = sorted(p.name for p in traces.glob("*.pt.trace.json"))
    assert [f.split(".")[0] for f in files] == ["rank0", "rank1"]
    run = RunLoader("profiler", str(traces), io.Cache()).load()
    assert sorted(run.workers) == ["rank0", "rank1"]
    for worker in run.workers:
        (span,) = run.get_spans(worker)
        profile = run.get_profile(worker, span)
        assert {"overall", "operator", "trace"} <= {v.name for v in profile.views}
    # The executor's record_function ranges are named after the actions.
    annotations = {
        e["name"]
        for f in files
        for e in json.loads((traces / f).read_text())["traceEvents"]
        if e.get("cat") == "user_annotation"
    }
    assert {"dit:F:mb0", "dit:B:mb1", "text->dit:SEND:mb0@r1", "vae->dit:RECV:mb1@r0"} <= annotations


def test_merged_chrome_trace_pairs_sends_with_receives(run_dir: Path) -> None:
    trace = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    events = read_events(run_dir)
    slices = [e for e in trace if e["ph"] == "X"]
    assert len(slices) == len(events)
    assert {e["pid"] for e in slices} == {0, 1}
    names = {e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}
    sends = [e for e in events if e["kind"] in ("SEND", "SENDG")]
    starts = [e for e in trace if e["ph"] == "s"]
    finishes = [e for e in trace if e["ph"] == "f"]
    assert len(starts) == len(finishes) == len(sends) > 0
    assert all(s["pid"] == 0 and f["pid"] == 1 for s, f in zip(starts, finishes, strict=True))  # rank 0 -> rank 1


def test_several_runs_get_a_comparison_section(run_dir: Path, tmp_path: Path) -> None:
    from mmpipe.report import write_report

    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoints", "pipeline", "profiler"))
    out = write_report([run_dir, copy], tmp_path / "both.html", predict=False)
    text = out.read_text()
    assert 'id="compare"' in text and 'id="run-0"' in text and 'id="run-1"' in text
    table = text.split('id="comparison"')[1].split("</table>")[0]
    assert table.count("<tr>") == 3  # header + one row per run


@pytest.mark.parametrize("case", ["missing", "empty"])
def test_bad_run_directory_exits_2_naming_it(tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / case
    if case == "empty":
        path.mkdir()
    code, err = mmpipe_here("report", str(path), cwd=tmp_path, capsys=capsys)
    assert code == 2
    assert str(path) in err and "Traceback" not in err
