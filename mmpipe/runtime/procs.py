"""Local worker processes that start in a fraction of a second.

A spawned worker is a fresh interpreter that imports torch, diffusers and transformers again:
about 12 s of CPU each, more than most short runs compute. Every process mmpipe starts on this
machine (training ranks, serving groups, the transport probe) comes instead from one
``forkserver`` that imported those libraries once: a child is a ``fork`` of it, with nothing
of the parent's threads, CUDA state or process groups (what makes a plain ``fork`` unsafe).

A forked child inherits the *server's* environment, which was frozen when the server started.
Launchers pass :func:`environment` (their own, now) and children call :func:`adopt_environment`
first, so a variable set after the first launch still reaches the workers, as with ``spawn``.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.context import ForkServerContext
from typing import Final

START_METHOD: Final = "forkserver"
_NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def context(preload: Sequence[str] = ()) -> ForkServerContext:
    """The multiprocessing context for mmpipe's local workers (the preloading forkserver, started)."""
    start_server(preload)
    return multiprocessing.get_context(START_METHOD)


def start_server(preload: Sequence[str] = ()) -> None:
    """Start the server now (a no-op once it runs): its imports (seconds) then overlap the caller's
    own work before the first launch, e.g. the CLI's imports and the run directory's preparation.
    ``preload``: the modules of the workers' entry functions (the server imports them once, with
    everything they need: torch, diffusers, transformers); the first start decides."""
    multiprocessing.set_forkserver_preload(list(preload))
    # A library that asks torch.cuda.is_available() while the server preloads it would initialise
    # the CUDA driver there, and CUDA does not survive a fork: children could not use their GPU.
    # NVML answers the question without initialising CUDA (torch's documented switch for this); set
    # for the server's start only (it copies the environment then), not left in this process.
    saved = os.environ.get(_NVML_CHECK)
    os.environ[_NVML_CHECK] = "1"
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ[_NVML_CHECK]
        else:
            os.environ[_NVML_CHECK] = saved


def environment() -> dict[str, str]:
    """This process's environment, for a child to :func:`adopt_environment`."""
    return dict(os.environ)


def adopt_environment(env: Mapping[str, str], keep: Callable[[str], bool] = lambda key: False) -> None:
    """Make this process's environment the launcher's ``env``, except for the variables ``keep``
    selects, which stay as this process has them (those its launcher set for it alone)."""
    kept = {k: v for k, v in os.environ.items() if keep(k)}
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(kept)
