"""The ``mmpipe`` console script: ``mmpipe train|generate [key=value ...]`` (Hydra overrides).

Hydra stays at this edge: it composes ``mmpipe/configs/<command>.yaml`` with the overrides in
struct mode (an unknown key is an error), and the container is turned into the typed dataclasses
of ``mmpipe.config`` before any work starts. A bad key or value exits with status 2 and a message
naming it.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mmpipe.config import GenerateConfig, PlanConfig, ProfileConfig, RunConfig, ServeConfig, compose_config, from_dict
from mmpipe.errors import RUN_FAILURES

USAGE = """usage: mmpipe COMMAND [key=value ...] [--cfg] [--json]

commands:
  train      train the text-to-video DAG (default: tiny Wan-style model on moving shapes)
  generate   render a prompt with a trained run: mmpipe generate ckpt=RUN_DIR prompt="..."
  plan       plan a model on a cluster: mmpipe plan model=wan14b_t2v cluster=h200_512 [--json]
             serving: mmpipe plan mode=serve model=wan1_3b_t2v cluster=h200_8 [slo_s=60] [--json]
  profile    calibrate the planner's cost model on this machine: mmpipe profile model=t2v_tiny
  report     profiling dashboard of runs, one offline HTML file: mmpipe report RUN_DIR [RUN_DIR ...] [--out FILE]
  eval       generate the moving-shapes caption grid with a trained run and score it: mmpipe eval RUN_DIR
  serve      OpenAI-compatible video / image API: mmpipe serve [pipeline=DIR | ckpt=RUN_DIR] port=8000

Overrides use Hydra syntax: model=t2v_tiny_qwen train.steps=50 data.root=/videos
--cfg prints the composed config and exits; --json (plan) prints the plan as JSON."""


def _run_train(raw: dict[str, Any]) -> None:
    cfg = from_dict(RunConfig, raw)  # validate before the heavy imports
    from mmpipe.devices import resolve_nproc  # start-up: imports torch, after the config is validated

    cfg = resolve_nproc(cfg)  # launch.nproc=0: one rank per GPU or core
    if cfg.launch.nproc > 1:
        from mmpipe.runtime import procs  # start-up: the command's stack, imported when it runs

        procs.start_server(["mmpipe.train.worker"])  # imports overlap the run directory's preparation
    from mmpipe.train import train  # start-up: the command's stack, imported when it runs

    result = train(cfg)
    print(f"run directory: {result.run_dir}")
    first = f"{result.first_val_loss:.4f} -> " if result.first_val_loss is not None else ""
    print(f"validation loss: {first}{result.last_val_loss:.4f}")


def _run_generate(raw: dict[str, Any]) -> None:
    cfg = from_dict(GenerateConfig, raw)
    from mmpipe.generate import generate  # start-up: the command's stack, imported when it runs

    for kind, path in generate(cfg).items():
        print(f"{kind}: {path}")


def _run_serve(raw: dict[str, Any]) -> None:
    cfg = from_dict(ServeConfig, raw)
    from mmpipe.runtime import procs  # start-up: the command's stack, imported when it runs

    procs.start_server(["mmpipe.serve.engine"])  # the serving groups' processes
    from mmpipe.serve.server import serve  # start-up: the command's stack, imported when it runs

    serve(cfg)


def _run_plan(raw: dict[str, Any]) -> None:
    cfg = from_dict(PlanConfig, raw)

    from mmpipe.assemble.planning import (  # start-up: the command's stack, imported when it runs
        default_calibration_path,
        plan_from_config,
        report_json,
    )

    if cfg.calibration is None and cfg.cluster.get("name") == "local" and default_calibration_path().is_file():
        cfg.calibration = str(default_calibration_path())
    if cfg.mode == "serve":
        _plan_serving(cfg)
        return
    graph, report = plan_from_config(cfg)
    if cfg.json:
        print(json.dumps(report_json(graph, report), indent=2))
    else:
        print(report.format())
        if cfg.calibration:
            print(f"calibration: {cfg.calibration}")


def _plan_serving(cfg: PlanConfig) -> None:
    """``mmpipe plan mode=serve``: how the cluster serves requests of the preset's size."""
    from mmpipe.assemble.serve_planning import (  # start-up: the command's stack, imported when it runs
        serve_plan_from_config,
    )

    plan = serve_plan_from_config(cfg)
    if cfg.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print(plan.format())
        if cfg.calibration:
            print(f"calibration: {cfg.calibration}")


def _run_profile(raw: dict[str, Any]) -> None:
    cfg = from_dict(ProfileConfig, raw)
    from mmpipe.assemble.planning import (
        default_calibration_path,  # start-up: the command's stack, imported when it runs
    )
    from mmpipe.devices import resolve_device  # start-up: the command's stack, imported when it runs
    from mmpipe.train.profile import profile  # start-up: the command's stack, imported when it runs

    resolve_device(cfg.device)  # device=cuda without a GPU: refused before the runs start

    cal = profile(
        cfg.model,
        cfg.data,
        micro_sizes=tuple(cfg.micro_sizes),
        micro_batches=cfg.micro_batches,
        steps=cfg.steps,
        warmup=cfg.warmup,
        threads=cfg.threads,
        device=cfg.device,
    )
    for stage, entry in cal.stages.items():
        parts = []
        for k in ("forward", "backward"):
            if k not in entry:
                continue
            *smaller, (_, eff, fixed) = cal.lines(stage, k, 0.0)
            parts.append(
                f"{k} {eff:.2%} of peak + {fixed * 1e3:.1f} ms"
                + "".join(f" (below {b:g} samples: {e:.2%} + {f * 1e3:.1f} ms)" for b, e, f in smaller)
            )
        if "step_s" in entry:
            parts.append(f"optimizer step {entry['step_s'] * 1e3:.1f} ms")
        if "sharded_step_overhead_s" in entry:
            fsdp = [entry.get(f"sharded_{k}_overhead_s", 0.0) * 1e3 for k in ("forward", "backward", "step")]
            parts.append(
                "sharded on 2 ranks: +{:.1f} ms a forward, +{:.1f} ms a backward, +{:.1f} ms a step".format(*fsdp)
            )
        print(f"{stage:<10} " + "; ".join(parts))
    line = f"per-step overhead {cal.step_overhead_s * 1e3:.1f} ms"
    if cal.latency_s is not None and cal.bandwidth:
        line += f"; transport {cal.latency_s * 1e6:.0f} us + {cal.bandwidth / 1e9:.2f} GB/s per message"
    if cal.collective_latency_s is not None and cal.collective_bandwidth:
        line += f", all-gather {cal.collective_latency_s * 1e6:.0f} us + {cal.collective_bandwidth / 1e9:.2f} GB/s"
    print(line)
    print(f"calibration: {cal.save(cfg.out or default_calibration_path(cal.device))}")


COMMANDS: dict[str, Callable[[dict[str, Any]], None]] = {
    "train": _run_train,
    "generate": _run_generate,
    "plan": _run_plan,
    "profile": _run_profile,
    "serve": _run_serve,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mmpipe`` console script; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    command, overrides = args[0], args[1:]
    if command == "report":  # paths, not a Hydra config
        return _run_report(overrides)
    if command == "eval":  # a path and flags, not a Hydra config
        from mmpipe.eval import main_eval  # start-up: the command's stack, imported when it runs

        return main_eval(overrides)
    if command not in COMMANDS:
        print(
            f"mmpipe: unknown command {command!r}; commands: {sorted([*COMMANDS, 'eval', 'report'])}\n\n{USAGE}",
            file=sys.stderr,
        )
        return 2
    show = "--cfg" in overrides
    if "--json" in overrides:
        if command != "plan":
            print(f"mmpipe {command}: error: --json is an option of `mmpipe plan` only", file=sys.stderr)
            return 2
        overrides = [*overrides, "json=true"]
    overrides = [o for o in overrides if o not in ("--cfg", "--json")]
    for o in overrides:
        if "=" not in o and not o.startswith("~"):
            print(f"mmpipe {command}: error: override {o!r} is not key=value (e.g. train.steps=50)", file=sys.stderr)
            return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        raw = compose_config(command, overrides)
        if show:
            print(OmegaConf.to_yaml(OmegaConf.create(raw)))
            return 0
        COMMANDS[command](raw)
    except (HydraException, OmegaConfBaseException, ValueError) as err:
        print(f"mmpipe {command}: error: {_first_line(err)}", file=sys.stderr)
        return 2
    except RUN_FAILURES as err:
        print(f"mmpipe {command}: {err}", file=sys.stderr)
        return 1
    return 0


def _run_report(args: list[str]) -> int:
    """``mmpipe report RUN_DIR [RUN_DIR ...] [--out FILE]``: write the HTML report, print its path."""

    out = None
    if "--out" in args:
        i = args.index("--out")
        if i + 1 >= len(args):
            print("mmpipe report: error: --out needs a file name", file=sys.stderr)
            return 2
        out, args = Path(args[i + 1]), args[:i] + args[i + 2 :]
    if not args or any(a.startswith("-") for a in args):
        print(f"mmpipe report: error: expected run directories, got {args}\n\n{USAGE}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from mmpipe.report import write_report  # start-up: the command's stack, imported when it runs

    try:
        path = write_report([Path(a) for a in args], out)
    except ValueError as err:
        print(f"mmpipe report: error: {err}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0


def _first_line(err: BaseException) -> str:
    """The user-facing part of an error (Hydra appends its config search path)."""
    text = str(err).strip() or type(err).__name__
    return text.split("Config search path:")[0].strip()


if __name__ == "__main__":
    sys.exit(main())
