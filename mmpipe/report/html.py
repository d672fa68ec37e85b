"""``mmpipe report``: one self-contained HTML file per call (plotly's bundled JavaScript inlined,
nothing fetched), with a dashboard per run and, for several runs, a comparison section first."""

from __future__ import annotations

import base64
import html
import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.offline import get_plotlyjs

from mmpipe.report.analysis import (
    Run,
    Summary,
    Window,
    edge_traffic,
    load_run,
    loss_curves,
    memory_peaks,
    rank_shares,
    stage_shares,
    steady_window,
    summarize,
)
from mmpipe.report.recording import TRACE_FILE, event_name, write_chrome_trace
from mmpipe.rundir import EVAL_DIR

REPORT_FILE = "report.html"
COMPARE_FILE = "mmpipe-report.html"
MAX_TIMELINE_EVENTS = 20_000  # beyond this the timeline shows the last steps only (plotly stays responsive)
_PATTERN = {"F": "", "B": "/", "STEP": "x", "SEND": ".", "RECV": "-", "SENDG": ".", "RECVG": "-"}
_PLOT_CONFIG = {"displaylogo": False, "responsive": True}


def write_report(run_dirs: Sequence[Path], out: Path | None = None, *, predict: bool = True) -> Path:
    """Write the report of ``run_dirs`` to ``out`` (default: ``RUN_DIR/report.html`` for one run,
    ``./mmpipe-report.html`` for several) and return its path. ``ValueError`` names a bad run directory."""
    if not run_dirs:
        raise ValueError("mmpipe report needs at least one run directory")
    runs = [load_run(Path(d)) for d in run_dirs]
    for run in runs:  # runs launched by torchrun write no merged trace themselves
        if not (run.run_dir / TRACE_FILE).is_file():
            write_chrome_trace(run.run_dir)
    summaries = [summarize(run, predict=predict) for run in runs]
    if out is None:
        out = runs[0].run_dir / REPORT_FILE if len(runs) == 1 else Path(COMPARE_FILE)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_page(runs, summaries))
    return out


def render_page(runs: Sequence[Run], summaries: Sequence[Summary]) -> str:
    """The whole HTML document."""
    sections = []
    if len(runs) > 1:
        sections.append(_comparison(runs, summaries))
    sections += [_run_section(i, run, s) for i, (run, s) in enumerate(zip(runs, summaries, strict=True))]
    nav = "".join(
        f'<a href="#run-{i}">{html.escape(r.name)}</a>' for i, r in enumerate(runs)
    )  # one anchor per run dashboard
    if len(runs) > 1:
        nav = '<a href="#compare">comparison</a>' + nav
    title = "mmpipe report: " + ", ".join(r.name for r in runs)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{_CSS}</style>
<script type="text/javascript">{get_plotlyjs()}</script>
</head><body>
<header><h1>{html.escape(title)}</h1><nav>{nav}</nav></header>
{"".join(sections)}
</body></html>
"""


_CSS = """
body { font-family: system-ui, sans-serif; margin: 0 1.5em 2em; color: #222; background: #fff; }
header { position: sticky; top: 0; background: #fff; border-bottom: 1px solid #ddd; z-index: 10; }
h1 { font-size: 1.3em; margin: .5em 0 .2em; } h2 { margin-top: 1.5em; border-bottom: 2px solid #446; }
h3 { margin: 1.2em 0 .3em; font-size: 1.05em; }
nav a { margin-right: 1em; }
table { border-collapse: collapse; margin: .3em 0 1em; font-size: .9em; }
th, td { border: 1px solid #ccc; padding: .2em .6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #eef; }
.note { color: #666; font-size: .85em; }
"""


# ---- formatting ----------------------------------------------------------------------------------
def _fmt(value: float | None, spec: str = ".3g", suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def _pct(value: float | None) -> str:
    return _fmt(None if value is None else 100 * value, ".1f", " %")


def _mib(value: float | None) -> str:
    return _fmt(None if value is None else value / 2**20, ",.0f", " MiB")


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], table_id: str = "") -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    attr = f' id="{table_id}"' if table_id else ""
    return f"<table{attr}><tr>{head}</tr>{body}</table>"


def _figure(fig: go.Figure, div_id: str) -> str:
    fig.update_layout(template="plotly_white", margin={"l": 70, "r": 20, "t": 40, "b": 50})
    return fig.to_html(include_plotlyjs=False, full_html=False, div_id=div_id, config=_PLOT_CONFIG)


def _stage_colors(stages: Sequence[str]) -> dict[str, str]:
    palette = qualitative.Plotly
    return {s: palette[i % len(palette)] for i, s in enumerate(stages)}


# ---- one run ---------------------------------------------------------------------------------------
def _run_section(i: int, run: Run, s: Summary) -> str:
    window = steady_window(run.events)
    parts = [f'<section id="run-{i}"><h2>{html.escape(run.name)}</h2>', _describe(run, s, window)]
    parts += [f'<p class="note">{html.escape(n)}</p>' for n in s.notes]
    parts.append("<h3>Headline figures: measured and predicted</h3>" + _headline(s))
    parts.append("<h3>Timeline</h3>" + _timeline(i, run))
    if window is not None and window.wall > 0:
        parts.append(_time_accounting(i, run, window))
        parts.append("<h3>Transfers per edge</h3>" + _edges(run, window))
    parts.append("<h3>Memory</h3>" + _memory(i, run))
    curves = loss_curves(run.metrics)
    if curves["loss"] or curves["val_loss"]:
        parts.append("<h3>Loss</h3>" + _figure(_loss_figure({run.name: curves}), f"loss-{i}"))
    evaluation = _evaluation(run)
    if evaluation:
        parts.append("<h3>Evaluation (mmpipe eval)</h3>" + evaluation)
    parts.append("</section>")
    return "\n".join(parts)


def _evaluation(run: Run) -> str:
    """``mmpipe eval``'s accuracies and contact sheet (embedded), when the run was evaluated."""
    path = run.run_dir / EVAL_DIR / "eval.json"
    if not path.is_file():
        return ""
    try:
        result = json.loads(path.read_text())
        rows = [
            ["colour accuracy", _pct(result["color_acc"])],
            ["shape accuracy", _pct(result["shape_acc"])],
            ["direction accuracy", _pct(result["direction_acc"])],
            ["VAE reconstruction PSNR", f"{result['vae_psnr_db']:.2f} dB"],
            ["clips", str(result["n"])],
        ]
    except (ValueError, KeyError, TypeError) as err:
        return f'<p class="note">Unreadable {html.escape(str(path))}: {html.escape(repr(err))}</p>'
    out = _table(["measure", "value"], rows)
    sheet = path.parent / "contact_sheet.png"
    if sheet.is_file():
        data = base64.b64encode(sheet.read_bytes()).decode("ascii")
        out += (
            '<p class="note">First and last frame of every clip, its caption, and the tracker\'s verdict '
            "(green: colour, shape and direction all match).</p>"
            f'<img alt="contact sheet" style="max-width:100%;image-rendering:pixelated" src="data:image/png;base64,{data}">'
        )
    return out


def _describe(run: Run, s: Summary, window: Window | None) -> str:
    bits = [f"run directory <code>{html.escape(str(run.run_dir))}</code>", f"{s.ranks} ranks", f"{s.steps} steps"]
    cfg = run.config
    if cfg is not None:
        placement = json.dumps(cfg.placement) if cfg.placement else "default"
        bits += [
            f"model {html.escape(cfg.model.name)}",
            f"batch {cfg.train.batch_size} in {cfg.train.micro_batches} micro-batches ({cfg.train.schedule})",
            f"placement {html.escape(placement)}",
        ]
    if window is not None:
        bits.append(f"steady state: steps {window.first}–{window.last}")
    trace = run.run_dir / TRACE_FILE
    bits.append(f"merged trace for chrome://tracing or ui.perfetto.dev: <code>{html.escape(str(trace))}</code>")
    if (run.run_dir / "profiler").is_dir():
        bits.append(f"torch.profiler traces: <code>tensorboard --logdir {html.escape(str(run.run_dir))}</code>")
    return "<p>" + " · ".join(bits) + "</p>"


def _headline(s: Summary) -> str:
    p = s.prediction
    p_step, p_replay = (p.step_time, p.replay_step_time) if p else (None, None)
    p_mfu, p_bubble, p_replay_bubble = (p.mfu, p.bubble, p.replay_bubble) if p else (None, None, None)
    mfu_note = f"MFU against {s.peak_flops:.3g} FLOP/s per rank" if s.peak_flops else "MFU"
    rows = [
        ["step time", _fmt(s.step_time, ".4f", " s"), _fmt(p_step, ".4f", " s"),
         _fmt(p_replay, ".4f", " s")],
        ["samples/s", _fmt(s.samples_per_s, ".3g"), _fmt(_per_s(s, p_step), ".3g"),
         _fmt(_per_s(s, p_replay), ".3g")],
        ["tokens/s", _fmt(s.tokens_per_s, ",.0f"), "", ""],
        [mfu_note, _pct(s.mfu), _pct(p_mfu), ""],
        ["bubble (mean over ranks)", _pct(s.bubble), _pct(p_bubble), _pct(p_replay_bubble)],
        ["peak resident memory (largest rank)", _mib(s.peak_rss), "", ""],
        ["last training loss", _fmt(s.final_loss, ".4f"), "", ""],
        ["last validation loss", _fmt(s.final_val_loss, ".4f"), "", ""],
    ]  # fmt: skip
    cal = "" if p is None else ("calibrated" if p.calibrated else "uncalibrated: run `mmpipe profile` first")
    header = ["figure", "measured", f"cost model + simulator ({cal})" if cal else "predicted", "simulator replay"]
    note = (
        "<p class=\"note\">Predicted: the planner's cost model and discrete-event simulator for this run's "
        "placement (as <code>benchmarks/planner.py</code>). Replay: the simulator on this run's plan with the "
        "median measured duration of each action, which separates scheduling effects from cost-model error. "
        "MFU counts the model FLOPs of every stage (forward, and backward on the backward path).</p>"
    )
    return _table(header, rows, "headline") + note


def _per_s(s: Summary, step_time: float | None) -> float | None:
    if step_time is None or s.samples_per_s is None or s.step_time is None or step_time <= 0:
        return None
    return s.samples_per_s * s.step_time / step_time  # the same batch per step


def timeline_figure(run: Run) -> tuple[go.Figure, str]:
    """Ranks x time, one bar per action, coloured by stage, patterned by kind; and a note when capped."""
    events = run.events
    note = ""
    if len(events) > MAX_TIMELINE_EVENTS:
        by_step: dict[int, int] = defaultdict(int)
        for e in events:
            by_step[e["step"]] += 1
        keep, total = set(), 0
        for step in sorted(by_step, reverse=True):
            if total + by_step[step] > MAX_TIMELINE_EVENTS:
                break
            keep.add(step)
            total += by_step[step]
        events = [e for e in events if e["step"] in keep]
        note = f"showing steps {min(keep)}–{max(keep)} ({total} of {len(run.events)} actions); the merged trace has all"
    t0 = min(e["start"] for e in run.events)
    stages = list(dict.fromkeys(e["stage"] for e in sorted(run.events, key=lambda e: (e["rank"], e["start"]))))
    colors = _stage_colors(stages)
    ranks = sorted({e["rank"] for e in run.events})
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        groups[(e["stage"], e["kind"])].append(e)
    fig = go.Figure()
    for (stage, kind), evs in sorted(groups.items(), key=lambda kv: (stages.index(kv[0][0]), kv[0][1])):
        fig.add_trace(
            go.Bar(
                name=f"{stage} {kind}",
                orientation="h",
                y=[f"rank {e['rank']}" for e in evs],
                x=[e["end"] - e["start"] for e in evs],
                base=[e["start"] - t0 for e in evs],
                marker={"color": colors[stage], "pattern": {"shape": _PATTERN.get(kind, "")},
                        "line": {"width": 0}},
                opacity=1.0 if kind in ("F", "B", "STEP") else 0.55,
                customdata=[[event_name(e), e["phase"], e["step"], 1e3 * (e["end"] - e["start"]), e["bytes"]]
                            for e in evs],
                hovertemplate="%{customdata[0]}<br>%{customdata[1]} step %{customdata[2]}"
                "<br>%{customdata[3]:.2f} ms, %{customdata[4]:,} bytes<extra></extra>",
            )
        )  # fmt: skip
    labels = [f"rank {r}" for r in ranks]
    fig.update_layout(
        barmode="overlay",
        height=160 + 48 * len(ranks),
        xaxis_title="seconds since the run's first action",
        yaxis={"categoryorder": "array", "categoryarray": labels, "autorange": "reversed"},
        legend={"title": "stage, action"},
    )
    return fig, note


def _timeline(i: int, run: Run) -> str:
    fig, note = timeline_figure(run)
    text = (
        "Every recorded action (training and validation), one row per rank; colour: stage, hatching: "
        "action kind (B /, STEP x, sends ., receives -; transfers lighter). Drag to zoom, double-click to reset."
    )
    return f'<p class="note">{text} {html.escape(note)}</p>' + _figure(fig, f"timeline-{i}")


def _time_accounting(i: int, run: Run, window: Window) -> str:
    ranks = rank_shares(run.events, window)
    fig = go.Figure()
    labels = [f"rank {r}" for r in ranks]
    for name, attr, color in (
        ("busy (compute)", "busy_fraction", "#4c78a8"),
        ("communication", "comm_fraction", "#f58518"),
        ("idle", "idle_fraction", "#bab0ac"),
    ):
        fig.add_trace(go.Bar(name=name, y=labels, x=[getattr(s, attr) for s in ranks.values()], orientation="h",
                             marker_color=color))  # fmt: skip
    fig.update_layout(barmode="stack", height=140 + 40 * len(ranks), xaxis={"tickformat": ".0%", "range": [0, 1]},
                      yaxis={"autorange": "reversed"})  # fmt: skip
    rank_rows = [
        [f"rank {r}", _pct(s.busy_fraction), _pct(s.comm_fraction), _pct(s.idle_fraction), _pct(s.bubble),
         _fmt(s.frozen, ".3f", " s"), _fmt(s.trainable, ".3f", " s")]
        for r, s in ranks.items()
    ]  # fmt: skip
    stage_rows = [
        [stage, ",".join(map(str, rs)), "trainable" if s.trainable else "frozen", _fmt(s.compute, ".3f", " s"),
         _fmt(s.comm, ".3f", " s"), _pct(s.busy_fraction), _pct(s.comm_fraction),
         _pct(sum(ranks[r].idle_fraction for r in rs) / len(rs))]
        for stage, (rs, s) in stage_shares(run.events, window).items()
    ]  # fmt: skip
    frozen = sum(s.frozen for s in ranks.values())
    trainable = sum(s.trainable for s in ranks.values())
    total = frozen + trainable
    split = f"frozen stages {_pct(frozen / total)}, trainable stages {_pct(trainable / total)}" if total else ""
    return (
        f"<h3>Busy, communication and idle time (steps {window.first}–{window.last}, "
        f"{window.wall:.3f} s of wall time)</h3>"
        '<p class="note">Busy: in F / B / STEP; communication: in a send or a receive (waiting included); '
        "idle: in no action. Bubble = 1 − busy (the simulator's definition).</p>"
        + _figure(fig, f"shares-{i}")
        + _table(
            ["rank", "busy", "comm", "idle", "bubble", "frozen compute", "trainable compute"], rank_rows, f"ranks-{i}"
        )  # fmt: skip
        + f"<p>Compute time: {split}</p>"
        + _table(
            ["stage", "ranks", "kind", "compute", "comm", "busy", "comm share", "idle of its ranks"],
            stage_rows,
            f"stages-{i}",
        )  # fmt: skip
    )


def _edges(run: Run, window: Window) -> str:
    edges = edge_traffic(run.events, window)
    if not edges:
        return '<p class="note">No transfers between ranks in this run.</p>'
    rows = [
        [e.label, e.messages, _fmt(e.bytes / e.steps / 2**20, ".3f", " MiB"), _fmt(e.send_s / e.steps * 1e3, ".2f", " ms"),
         _fmt(e.recv_s / e.steps * 1e3, ".2f", " ms"), _fmt(e.bytes / e.recv_s / 1e9 if e.recv_s else None, ".3g", " GB/s")]
        for e in edges
    ]  # fmt: skip
    return (
        _table(["edge", "messages", "bytes / step", "send / step", "receive / step", "bytes / receive time"], rows)
        + '<p class="note">Sends are asynchronous: their time is the cost of posting them; a receive\'s time '
        "includes waiting for its producer, so bytes / receive time is a lower bound on bandwidth.</p>"
    )


def _memory(i: int, run: Run) -> str:
    if not run.memory:
        return '<p class="note">No memory samples in this run (RUN_DIR/memory/rank&lt;R&gt;.jsonl).</p>'
    t0 = min(e["start"] for e in run.events)
    fig = go.Figure()
    by_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for m in run.memory:
        by_rank[m["rank"]].append(m)
    colors = qualitative.D3
    for r, samples in sorted(by_rank.items()):
        color = colors[r % len(colors)]
        x = [m["time"] - t0 for m in samples]
        fig.add_trace(go.Scatter(name=f"rank {r} resident", x=x, y=[m["rss"] / 2**20 for m in samples],
                                 mode="lines", line={"color": color}))  # fmt: skip
        if any("cuda_allocated" in m for m in samples):
            fig.add_trace(go.Scatter(name=f"rank {r} CUDA allocated", x=x,
                                     y=[m.get("cuda_allocated", 0) / 2**20 for m in samples], mode="lines",
                                     line={"color": color, "dash": "dot"}))  # fmt: skip
        top = max(samples, key=lambda m: m["rss"])
        fig.add_trace(go.Scatter(x=[top["time"] - t0], y=[top["rss"] / 2**20], mode="markers+text",
                                 text=[f"peak {top['rss'] / 2**20:,.0f} MiB"], textposition="top center",
                                 marker={"color": color, "size": 9}, showlegend=False, hoverinfo="skip"))  # fmt: skip
    fig.update_layout(height=360, xaxis_title="seconds since the run's first action", yaxis_title="MiB")
    rows = [[f"rank {r}", _mib(p.get("rss")), _mib(p.get("cuda"))] for r, p in memory_peaks(run.memory).items()]
    return _figure(fig, f"memory-{i}") + _table(
        ["rank", "peak resident (high-water mark)", "peak CUDA allocated"], rows
    )


def _loss_figure(curves: dict[str, dict[str, list[tuple[int, float]]]]) -> go.Figure:
    fig = go.Figure()
    for name, c in curves.items():
        prefix = f"{name} " if len(curves) > 1 else ""
        if c["loss"]:
            fig.add_trace(go.Scatter(name=f"{prefix}training loss", x=[s for s, _ in c["loss"]],
                                     y=[v for _, v in c["loss"]], mode="lines+markers"))  # fmt: skip
        if c["val_loss"]:
            fig.add_trace(go.Scatter(name=f"{prefix}validation loss", x=[s for s, _ in c["val_loss"]],
                                     y=[v for _, v in c["val_loss"]], mode="lines+markers", line={"dash": "dash"}))  # fmt: skip
    fig.update_layout(height=360, xaxis_title="step", yaxis_title="loss")
    return fig


# ---- several runs ----------------------------------------------------------------------------------
def _comparison(runs: Sequence[Run], summaries: Sequence[Summary]) -> str:
    rows = [
        [s.name, s.ranks, s.steps, _fmt(s.step_time, ".4f", " s"), _fmt(s.prediction.step_time if s.prediction else None, ".4f", " s"),
         _fmt(s.samples_per_s, ".3g"), _pct(s.mfu), _pct(s.bubble), _mib(s.peak_rss), _fmt(s.final_loss, ".4f"),
         _fmt(s.final_val_loss, ".4f")]
        for s in summaries
    ]  # fmt: skip
    header = ["run", "ranks", "steps", "step time", "predicted", "samples/s", "MFU", "bubble", "peak memory",
              "last loss", "last val loss"]  # fmt: skip
    names = [s.name for s in summaries]
    fig = go.Figure()
    fig.add_trace(go.Bar(name="measured step time (s)", x=names, y=[s.step_time for s in summaries]))
    fig.add_trace(go.Bar(name="predicted step time (s)", x=names,
                         y=[s.prediction.step_time if s.prediction else None for s in summaries]))  # fmt: skip
    fig.update_layout(barmode="group", height=340, yaxis_title="seconds per step")
    shares = go.Figure()
    shares.add_trace(go.Bar(name="bubble", x=names, y=[s.bubble for s in summaries]))
    shares.add_trace(go.Bar(name="MFU", x=names, y=[s.mfu for s in summaries]))
    shares.update_layout(barmode="group", height=340, yaxis={"tickformat": ".0%"})
    loss = _loss_figure({r.name: loss_curves(r.metrics) for r in runs})
    return (
        '<section id="compare"><h2>Comparison</h2>'
        + _table(header, rows, "comparison")
        + _figure(fig, "compare-step")
        + _figure(shares, "compare-shares")
        + _figure(loss, "compare-loss")
        + "</section>"
    )
