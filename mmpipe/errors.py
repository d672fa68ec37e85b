"""mmpipe's error types, and the model loaders' errors (diffusers, transformers, safetensors) as one
line that names the config key and directory they came from, instead of a traceback from deep inside.

The CLI maps these to exit codes (``ValueError`` and its :class:`PlanError`: 2, bad input; the
:data:`RUN_FAILURES`: 1) without importing the runtime or the server that raise them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from safetensors import SafetensorError

# What the loaders raise for a corrupt, truncated or mismatched model directory.
LOADER_ERRORS = (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError)


def cause(err: BaseException) -> str:
    """``Type: first line of the message`` (diffusers and transformers append hints after it)."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


@contextlib.contextmanager
def loading_errors(where: str) -> Iterator[None]:
    """Re-raise what the loaders raise inside the block as a ``ValueError`` that starts with
    ``where`` (the key and directory, e.g. ``model.path='/models/wan'``); one that already starts
    that way passes through unchanged."""
    try:
        yield
    except LOADER_ERRORS as err:
        if isinstance(err, ValueError) and str(err).startswith(where):
            raise
        raise ValueError(f"{where}: cannot load it: {cause(err)}") from err


class PlanError(ValueError):
    """A plan that cannot run; the message carries the rank x step table."""


class NonFiniteError(RuntimeError):
    """A trained stage's loss or gradient is NaN or infinite (``train.nonfinite=stop``)."""


class WorkerFailure(RuntimeError):
    """A launched worker died or raised; the message is the first failure's (with its plan table)."""


class ExecutionError(RuntimeError):
    """An action failed at run time; the message carries this rank's plan table."""


class ServeStartError(RuntimeError):
    """A serving group could not start (its graph failed to load, or it died or hung while starting);
    the message names the group and the cause. ``mmpipe serve`` prints it and exits with status 1.
    ``group`` is the group that reported the failure itself (it is ending on its own), else None."""

    def __init__(self, message: str, group: int | None = None) -> None:
        super().__init__(message)
        self.group = group


#: Run-time failures the CLI reports in one line (exit status 1); any other exception is a bug.
RUN_FAILURES = (WorkerFailure, ExecutionError, NonFiniteError, ServeStartError)
