"""``mmpipe`` in the test's own process, for command lines that end before any worker starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmpipe.cli import main


def mmpipe_here(*args: str, cwd: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``mmpipe ARGS`` run by ``cli.main`` (what the console script calls) in ``cwd`` with
    ``$MMPIPE_CACHE`` in it: ``(exit status, stderr)``. Saves each case a subprocess's imports of
    torch, diffusers and transformers (5-20 s on the 2-core CI machine); the console script itself
    is run as a subprocess by tests/e2e/test_cli.py."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        mp.setenv("MMPIPE_CACHE", str(cwd / "cache"))
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as stop:  # argparse's way out (mmpipe eval), the status the shell then sees
            code = stop.code if isinstance(stop.code, int) else 1
    return code, capsys.readouterr().err
