"""ComfyUI nodes for CogVideoX on TPU/JAX: load, encode text (and the first frame, for the I2V models), sample,
decode.

Thin adapters: each node checks its inputs and calls ``tpu_runtime``; no model math lives here. The node kinds
are shared with Wan (``common.py``); this module sets CogVideoX's types, defaults and options.
"""

from __future__ import annotations

from .common import (
    DEVICE_INPUTS,
    DTYPE_INPUT,
    LAYOUT_INPUTS,
    ImageEncodeNode,
    LoraNode,
    TextEncodeNode,
    decode_latent,
    image_cond_input,
    install_comfy_unload_hook,  # noqa: F401 - kept importable from here for existing callers
    load_model,
    run_sampler,
    sampler_inputs,
    unload_all,  # noqa: F401
)

CATEGORY = "TPU video/CogVideoX"
MODEL_TYPE = "TPU_COGVIDEOX_MODEL"
EMBEDS_TYPE = "TPU_COGVIDEOX_EMBEDS"
IMAGE_TYPE = "TPU_COGVIDEOX_IMAGE"
NO_MODELS = "(no CogVideoX folder found: see model_path)"


def load_family(model_path: str, dtype: str, mesh: str = "auto", attention: str = "auto", cache_dir: str = "",
                vae_sharding: str = "auto", fsdp: bool = False):
    """Load (or reuse) a CogVideoX model; the same folder and settings share one copy of the weights on device."""
    from tpu_runtime.cogvideox import CogVideoXFamily, resolve_model_path

    folder, mesh = str(resolve_model_path(model_path.strip())), mesh.strip() or "auto"
    return load_model(("cogvideox", folder, dtype, mesh, attention, vae_sharding, bool(fsdp)),
                      lambda runtime: CogVideoXFamily(folder, dtype=dtype, runtime=runtime, mesh=mesh,
                                                      attention=attention, vae_sharding=vae_sharding,
                                                      fsdp=bool(fsdp)), cache_dir)


class TPUCogVideoXLoader:
    """Pick a CogVideoX folder from ComfyUI's model folders (or give a path); weights load onto the devices the
    first time a stage needs them, and the same model and settings are loaded once."""

    @classmethod
    def INPUT_TYPES(cls):
        from .model_folders import find_models

        names = sorted(find_models("cogvideox")) or [NO_MODELS]
        return {
            "required": {
                "model": (names, {"tooltip": "diffusers CogVideoX folders in models/diffusers and models/CogVideo"}),
                "dtype": DTYPE_INPUT,
            },
            "optional": {"model_path": ("STRING", {"default": "", "tooltip": "a folder anywhere (overrides model)"}),
                         **DEVICE_INPUTS, **LAYOUT_INPUTS},
        }

    RETURN_TYPES = (MODEL_TYPE,)
    RETURN_NAMES = ("model",)
    FUNCTION = "load"
    CATEGORY = CATEGORY
    DESCRIPTION = "Loads a CogVideoX text-to-video model (2b, 5b or 1.5) for the TPU/JAX runtime."

    def load(self, model: str, dtype: str, model_path: str = "", mesh: str = "auto", attention: str = "auto",
             cache_dir: str = "", vae_sharding: str = "auto", fsdp: bool = False):
        from .model_folders import folder_path

        path = model_path.strip() or str(folder_path("cogvideox", model))
        return (load_family(path, dtype, mesh, attention, cache_dir, vae_sharding, fsdp),)


class TPUCogVideoXTextEncode(TextEncodeNode):
    """T5 embeddings for a prompt and a negative prompt."""

    MODEL_TYPE, EMBEDS_TYPE = MODEL_TYPE, EMBEDS_TYPE
    RETURN_TYPES = (EMBEDS_TYPE,)
    CATEGORY = CATEGORY


class TPUCogVideoXLoRA(LoraNode):
    MODEL_TYPE = MODEL_TYPE
    RETURN_TYPES = (MODEL_TYPE,)
    CATEGORY = CATEGORY


class TPUCogVideoXSampler:
    """Denoise a video latent: one compiled program per shape, reused for every step and every seed."""

    @classmethod
    def INPUT_TYPES(cls):
        inputs = sampler_inputs(MODEL_TYPE, EMBEDS_TYPE, 720, 480, 49, "8N+1 for 2b/5b (49 native), 16N+1 for 1.5 "
                                "(81 native)", 6.0, ["ddim", "dpm"])
        return {"required": {**inputs, "dynamic_cfg": ("BOOLEAN", {"default": False})},
                "optional": image_cond_input(IMAGE_TYPE)}

    RETURN_TYPES = ("LATENT",)
    RETURN_NAMES = ("samples",)
    FUNCTION = "sample"
    CATEGORY = CATEGORY

    def sample(self, model, embeds, width, height, frames, steps, guidance, seed, scheduler, dynamic_cfg,
               image_cond=None):
        from tpu_runtime.family import SampleSettings

        settings = SampleSettings(height, width, frames, steps, guidance, seed,
                                  None if scheduler == "model default" else scheduler, dynamic_cfg)
        return run_sampler(model, embeds, settings, image_cond)


class TPUCogVideoXImageEncode(ImageEncodeNode):
    """CogVideoX-5b-I2V / 1.5-I2V: the first frame VAE-encoded on the devices; the sampler draws from it."""

    MODEL_TYPE, IMAGE_TYPE = MODEL_TYPE, IMAGE_TYPE
    RETURN_TYPES = (IMAGE_TYPE,)
    CATEGORY = CATEGORY
    SIZE = (720, 480, 49)
    FRAMES_TIP = "the sampler's frames: 8N+1 for 5b-I2V (49), 16N+1 for 1.5-I2V (81)"


class TPUCogVideoXDecode:
    """VAE decode to an IMAGE batch [frames, H, W, 3] for ComfyUI's CreateVideo / SaveVideo."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": (MODEL_TYPE,), "samples": ("LATENT",),
                             "tiling": ("BOOLEAN", {"default": False, "tooltip": "spatial tiles, for large frames"})}}

    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("frames",)
    FUNCTION = "decode"
    CATEGORY = CATEGORY

    def decode(self, model, samples, tiling):
        return decode_latent(model, samples, tiling=tiling)


NODE_CLASS_MAPPINGS = {
    "TPUCogVideoXLoader": TPUCogVideoXLoader,
    "TPUCogVideoXTextEncode": TPUCogVideoXTextEncode,
    "TPUCogVideoXImageEncode": TPUCogVideoXImageEncode,
    "TPUCogVideoXLoRA": TPUCogVideoXLoRA,
    "TPUCogVideoXSampler": TPUCogVideoXSampler,
    "TPUCogVideoXDecode": TPUCogVideoXDecode,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "TPUCogVideoXLoader": "CogVideoX Loader (TPU)",
    "TPUCogVideoXTextEncode": "CogVideoX Text Encode (TPU)",
    "TPUCogVideoXImageEncode": "CogVideoX Image Encode (TPU)",
    "TPUCogVideoXLoRA": "CogVideoX LoRA (TPU)",
    "TPUCogVideoXSampler": "CogVideoX Sampler (TPU)",
    "TPUCogVideoXDecode": "CogVideoX Decode (TPU)",
}
