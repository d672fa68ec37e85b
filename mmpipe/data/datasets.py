"""The datasets a run's ``data`` config names: moving shapes, or a folder of videos with captions."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from torch.utils.data import Subset

from mmpipe.config import DataConfig
from mmpipe.data import FolderVideoDataset, MovingShapesDataset, caption_vocabulary

SizedDataset = MovingShapesDataset | FolderVideoDataset | Subset

#: the graph inputs a training micro-batch's collator (mmpipe.train.data.Collator) makes from a
#: sample's video; the others it makes from the caption
VIDEO_PORTS = frozenset({"video", "pixel_values"})


def input_keys(ports: Iterable[str], split: str, index: int, dropped: bool) -> dict[str, Hashable]:
    """What each graph input of one sample is a function of (the frozen-output cache's keys): the
    video's ports of the sample, the caption's ports of its caption. Every dropped caption is the
    same empty one, so a text encoder's output for it is computed once; a VAE's output does not
    depend on whether the caption was dropped."""
    caption: Hashable = "" if dropped else (split, index)
    return {p: (split, index) if p in VIDEO_PORTS else caption for p in ports}


def shapes_task(kind: str) -> str:
    """The moving-shapes task a model of ``model.kind`` trains on: an understand-then-generate model
    sees the first frame and an instruction ("make it move left"), the others a description."""
    return "instruct" if kind == "u2g" else "describe"


def build_datasets(data: DataConfig, kind: str = "t2v") -> tuple[SizedDataset, SizedDataset]:
    """(train, validation) datasets of a ``model.kind=kind`` run; moving shapes validation clips
    come from a different seed."""
    size = {"frames": data.frames, "height": data.height, "width": data.width}
    if data.root is None:
        task = shapes_task(kind)
        train = MovingShapesDataset(num_samples=data.num_samples, seed=data.seed, task=task, **size)
        val = MovingShapesDataset(num_samples=data.val_samples, seed=data.seed + 7919, task=task, **size)
        return train, val
    folder = FolderVideoDataset(root=data.root, captions_file=data.captions_file, **size)
    return folder, Subset(folder, range(min(data.val_samples, len(folder))))


def vocabulary(train_set: SizedDataset) -> list[str]:
    """Texts whose words the tiny preset's tokenizer must know: every caption of the data."""
    if isinstance(train_set, FolderVideoDataset):
        return [entry.caption for entry in train_set.entries]
    if isinstance(train_set, MovingShapesDataset):
        return caption_vocabulary(train_set.task)
    return caption_vocabulary()
