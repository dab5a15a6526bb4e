"""ComfyUI nodes for CogVideoX on TPU/JAX: load, encode text, sample, decode.

Thin adapters: each node checks its inputs and calls ``tpu_runtime``; no model math lives here. Values between
nodes are CPU torch tensors in small dicts (ComfyUI can hold and cache them); device buffers stay in the runtime.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

CATEGORY = "TPU video/CogVideoX"
MODEL_TYPE = "TPU_COGVIDEOX_MODEL"
EMBEDS_TYPE = "TPU_COGVIDEOX_EMBEDS"

_models: dict[tuple[str, str, str, str], object] = {}  # (folder, dtype, mesh, attention) -> CogVideoXFamily
_models_lock = threading.Lock()


def _release_all() -> None:
    """Drop every loaded model's device buffers; the caller holds ``_models_lock``."""
    for family in _models.values():
        family.release()
    _models.clear()


def load_family(model_path: str, dtype: str, mesh: str = "auto", attention: str = "auto", cache_dir: str = ""):
    """Load (or reuse) a CogVideoX model; the same folder and settings share one copy of the weights on device.

    Loading a different model first releases the others: a video model fills an accelerator's memory, so holding
    two at once would run out of it.
    """
    from tpu_runtime.cogvideox import CogVideoXFamily, resolve_model_path
    from tpu_runtime.runtime import get_runtime

    key = (str(resolve_model_path(model_path.strip())), dtype, mesh.strip() or "auto", attention)
    with _models_lock:
        family = _models.get(key)
        if family is None:
            runtime = get_runtime(cache_dir=cache_dir.strip() or None)
            _release_all()
            family = CogVideoXFamily(key[0], dtype=dtype, runtime=runtime, mesh=key[2], attention=attention)
            _models[key] = family
        return family


def unload_all() -> None:
    """Release every loaded model's device buffers."""
    with _models_lock:
        _release_all()


def install_comfy_unload_hook() -> bool:
    """Make ComfyUI's "unload models" / "free memory" (``comfy.model_management.unload_all_models``) release our
    device buffers too. Cheap and device-free: safe at pack import. Returns whether ComfyUI was there."""
    try:
        import comfy.model_management as mm
    except ImportError:
        return False
    original = mm.unload_all_models
    if getattr(original, "tpu_video_hooked", False):
        return True

    def unload_all_models(*args, **kwargs):
        unload_all()
        return original(*args, **kwargs)

    unload_all_models.tpu_video_hooked = True
    mm.unload_all_models = unload_all_models
    return True


NO_MODELS = "(no CogVideoX folder found: see model_path)"


class TPUCogVideoXLoader:
    """Pick a CogVideoX folder from ComfyUI's model folders (or give a path); weights load onto the devices the
    first time a stage needs them, and the same model and settings are loaded once."""

    @classmethod
    def INPUT_TYPES(cls):
        from .model_folders import find_models

        names = sorted(find_models()) or [NO_MODELS]
        return {
            "required": {
                "model": (names, {"tooltip": "diffusers CogVideoX folders in models/diffusers and models/CogVideo"}),
                "dtype": (["auto", "bfloat16", "float32"], {"default": "auto",
                          "tooltip": "auto: bfloat16 on TPU/GPU, float32 on CPU"}),
            },
            "optional": {
                "model_path": ("STRING", {"default": "", "tooltip": "a folder anywhere (overrides model)"}),
                "mesh": ("STRING", {"default": "auto", "tooltip": "dp=N,sp=N,tp=N over all devices; auto: CFG "
                         "batch on dp, heads on tp (dp=2,tp=4 on a v6e-8)"}),
                "attention": (["auto", "splash", "cudnn", "blockwise", "reference"], {"default": "auto",
                              "tooltip": "auto: splash on TPU, cuDNN on GPU, blockwise on CPU"}),
                "cache_dir": ("STRING", {"default": "", "tooltip": "persistent XLA compilation cache; empty: "
                              "$TPU_VIDEO_CACHE_DIR or ~/.cache/tpu_video_nodes/xla_cache (one per process)"}),
            },
        }

    RETURN_TYPES = (MODEL_TYPE,)
    RETURN_NAMES = ("model",)
    FUNCTION = "load"
    CATEGORY = CATEGORY
    DESCRIPTION = "Loads a CogVideoX text-to-video model (2b, 5b or 1.5) for the TPU/JAX runtime."

    def load(self, model: str, dtype: str, model_path: str = "", mesh: str = "auto", attention: str = "auto",
             cache_dir: str = ""):
        from tpu_runtime.errors import ModelFolderError

        from .model_folders import find_models, search_roots

        path = model_path.strip()
        if not path:
            found = find_models()
            if model not in found:
                looked = ", ".join(str(r) for r in search_roots()) or "(no model folders configured)"
                raise ModelFolderError(
                    f"CogVideoX model {model!r} not found. Looked in: {looked}. Put a diffusers CogVideoX folder "
                    "(with model_index.json) into one of them, or give its path in model_path"
                )
            path = str(found[model])
        return (load_family(path, dtype, mesh, attention, cache_dir),)


class TPUCogVideoXTextEncode:
    """T5 embeddings for a prompt and a negative prompt."""

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": (MODEL_TYPE,),
                "prompt": ("STRING", {"multiline": True, "default": ""}),
                "negative_prompt": ("STRING", {"multiline": True, "default": ""}),
            }
        }

    RETURN_TYPES = (EMBEDS_TYPE,)
    RETURN_NAMES = ("embeds",)
    FUNCTION = "encode"
    CATEGORY = CATEGORY

    def encode(self, model, prompt: str, negative_prompt: str):
        return (model.encode(prompt, negative_prompt),)


class TPUCogVideoXSampler:
    """Denoise a video latent: one compiled program per shape, reused for every step and every seed."""

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": (MODEL_TYPE,),
                "embeds": (EMBEDS_TYPE,),
                "width": ("INT", {"default": 720, "min": 16, "max": 4096, "step": 16}),
                "height": ("INT", {"default": 480, "min": 16, "max": 4096, "step": 16}),
                "frames": ("INT", {"default": 49, "min": 1, "max": 1024, "step": 1,
                           "tooltip": "8N+1 for 2b/5b (49 native), 16N+1 for 1.5 (81 native)"}),
                "steps": ("INT", {"default": 50, "min": 1, "max": 1000}),
                "guidance": ("FLOAT", {"default": 6.0, "min": 0.0, "max": 30.0, "step": 0.1}),
                "seed": ("INT", {"default": 0, "min": 0, "max": 0xFFFFFFFFFFFFFFFF, "control_after_generate": True}),
                "scheduler": (["model default", "ddim", "dpm"], {"default": "model default"}),
                "dynamic_cfg": ("BOOLEAN", {"default": False}),
            }
        }

    RETURN_TYPES = ("LATENT",)
    RETURN_NAMES = ("samples",)
    FUNCTION = "sample"
    CATEGORY = CATEGORY

    def sample(self, model, embeds, width, height, frames, steps, guidance, seed, scheduler, dynamic_cfg):
        from tpu_runtime.cogvideox import SampleSettings

        from .comfy_bridge import interrupt_requested, progress_bar, raise_if_interrupted

        settings = SampleSettings(height, width, frames, steps, guidance, seed,
                                  None if scheduler == "model default" else scheduler, dynamic_cfg)
        bar = progress_bar(steps)

        def on_step(i, total):
            if bar is not None:
                bar.update_absolute(i, total)

        try:
            latents = model.sample(embeds, settings, on_step=on_step, should_stop=interrupt_requested)
        except Exception:
            raise_if_interrupted()  # a cancelled prompt is reported as cancelled, not as an error
            raise
        return ({"samples": latents.latents, "tpu_video": latents},)


class TPUCogVideoXDecode:
    """VAE decode to an IMAGE batch [frames, H, W, 3] for ComfyUI's CreateVideo / SaveVideo."""

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": (MODEL_TYPE,),
                "samples": ("LATENT",),
                "tiling": ("BOOLEAN", {"default": False, "tooltip": "spatial tiles, for large frames"}),
            }
        }

    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("frames",)
    FUNCTION = "decode"
    CATEGORY = CATEGORY

    def decode(self, model, samples, tiling):
        from tpu_runtime.cogvideox import VideoLatents
        from tpu_runtime.errors import StageFileError

        from .comfy_bridge import progress_bar

        z = samples["samples"]
        info = samples.get("tpu_video")
        if isinstance(info, VideoLatents) and tuple(info.latents.shape) == tuple(z.shape):
            latents = VideoLatents(z, info.height, info.width, info.num_frames, info.model_signature)
        else:
            # A plain LATENT (e.g. after ComfyUI's own latent nodes): sizes follow from its shape.
            if z.ndim != 5:
                raise StageFileError(f"LATENT samples have shape {tuple(z.shape)}; CogVideoX decodes video latents "
                                     "[B, C, T, H/8, W/8]: connect a video sampler's output")
            s, t = model.vae_scale_spatial, model.vae_scale_temporal
            latents = VideoLatents(z, z.shape[3] * s, z.shape[4] * s, (z.shape[2] - 1) * t + 1, model.signature)
        bar = progress_bar(1)
        frames = model.decode(latents, tiling=tiling)
        if bar is not None:
            bar.update_absolute(1, 1)
        return (frames,)


NODE_CLASS_MAPPINGS = {
    "TPUCogVideoXLoader": TPUCogVideoXLoader,
    "TPUCogVideoXTextEncode": TPUCogVideoXTextEncode,
    "TPUCogVideoXSampler": TPUCogVideoXSampler,
    "TPUCogVideoXDecode": TPUCogVideoXDecode,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "TPUCogVideoXLoader": "CogVideoX Loader (TPU)",
    "TPUCogVideoXTextEncode": "CogVideoX Text Encode (TPU)",
    "TPUCogVideoXSampler": "CogVideoX Sampler (TPU)",
    "TPUCogVideoXDecode": "CogVideoX Decode (TPU)",
}
