"""TPU video runtime: open video diffusion models on JAX through torchax.

The package is laid out by role:

- ``engine/``: what every model family shares: the runtime (backend, devices, meshes, compiled programs),
  sharding, attention, weight loading, schedulers, LoRA, stage values, streamed VAE programs, the family base
  class and the settings families declare;
- ``families/``: one package per model family (``cogvideox/``, ``wan/``, ``ltx2/``), each declaring itself once,
  and the registry that picks one;
- ``bridge/``: the native bridge: ComfyUI's own models (their torch modules, in the user's graph) on the runtime;
- ``multihost/``: slices of several hosts (transport, message codec, worker; the engine's side is
  ``engine/replay.py``);
- ``tools/``: the command line (``generate``, ``demo``, ``bench``, ``plan``, ``worker``), stage files, video.

Importing this package is cheap and touches no device; the runtime starts on first use (``get_runtime``).
"""

__version__ = "0.1.0"

__all__ = ["__version__", "get_runtime", "open_model"]


def __getattr__(name):
    # Lazy: torch, jax and torchax load only when something is used.
    if name == "get_runtime":
        from . import multihost  # noqa: F401 - installs the slice joiner the runtime calls
        from .engine.runtime import get_runtime

        return get_runtime
    if name == "open_model":
        from .families.registry import open_model

        return open_model
    raise AttributeError(name)
