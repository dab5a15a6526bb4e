"""ComfyUI node classes: every registered family's, made from its declaration by the node kinds (``kinds.py``).
Importing them needs neither ComfyUI nor a device."""

from tpu_runtime.families import registry

from .kinds import family_nodes

NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}
for _spec in registry.FAMILIES:
    _classes, _titles = family_nodes(_spec)
    NODE_CLASS_MAPPINGS.update(_classes)
    NODE_DISPLAY_NAME_MAPPINGS.update(_titles)

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
