"""ComfyUI node classes: every registered family's, made from its declaration by the node kinds (``kinds.py``), and
the native bridge's (``bridge.py``: ComfyUI's own models on the runtime). Importing them needs neither ComfyUI nor
a device."""

import tpu_runtime.multihost  # noqa: F401 - installs the slice joiner: ComfyUI may be a slice's first process
from tpu_runtime.families import registry

from . import bridge
from .comfy_bridge import show_compile_progress_on_the_node, show_notices_in_the_page
from .kinds import family_nodes

show_notices_in_the_page()  # the runtime's notices (a model left on the host) reach the page, not only the log
show_compile_progress_on_the_node()  # what compiles, and for how long, on the node that runs it

NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}
for _spec in registry.FAMILIES:
    _classes, _titles = family_nodes(_spec)
    NODE_CLASS_MAPPINGS.update(_classes)
    NODE_DISPLAY_NAME_MAPPINGS.update(_titles)

NODE_CLASS_MAPPINGS.update(bridge.NODE_CLASS_MAPPINGS)
NODE_DISPLAY_NAME_MAPPINGS.update(bridge.NODE_DISPLAY_NAME_MAPPINGS)

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
