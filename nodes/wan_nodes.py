"""ComfyUI nodes for Wan (2.1, 2.2 A14B, TI2V-5B; I2V, FLF2V) on TPU/JAX: the same node kinds as CogVideoX.

Two loaders make the same model type: one for diffusers folders, one for ComfyUI's own single files (the files
ComfyUI's Wan templates use: diffusion model, umT5 text encoder, VAE; for Wan 2.2 A14B a second, low-noise
diffusion model). Options that do not apply to the loaded model are refused with a message, never ignored.
"""

from __future__ import annotations

from pathlib import Path

from .common import (
    DEVICE_INPUTS,
    DTYPE_INPUT,
    EXPERTS,
    LAYOUT_INPUTS,
    ImageEncodeNode,
    LoraNode,
    TextEncodeNode,
    decode_latent,
    image_cond_input,
    load_model,
    run_sampler,
    sampler_inputs,
)

CATEGORY = "TPU video/Wan"
MODEL_TYPE = "TPU_WAN_MODEL"
EMBEDS_TYPE = "TPU_WAN_EMBEDS"
IMAGE_TYPE = "TPU_WAN_IMAGE"
NO_MODELS = "(no Wan folder found: see model_path)"
NO_FILES = "(none found)"
NONE = "none"


def _device_kwargs(dtype, mesh, attention, vae_sharding, fsdp):
    return dict(dtype=dtype, mesh=mesh.strip() or "auto", attention=attention, vae_sharding=vae_sharding,
                fsdp=bool(fsdp))


class TPUWanLoader:
    """Pick a Wan diffusers folder from ComfyUI's models/diffusers (or give a path)."""

    @classmethod
    def INPUT_TYPES(cls):
        from .model_folders import find_models

        names = sorted(find_models("wan")) or [NO_MODELS]
        return {
            "required": {"model": (names, {"tooltip": "diffusers Wan folders (model_index.json) in models/diffusers"}),
                         "dtype": DTYPE_INPUT},
            "optional": {"model_path": ("STRING", {"default": "", "tooltip": "a folder anywhere (overrides model)"}),
                         **DEVICE_INPUTS, **LAYOUT_INPUTS},
        }

    RETURN_TYPES = (MODEL_TYPE,)
    RETURN_NAMES = ("model",)
    FUNCTION = "load"
    CATEGORY = CATEGORY
    DESCRIPTION = ("Loads a Wan model from a diffusers folder (Wan2.1-T2V-1.3B/14B, Wan2.2-T2V-A14B, Wan2.2-TI2V-5B; "
                   "image-to-video: Wan2.1-I2V-14B-480P/720P, Wan2.1-FLF2V-14B, Wan2.2-I2V-A14B) for the TPU/JAX "
                   "runtime.")

    def load(self, model: str, dtype: str, model_path: str = "", mesh: str = "auto", attention: str = "auto",
             cache_dir: str = "", vae_sharding: str = "auto", fsdp: bool = False):
        from tpu_runtime.wan import WanFamily

        from .model_folders import folder_path

        folder = str(Path(model_path.strip() or folder_path("wan", model)).expanduser())
        key = ("wan", folder, dtype, mesh.strip() or "auto", attention, vae_sharding, bool(fsdp))
        device = _device_kwargs(dtype, mesh, attention, vae_sharding, fsdp)
        return (load_model(key, lambda rt: WanFamily(folder, runtime=rt, **device), cache_dir),)


class TPUWanModelFilesLoader:
    """Wan from the files ComfyUI's own Wan templates use, picked from ComfyUI's model folders."""

    @classmethod
    def INPUT_TYPES(cls):
        from .model_folders import find_files

        def names(kind, optional=False):
            found = sorted(find_files(kind))
            return ([NONE] if optional else []) + (found or ([] if optional else [NO_FILES]))

        return {
            "required": {
                "diffusion_model": (names("diffusion_models"), {"tooltip": "models/diffusion_models: e.g. "
                                    "wan2.1_t2v_1.3B_fp16; for Wan 2.2 A14B the high-noise file"}),
                "text_encoder": (names("text_encoders"), {"tooltip": "models/text_encoders: umt5_xxl_fp16 or "
                                 "umt5_xxl_fp8_e4m3fn_scaled"}),
                "vae": (names("vae"), {"tooltip": "models/vae: wan_2.1_vae (wan2.2_vae for TI2V-5B)"}),
                "dtype": DTYPE_INPUT,
            },
            "optional": {
                "diffusion_model_2": (names("diffusion_models", optional=True), {
                    "default": NONE, "tooltip": "Wan 2.2 A14B only: the low-noise file"}),
                **DEVICE_INPUTS,
                "clip_vision": (names("clip_vision", optional=True), {
                    "default": NONE, "tooltip": "Wan 2.1 I2V / FLF2V only: models/clip_vision/clip_vision_h"}),
                **LAYOUT_INPUTS,
            },
        }

    RETURN_TYPES = (MODEL_TYPE,)
    RETURN_NAMES = ("model",)
    FUNCTION = "load"
    CATEGORY = CATEGORY
    DESCRIPTION = ("Loads Wan from ComfyUI's single files (fp16, bf16, fp8 and scaled fp8 are dequantised on load); "
                   "the architecture is read from the weights.")

    def load(self, diffusion_model: str, text_encoder: str, vae: str, dtype: str, diffusion_model_2: str = NONE,
             mesh: str = "auto", attention: str = "auto", cache_dir: str = "", clip_vision: str = NONE,
             vae_sharding: str = "auto", fsdp: bool = False):
        from tpu_runtime.wan import WanFamily, WanFiles

        from .model_folders import file_path

        files = WanFiles(
            transformer=file_path("diffusion_models", diffusion_model),
            text_encoder=file_path("text_encoders", text_encoder),
            vae=file_path("vae", vae),
            transformer_2=None if diffusion_model_2 in (NONE, "") else file_path("diffusion_models",
                                                                                 diffusion_model_2),
            clip_vision=None if clip_vision in (NONE, "") else file_path("clip_vision", clip_vision),
        )
        key = ("wan-files", tuple(str(p) for p in vars(files).values()), dtype, mesh.strip() or "auto", attention,
               vae_sharding, bool(fsdp))
        device = _device_kwargs(dtype, mesh, attention, vae_sharding, fsdp)
        return (load_model(key, lambda rt: WanFamily(files=files, runtime=rt, **device), cache_dir),)


class TPUWanTextEncode(TextEncodeNode):
    """umT5 embeddings for a prompt and a negative prompt (512 tokens)."""

    MODEL_TYPE, EMBEDS_TYPE = MODEL_TYPE, EMBEDS_TYPE
    RETURN_TYPES = (EMBEDS_TYPE,)
    CATEGORY = CATEGORY


class TPUWanLoRA(LoraNode):
    MODEL_TYPE = MODEL_TYPE
    RETURN_TYPES = (MODEL_TYPE,)
    CATEGORY = CATEGORY

    @classmethod
    def INPUT_TYPES(cls):
        inputs = super().INPUT_TYPES()
        inputs["optional"] = {"expert": (EXPERTS, {"default": "both", "tooltip": "Wan 2.2 A14B: which expert gets "
                                                   "it (the lightx2v 2.2 LoRAs ship a high- and a low-noise file)"})}
        return inputs


class TPUWanSampler:
    """Denoise a video latent: one compiled program per shape (shared by Wan 2.2's two experts), reused for every
    step and every seed."""

    @classmethod
    def INPUT_TYPES(cls):
        inputs = sampler_inputs(MODEL_TYPE, EMBEDS_TYPE, 832, 480, 81, "4N+1 (81 native; TI2V-5B 121)", 5.0,
                                ["unipc", "euler", "euler_simple"])
        return {
            "required": {
                **inputs,
                "shift": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 100.0, "step": 0.1,
                                    "tooltip": "flow shift; 0: the model's (3 for 2.1, 12 for 2.2 A14B, 5 TI2V-5B)"}),
            },
            "optional": {
                "guidance_2": ("FLOAT", {"default": -1.0, "min": -1.0, "max": 30.0, "step": 0.1,
                                         "tooltip": "Wan 2.2 A14B: guidance of the low-noise expert; -1: same as "
                                         "guidance"}),
                "boundary": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 0.999, "step": 0.005,
                                       "tooltip": "Wan 2.2 A14B: switch to the low-noise expert below this fraction "
                                       "of the 1000 timesteps; 0: the model's (0.875 T2V, 0.9 I2V)"}),
                **image_cond_input(IMAGE_TYPE),
            },
        }

    RETURN_TYPES = ("LATENT",)
    RETURN_NAMES = ("samples",)
    FUNCTION = "sample"
    CATEGORY = CATEGORY

    def sample(self, model, embeds, width, height, frames, steps, guidance, seed, scheduler, shift,
               guidance_2=-1.0, boundary=0.0, image_cond=None):
        from tpu_runtime.family import SampleSettings

        settings = SampleSettings(height, width, frames, steps, guidance, seed,
                                  None if scheduler == "model default" else scheduler,
                                  shift=shift if shift > 0 else None,
                                  guidance_2=guidance_2 if guidance_2 >= 0 else None,
                                  boundary=boundary if boundary > 0 else None)
        return run_sampler(model, embeds, settings, image_cond)


class TPUWanImageEncode(ImageEncodeNode):
    """Wan I2V / FLF2V / 2.2 I2V-A14B / TI2V-5B: the first (and FLF2V's last) frame VAE-encoded on the devices,
    with CLIP vision features for Wan 2.1 I2V and FLF2V."""

    MODEL_TYPE, IMAGE_TYPE = MODEL_TYPE, IMAGE_TYPE
    RETURN_TYPES = (IMAGE_TYPE,)
    CATEGORY = CATEGORY
    SIZE = (832, 480, 81)
    FRAMES_TIP = "the sampler's frames: 4N+1 (81; TI2V-5B 121)"


class TPUWanDecode:
    """Wan VAE decode to an IMAGE batch [frames, H, W, 3] for ComfyUI's CreateVideo / SaveVideo."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": (MODEL_TYPE,), "samples": ("LATENT",)}}

    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("frames",)
    FUNCTION = "decode"
    CATEGORY = CATEGORY

    def decode(self, model, samples):
        return decode_latent(model, samples)


NODE_CLASS_MAPPINGS = {
    "TPUWanLoader": TPUWanLoader,
    "TPUWanModelFilesLoader": TPUWanModelFilesLoader,
    "TPUWanTextEncode": TPUWanTextEncode,
    "TPUWanImageEncode": TPUWanImageEncode,
    "TPUWanLoRA": TPUWanLoRA,
    "TPUWanSampler": TPUWanSampler,
    "TPUWanDecode": TPUWanDecode,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "TPUWanLoader": "Wan Loader (TPU)",
    "TPUWanModelFilesLoader": "Wan Loader from ComfyUI files (TPU)",
    "TPUWanTextEncode": "Wan Text Encode (TPU)",
    "TPUWanImageEncode": "Wan Image Encode (TPU)",
    "TPUWanLoRA": "Wan LoRA (TPU)",
    "TPUWanSampler": "Wan Sampler (TPU)",
    "TPUWanDecode": "Wan Decode (TPU)",
}
