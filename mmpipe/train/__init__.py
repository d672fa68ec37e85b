"""``mmpipe train``: a training graph (text-to-video, or understand-then-generate) on local ranks.

Every micro-batch's inputs (which samples, which noise, which timestep) are a pure function of
``(train.seed, step, micro-batch)``, never of a running RNG, so a resumed run and an uninterrupted
run produce bitwise-identical loss trajectories, and the distributed runtime can reproduce the
single-process run exactly.

The training driver is a leaf: :mod:`~mmpipe.train.prepare` checks a config and writes the run
directory, :mod:`~mmpipe.train.data` turns samples into micro-batches, :mod:`~mmpipe.train.loop` is
one rank's loop, :mod:`~mmpipe.train.worker` the entry of a launched worker (``python -m
mmpipe.train.worker`` under torchrun) and :mod:`~mmpipe.train.driver` the ``mmpipe train`` call.
"""

from mmpipe.train.driver import train
from mmpipe.train.loop import TrainResult

__all__ = ["TrainResult", "train"]
