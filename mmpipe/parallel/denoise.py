"""One request's denoising split over ranks: CFG-parallel branches and sequence-parallel frames.

A denoise group of ``cfg x ring x ulysses`` ranks runs the loop of one request together (xDiT's
CFG x USP layout). Every rank holds the whole latents and steps the scheduler on them; per step,
each rank runs the DiT on its share only:

- **CFG parallel** (``cfg=2``): rank row 0 runs the conditional branch, row 1 the unconditional one
  (with guidance off both rows run the conditional branch, and nothing is saved).
- **Sequence parallel** (``ulysses x ring > 1``): within a row, each rank takes a contiguous range
  of whole latent frames (the DiT's tokens are frame-major, so a frame range is a token range);
  the training path's attention core (:mod:`mmpipe.parallel.sequence`) and the stages' DiT hooks
  (:mod:`mmpipe.stages.dit`) make its self-attention see the whole sequence.

One ``all_gather`` over the group per step then gives every rank both branches' whole predictions,
so guidance and the scheduler step run on every rank on the same numbers as in one process, the
latents stay replicated, and any scheduler works (multistep ones included: nothing assumes the
step is elementwise). The gathered predictions are the size of the latents (kilobytes to a few
megabytes), against a DiT forward per step.

Legend: B batch, Z latent channels, t/h/w latent frames/height/width, n branches a rank computes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mmpipe.parallel.attention import select_backend
from mmpipe.parallel.modules import SequenceState
from mmpipe.parallel.sequence import SequenceLayout, SequenceMesh

#: the branches of classifier-free guidance, in the order the loops run them
COND, UNCOND = "cond", "uncond"


@dataclasses.dataclass(frozen=True)
class DenoiseLayout:
    """The degrees of one request's denoise group: ``cfg`` (1 or 2) x ``ring`` x ``ulysses`` ranks."""

    cfg: int = 1
    ulysses: int = 1
    ring: int = 1

    def __post_init__(self) -> None:
        if self.cfg not in (1, 2):
            raise ValueError(f"cfg={self.cfg}: classifier-free guidance has two branches; cfg must be 1 or 2")
        for key in ("ulysses", "ring"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)}: must be >= 1")

    @property
    def sp(self) -> int:
        """Sequence-parallel ranks per branch row."""
        return self.ulysses * self.ring

    @property
    def size(self) -> int:
        """Ranks of the group."""
        return self.cfg * self.sp

    def frame_ranges(self, frames: int) -> list[tuple[int, int]]:
        """The latent-frame range of each sequence-parallel index (contiguous, floor shares)."""
        lay = SequenceLayout(self.ulysses, self.ring)
        return [lay.ranges(frames, i)[0] if lay.size(frames, i) else (0, 0) for i in range(self.sp)]

    def check_frames(self, frames: int, *, key: str = "denoise") -> None:
        """Every sequence-parallel rank needs at least one latent frame."""
        if self.sp > frames:
            raise ValueError(
                f"{key}: ulysses x ring = {self.sp} ranks split {frames} latent frames, but every "
                f"sequence-parallel rank needs at least one frame (use fewer ranks or more frames)"
            )


class DenoiseGroup:
    """This rank's place in a denoise group, and the per-step exchange of its predictions.

    Built on every rank of the world (process groups are created collectively), in the same order;
    ``ranks`` lists the group's global ranks, row-major over ``(cfg, ring, ulysses)``.
    """

    def __init__(
        self, layout: DenoiseLayout, ranks: Sequence[int], *, device_type: str = "cpu", attention: str = "torch"
    ) -> None:
        if len(ranks) != layout.size:
            raise ValueError(
                f"a denoise group of cfg={layout.cfg} x ring={layout.ring} x ulysses={layout.ulysses} "
                f"needs {layout.size} ranks, got {list(ranks)}"
            )
        self.layout, self.ranks = layout, tuple(ranks)
        grid = torch.tensor(self.ranks).view(layout.cfg, layout.ring, layout.ulysses)
        mesh = DeviceMesh(device_type, grid, mesh_dim_names=("cfg", "ring", "ulysses"))
        self.member = dist.get_rank() in self.ranks
        # every rank of the world takes part in creating every group (new_group is collective)
        self.group = dist.new_group(list(self.ranks)) if layout.size > 1 else None
        self.sequence: SequenceMesh | None = None
        #: the DiT hooks' view of the sequence (``None`` without sequence parallelism)
        self.state: SequenceState | None = None
        self.row = 0
        if self.member:
            self.row = mesh["cfg"].get_local_rank()
            if layout.sp > 1:
                self.sequence = SequenceMesh.from_device_mesh(mesh, zigzag=False)
                self.state = SequenceState(self.sequence, select_backend(attention))

    def tokens(self, frames: int, per_frame: int) -> contextlib.AbstractContextManager[None]:
        """Around a DiT forward on this rank's frames: its attention sees ``frames x per_frame`` tokens."""
        if self.state is None:
            return contextlib.nullcontext()
        return self.state.tokens(frames * per_frame, unit=per_frame)

    @property
    def index(self) -> int:
        """This rank's sequence-parallel index in its row."""
        return self.sequence.index if self.sequence is not None else 0

    def branches(self, guided: bool, row: int | None = None) -> tuple[str, ...]:
        """The guidance branches the ranks of ``row`` (this rank's by default) run each step."""
        row = self.row if row is None else row
        if not guided:
            return (COND,)
        if self.layout.cfg == 2:
            return (COND,) if row == 0 else (UNCOND,)
        return (COND, UNCOND)

    def local(self, x_BZthw: torch.Tensor) -> torch.Tensor:
        """This rank's latent frames (dim 2) of the whole ``x``."""
        if self.layout.sp == 1:
            return x_BZthw
        a, b = self.layout.frame_ranges(x_BZthw.shape[2])[self.index]
        return x_BZthw[:, :, a:b]

    def gather(self, preds: dict[str, torch.Tensor], frames: int, guided: bool) -> dict[str, torch.Tensor]:
        """Every branch's whole prediction, from each rank's ``{branch: its frames' prediction}``
        (:meth:`branches` order; one ``all_gather`` over the group; the identity on a group of one)."""
        if self.group is None:
            return preds
        lay = self.layout
        mine_nBZthw = torch.stack(list(preds.values()))
        if lay.sp == 1:  # CFG rows only: whole predictions, of any layout (packed image latents too)
            got = [torch.empty_like(mine_nBZthw) for _ in self.ranks]
            dist.all_gather(got, mine_nBZthw.contiguous(), group=self.group)
            rows: dict[str, torch.Tensor] = {}
            for row, piece in enumerate(got):
                for name, p in zip(self.branches(guided, row), piece, strict=True):
                    rows.setdefault(name, p)
            return rows
        ranges = lay.frame_ranges(frames)
        longest = max(b - a for a, b in ranges)
        pad = list(mine_nBZthw.shape)
        pad[3] = longest - mine_nBZthw.shape[3]
        padded = torch.cat([mine_nBZthw, mine_nBZthw.new_zeros(pad)], 3) if pad[3] else mine_nBZthw
        got = [torch.empty_like(padded) for _ in self.ranks]
        dist.all_gather(got, padded.contiguous(), group=self.group)
        whole: dict[str, list[torch.Tensor]] = {}
        for pos, piece in enumerate(got):  # row-major over (cfg, ring, ulysses): (row, sp index)
            row, index = divmod(pos, lay.sp)
            a, b = ranges[index]
            for name, p in zip(self.branches(guided, row), piece, strict=True):
                if len(whole.setdefault(name, [])) < lay.sp:  # guidance off under cfg=2: row 1 repeats row 0
                    whole[name].append(p[:, :, : b - a])
        return {name: torch.cat(parts, 2) for name, parts in whole.items()}
