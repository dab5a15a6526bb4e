"""A model's torch components: how each is built and where its tensors are (``ComponentSource``), and the store
that loads each once, places it on the mesh by the family's rule table and frees the host copy (``Components``,
a part of ``ModelFamily``).

Components are built with their parameters on ``meta`` and filled from safetensors once (``weights.py``); an
abstract model (``plan``) builds them on ``meta`` and keeps shape structs as their state.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..errors import ModelFolderError
from .memory import gib, is_out_of_memory
from .weights import build_empty, keep_fp32_modules, load_into_meta_module, meta_tensors

log = logging.getLogger(__name__)


@dataclass
class ComponentSource:
    """How one torch component is built and where its tensors are: ``cls`` (its library's fp32 rules come from
    it), ``build()`` (the module from its config), the safetensors ``files``, ``names`` (file key -> module name;
    None: the same), file keys to ``ignore`` (regexes), ``dtype`` (None: the model's), and ``finish`` (what the
    module needs once built: our attention processor...)."""

    cls: type
    build: Callable[[], torch.nn.Module]
    files: list
    what: str
    names: "dict[str, str] | Callable[[list[str]], dict[str, str]] | None" = None
    ignore: tuple[str, ...] = ()
    dtype: torch.dtype | None = None
    finish: Callable[[torch.nn.Module], torch.nn.Module] | None = None


def model_class(library: str, name: str) -> type:
    """A class named in ``model_index.json`` (library, class name), e.g. ("diffusers", "AutoencoderKLWan")."""
    import importlib

    # diffusers names a model that lives in one of its pipeline packages by that package (["ltx2",
    # "LTX2TextConnectors"]), as its own loader resolves it.
    module = library if library in ("diffusers", "transformers") else f"diffusers.pipelines.{library}"
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        raise ModelFolderError(f"a component of library {library!r} cannot be loaded here (diffusers and "
                               "transformers models, and the models of diffusers' pipelines)") from None
    except AttributeError:
        raise ModelFolderError(f"{library} has no {name}: update diffusers/transformers, or re-download "
                               "model_index.json") from None


def builder(cls: type, config: dict) -> Callable[[], torch.nn.Module]:
    """``cls`` made from a saved config: diffusers' ``from_config``, transformers' config class."""
    if cls.__module__.startswith("diffusers."):
        return lambda: cls.from_config(config)
    kwargs = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("torch_dtype", "dtype")}
    return lambda: cls(cls.config_class(**kwargs))


class Components:
    """The component store of a model (a part of ``ModelFamily``). A family implements ``_source`` (how a
    component is built and loaded) and ``_load_tokenizer``; ``component(name)`` loads one on first use."""

    RULES: dict[str, tuple] = {}  # component -> sharding rule table
    # FSDP splits the transformers' and encoders' weights, never the VAE's: its weights are small (0.25 GiB for
    # Wan's) against its activations, gathering them would cost every convolution of every frame, and with them
    # split over dp and the frames over the width the Wan decode on an 8-device CPU mesh gave wrong frames (0.13
    # off; each split alone is exact).
    FSDP_SKIPS = ("vae",)

    def _init_components(self) -> None:
        self._parts: dict[str, object] = {}
        self._states: dict[str, dict] = {}

    def _source(self, name: str) -> ComponentSource:
        """How torch component ``name`` is built and loaded; ``KeyError`` for a component the model lacks."""
        raise KeyError(name)

    def _load_tokenizer(self):
        """The model's tokenizer (a host object, never placed)."""
        raise KeyError("tokenizer")

    def rules_for(self, name: str):
        """The sharding rule table for component ``name``."""
        return self.RULES.get(name, ())

    def fsdp_for(self, name: str) -> bool:
        """Whether component ``name``'s weights are split over dp too (FSDP)."""
        return self.fsdp and name not in self.FSDP_SKIPS

    def component(self, name: str):
        """Component ``name`` (its module, built once; its parameters on ``meta`` once placed), loaded on first
        use: torch modules are moved to the devices and their host copy freed. An abstract model builds the
        module on ``meta`` and keeps shape structs as its state."""
        if name in self._parts:
            return self._parts[name]
        start = time.perf_counter()
        if name == "tokenizer":
            part = self._load_tokenizer()
        else:
            part = self._place(name)
        self._parts[name] = part
        seconds = time.perf_counter() - start
        self.timings.load += seconds
        log.info("loaded %s in %.1f s", self._origin(name), seconds)
        return part

    _component = component  # the name the families' stage programs use

    def state(self, name: str) -> dict:
        """Component ``name``'s weights on the devices (name -> array; shape structs when abstract), loaded on
        first use."""
        self.component(name)
        return self._states[name]

    def _place(self, name: str) -> torch.nn.Module:
        try:
            part = self._build_component(name).requires_grad_(False)
        except KeyError:
            if self.abstract:
                raise RuntimeError(f"{self.label} is planned for devices this process cannot run on: it has no "
                                   f"{name} to use; compile its stage programs with plan") from None
            raise
        if self.abstract:
            self._states[name] = self.runtime.abstract_state(part, self.mesh, self.rules_for(name),
                                                             self.fsdp_for(name))
        else:
            try:
                self._states[name] = self.runtime.module_state(part, self.mesh, self.rules_for(name),
                                                               fsdp=self.fsdp_for(name))
            except Exception as error:  # noqa: BLE001 - the devices' own errors, named for the user where we can
                if not is_out_of_memory(error):
                    raise
                size = sum(t.numel() * t.element_size() for t in [*part.parameters(), *part.buffers()])
                raise self.memory_error(self._origin(name), "while placing its weights", error,
                                        needs=f"its weights are {gib(size)} ({self.dtype_name}) in all") from error
            # The device copy is the one used from now on; free the host copy (real models are many GB).
            part.to("meta")
        return part

    def _build_component(self, name: str) -> torch.nn.Module:
        """Component ``name`` as a host module: loaded from its files, or (abstract) built without tensors."""
        source = self._source(name)
        dtype = source.dtype or self.dtype
        keep = keep_fp32_modules(source.cls, dtype)
        if self.abstract:
            part = build_empty(source.build, dtype, keep)
        else:
            from .weights import TensorSource

            tensors = TensorSource(source.files)
            names = source.names
            if callable(names):
                names = names(tensors.keys())
            elif names is None:
                names = {k: k for k in tensors.keys()}
            part = load_into_meta_module(source.build, tensors, names, dtype, source.what, keep_fp32=keep,
                                         ignore=source.ignore)
            left = meta_tensors(part)
            if left:
                raise ModelFolderError(f"{source.what} left {len(left)} tensor(s) unset (e.g. {left[:3]})")
        return source.finish(part) if source.finish is not None else part

    def _origin(self, name: str) -> str:
        """Where component ``name`` is read from, for messages."""
        return f"{self.label}/{name}"

    def source_paths(self) -> list[Path]:
        """The files and folders the model is read from (every host of a slice must have the same)."""
        return [self.path]

    def release_components(self) -> None:
        """Drop every component and the device copies of the weights."""
        self._states.clear()
        self._parts.clear()
