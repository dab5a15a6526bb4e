"""The native bridge: ComfyUI's own torch modules (diffusion models, VAEs, text encoders) run on the runtime.

- ``calls.py``: a call split into the program's array inputs and what the program is compiled for;
- ``program.py``: ``BridgedModule``, any module's method as compiled programs over weights placed once;
- ``rules.py``: where each architecture's weights go on the mesh, in ComfyUI's module names;
- ``comfy.py``: the ComfyUI side (ModelPatcher clones, attention, LoRA patches, unloading); ``text.py``,
  ``vae.py`` and ``vision.py`` the text encoders', VAEs' and CLIP vision models';
- ``auto.py``: the automatic mode (every model ComfyUI's loaders load on the runtime, the graph unchanged).

Importing this package needs neither ComfyUI nor a device.
"""
