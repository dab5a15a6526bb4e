"""TPU video nodes: a ComfyUI custom node pack running video diffusion models on TPU (and any JAX backend) through
torchax: CogVideoX, Wan and LTX-2 as the pack's own families, and ComfyUI's own models through the native bridge.

ComfyUI imports this file at start-up. It only registers node classes, the settings dialog's extension (``web/``)
and, for the automatic mode (``TPU_VIDEO_AUTO``), a hook on ComfyUI's executor: no device is touched until a node
runs. A bad value of ``TPU_VIDEO_AUTO`` stops ComfyUI's start-up with a message naming the valid values.
"""

import os
import sys

# The engine is imported as `tpu_runtime` everywhere (one module, one runtime). When ComfyUI loads this folder
# without `pip install`, make that name importable from here.
_here = os.path.dirname(os.path.abspath(__file__))
if _here not in sys.path:
    sys.path.append(_here)

if __package__:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: E402
    from .nodes.common import install_comfy_unload_hook  # noqa: E402
    from .nodes.migration import install_route as _install_migration_route  # noqa: E402
else:  # imported as a plain module: pytest does so when the clone's folder name is no Python name ("pack.v2")
    from nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: E402
    from nodes.common import install_comfy_unload_hook  # noqa: E402
    from nodes.migration import install_route as _install_migration_route  # noqa: E402

from tpu_runtime.bridge import auto as _automatic_mode  # noqa: E402

install_comfy_unload_hook()  # ComfyUI's "free memory" also frees our device buffers
_install_migration_route(NODE_CLASS_MAPPINGS)  # the page brings workflows saved with older inputs up to date
try:
    _automatic_mode.start()  # TPU_VIDEO_AUTO: every loaded model on the runtime
except _automatic_mode.AutoModeError as _error:
    raise SystemExit(f"TPU video nodes: {_error}") from None

WEB_DIRECTORY = "./web"  # the settings dialog's entries, the runtime's notices (toasts); older saved workflows migrated

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
