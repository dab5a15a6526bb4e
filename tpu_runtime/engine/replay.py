"""How a family's calls reach every process of a multi-host slice, seen from the engine.

- ``replayed_init`` / ``replayed_method``: a family's construction and its stage calls (``ModelFamily`` wraps
  every stage its declaration names), run on every process of a slice when called on its first process. They
  reach the slice through the model's runtime (``runtime.slice``), never through an import.
- ``join_from_environment``: what the runtime calls before JAX starts a backend. The multi-host layer
  (``tpu_runtime.multihost``) installs the joiner when it is imported; the engine never imports it.
"""

from __future__ import annotations

import functools
import os
from typing import Callable

ENABLE_ENV = "TPU_VIDEO_MULTIHOST"
_joiner: Callable[[], object] | None = None


def install_joiner(joiner: Callable[[], object]) -> None:
    """``joiner()`` joins the slice the environment describes and returns it (the multi-host layer's)."""
    global _joiner
    _joiner = joiner


def multihost_requested() -> bool:
    return os.environ.get(ENABLE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def join_from_environment():
    """The slice this process joins (``TPU_VIDEO_MULTIHOST=1``), or None for a single process."""
    if not multihost_requested():
        return None
    if _joiner is None:
        from ..errors import SliceError

        raise SliceError(f"{ENABLE_ENV} is set but the multi-host layer is not loaded: import tpu_runtime.multihost")
    return _joiner()


def replayed_method(method):
    """``method`` of a family, run on every process of the slice when this is its first process."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        slice_ = getattr(getattr(self, "runtime", None), "slice", None)
        if slice_ is None or not slice_.is_driver or getattr(self, "abstract", False):
            return method(self, *args, **kwargs)
        return slice_.call("call", self, method.__name__, args, kwargs,
                           lambda a, k: method(self, *a, **k))

    wrapper.replayed = True
    return wrapper


def replayed_init(init):
    """A family's ``__init__``, then the same construction on every worker (files checked there first)."""

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        init(self, *args, **kwargs)
        slice_ = getattr(self.runtime, "slice", None)
        if slice_ is None or not slice_.is_driver or self.abstract or slice_.nested():
            return
        slice_.open_model(self, args, kwargs)

    wrapper.replayed = True
    return wrapper
