"""Where a stage's module comes from: an existing object or a local ``from_pretrained`` directory."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Self

from diffusers.configuration_utils import FrozenDict
from torch import nn
from transformers import AutoConfig

from mmpipe.errors import loading_errors
from mmpipe.graph import Stage


@dataclasses.dataclass(frozen=True)
class ModuleSource:
    """A module's config (known without building it) and a loader that builds it."""

    config: Any
    load: Callable[[], nn.Module]

    @classmethod
    def from_module(cls, module: nn.Module) -> ModuleSource:
        """Wrap an already built module (e.g. a component of a diffusers pipeline object)."""
        return cls(config=module.config, load=lambda: module)

    @classmethod
    def from_pretrained(cls, model_cls: Any, path: str | Path, **kwargs: Any) -> ModuleSource:
        """Load lazily from a local directory; never a hub id (nothing is downloaded at run time)."""
        path = Path(path)
        if not path.is_dir():
            raise ValueError(f"{model_cls.__name__}: {str(path)!r} is not a local directory")
        if hasattr(model_cls, "load_config"):  # diffusers ModelMixin: a FrozenDict with attribute access
            config: Any = FrozenDict(model_cls.load_config(path))
        else:  # transformers PreTrainedModel
            config = AutoConfig.from_pretrained(path)

        def load() -> nn.Module:  # on the rank that runs the stage
            with loading_errors(f"{model_cls.__name__} from {str(path)!r}"):
                return model_cls.from_pretrained(path, **kwargs)

        return cls(config=config, load=load)


class SourcedStage(Stage):
    """A stage whose module is a ``model_cls`` from a :class:`ModuleSource`."""

    model_cls: ClassVar[Any]

    def __init__(self, name: str, source: ModuleSource, *, frozen: bool) -> None:
        super().__init__(name, frozen=frozen)
        self.source = source

    @classmethod
    def from_pretrained(cls, name: str, path: str | Path, *args: Any, **kw: Any) -> Self:
        """Load the module lazily from a local directory; other arguments go to the constructor."""
        return cls(name, ModuleSource.from_pretrained(cls.model_cls, path), *args, **kw)

    @classmethod
    def from_module(cls, name: str, module: nn.Module, *args: Any, **kw: Any) -> Self:
        """Wrap an existing module (e.g. a component of a diffusers pipeline object)."""
        return cls(name, ModuleSource.from_module(module), *args, **kw)

    def build(self) -> nn.Module:
        return self.source.load()
