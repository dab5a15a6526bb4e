"""ComfyUI node classes. Importing them needs neither ComfyUI nor a device."""

from . import cogvideox_nodes, wan_nodes

NODE_CLASS_MAPPINGS = {**cogvideox_nodes.NODE_CLASS_MAPPINGS, **wan_nodes.NODE_CLASS_MAPPINGS}
NODE_DISPLAY_NAME_MAPPINGS = {**cogvideox_nodes.NODE_DISPLAY_NAME_MAPPINGS, **wan_nodes.NODE_DISPLAY_NAME_MAPPINGS}

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
