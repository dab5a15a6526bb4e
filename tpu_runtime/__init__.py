"""TPU video runtime: CogVideoX and Wan on JAX through torchax.

Importing this package is cheap and touches no device; the runtime starts on first use (``get_runtime``).
"""

__version__ = "0.1.0"

__all__ = ["__version__", "get_runtime", "CogVideoXFamily", "WanFamily"]


def __getattr__(name):
    # Lazy: torch, jax and torchax load only when something is used.
    if name == "get_runtime":
        from .runtime import get_runtime

        return get_runtime
    if name == "CogVideoXFamily":
        from .cogvideox import CogVideoXFamily

        return CogVideoXFamily
    if name == "WanFamily":
        from .wan import WanFamily

        return WanFamily
    raise AttributeError(name)
