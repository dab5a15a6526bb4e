"""Messages between the first process of a slice and its workers: a replayed call's arguments as JSON.

Stage values the workers hold go as ids (each process keeps its own copy of what it computed); stage values
loaded from a file, and images, go as tensors in blobs (and the native bridge's serialized programs as bytes); settings (dataclasses the engine and the families declare
in the registry) go by value; the runtime and callbacks are each process's own.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from pathlib import Path
from typing import Any


def stage_value_types() -> dict[str, type]:
    from ..engine.stages import STAGE_VALUES

    return {c.__name__: c for c in STAGE_VALUES}


def plain_types() -> dict[str, type]:
    """Dataclasses a message may carry by value (settings), by name: the engine's and every family's."""
    from ..engine.attention import AttentionConfig
    from ..engine.lora import LoraSpec
    from ..engine.sharding import MeshSpec
    from ..engine.stages import SampleSettings, StepCache
    from ..families import registry

    return {c.__name__: c for c in (SampleSettings, StepCache, LoraSpec, AttentionConfig, MeshSpec,
                                    *registry.message_types())}


class Encoder:
    """Arguments -> JSON-able data. Stage values the workers hold go as ids; others (loaded from a stage file)
    as tensors in blobs; the runtime and callbacks are each process's own."""

    def __init__(self, known: "OrderedDict[int, None]", models: dict[int, int]):
        self.known, self.models = known, models
        self.blobs: dict[str, bytes] = {}
        self.paths: list[str] = []

    def __call__(self, value: Any) -> Any:
        import torch

        from ..engine.runtime import Runtime

        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, (bytes, bytearray)):  # a serialized program of the native bridge
            key = f"blob{len(self.blobs)}"
            self.blobs[key] = bytes(value)
            return {"__bytes__": key}
        if isinstance(value, Path):
            self.paths.append(str(value.expanduser()))
            return {"__path__": str(value)}
        if isinstance(value, (list, tuple)):
            return {"__tuple__": [self(v) for v in value]} if isinstance(value, tuple) else [self(v) for v in value]
        if isinstance(value, dict):
            return {"__dict__": [[self(k), self(v)] for k, v in value.items()]}
        if isinstance(value, Runtime):
            return {"__runtime__": True}
        if type(value).__module__.startswith("PIL.") and hasattr(value, "tobytes"):  # an image to encode
            import numpy as np

            key = f"blob{len(self.blobs)}"
            self.blobs[key] = tensor_bytes(torch.from_numpy(np.asarray(value.convert("RGB")).copy()))
            return {"__image__": key}
        if callable(value) and not dataclasses.is_dataclass(value):
            return {"__callback__": True}
        name = type(value).__name__
        if name in stage_value_types():
            rid = getattr(value, "replay_id", None)
            if rid in self.known:
                return {"__value__": rid}
            fields = {}
            for f in dataclasses.fields(value):
                v = getattr(value, f.name)
                if isinstance(v, torch.Tensor):
                    key = f"blob{len(self.blobs)}"
                    self.blobs[key] = tensor_bytes(v)
                    fields[f.name] = {"__blob__": key}
                else:
                    fields[f.name] = self(v)
            return {"__sent__": name, "fields": fields}
        if name in plain_types() and dataclasses.is_dataclass(value):
            if name == "LoraSpec":
                self.paths.append(str(Path(value.path).expanduser()))
            return {"__dc__": name, "fields": {f.name: self(getattr(value, f.name))
                                               for f in dataclasses.fields(value)}}
        if hasattr(value, "replay_id") and getattr(value, "replay_id") in self.models.values():
            return {"__model__": value.replay_id}
        raise TypeError(f"a replayed call cannot carry a {type(value).__name__}")


def tensor_bytes(t) -> bytes:
    from safetensors.torch import save

    return save({"t": t.detach().contiguous().cpu()})


def decode(value: Any, ctx) -> Any:
    if isinstance(value, list):
        return [decode(v, ctx) for v in value]
    if not isinstance(value, dict):
        return value
    if "__path__" in value:
        return Path(value["__path__"])
    if "__tuple__" in value:
        return tuple(decode(v, ctx) for v in value["__tuple__"])
    if "__dict__" in value:
        return {decode(k, ctx): decode(v, ctx) for k, v in value["__dict__"]}
    if "__runtime__" in value:
        return ctx.runtime
    if "__callback__" in value:
        return None
    if "__value__" in value:
        return ctx.values[value["__value__"]]
    if "__model__" in value:
        return ctx.models[value["__model__"]]
    if "__bytes__" in value:
        return ctx.blob(value["__bytes__"])
    if "__blob__" in value:
        from safetensors.torch import load

        return load(ctx.blob(value["__blob__"]))["t"]
    if "__image__" in value:
        from PIL import Image
        from safetensors.torch import load

        return Image.fromarray(load(ctx.blob(value["__image__"]))["t"].numpy(), "RGB")
    if "__sent__" in value:
        cls = stage_value_types()[value["__sent__"]]
        return cls(**{k: decode(v, ctx) for k, v in value["fields"].items()})
    if "__dc__" in value:
        cls = plain_types()[value["__dc__"]]
        return cls(**{k: decode(v, ctx) for k, v in value["fields"].items()})
    raise ValueError(f"unknown value in a replayed call: {sorted(value)}")
