"""The native bridge's nodes: ComfyUI's own models, loaded by ComfyUI's own loaders, run on the runtime.

TPU Diffusion Model sits between a diffusion model loader (Load Diffusion Model, Load Checkpoint, a LoRA loader)
and the sampler (KSampler, KSamplerAdvanced, SamplerCustom); TPU VAE between Load VAE and every node that decodes
or encodes with it; TPU Text Encoder between Load CLIP and CLIP Text Encode; TPU CLIP Vision between Load CLIP
Vision and CLIP Vision Encode; TPU Audio Encoder between Load Audio Encoder and Audio Encoder Encode. Everything else in the graph stays ComfyUI's. The automatic mode
(``TPU_VIDEO_AUTO``, ``tpu_runtime/bridge/auto.py``) runs the same functions on every loader's output.
"""

from __future__ import annotations

from .common import DEVICE_INPUTS, node_runtime

CATEGORY = "TPU video"

BRIDGE_INPUTS = {
    "mesh": ("STRING", {"default": "auto", "tooltip": "dp=N,sp=N,tp=N over all devices; auto: attention heads on "
             "tp (as many devices as divide them), the rest on sp (each device takes part of the video's tokens "
             "in attention)"}),
    "attention": DEVICE_INPUTS["attention"],
    "compute_dtype": (["auto", "as loaded"], {"default": "auto", "tooltip": "auto: bf16/fp16 weights compute in "
                      "their own dtype, fp8 and quantized (int8, nvfp4, mxfp8) weights in bfloat16, as ComfyUI does "
                      "on a GPU (with --cpu ComfyUI itself would cast every layer to float32); as loaded: exactly "
                      "what ComfyUI chose when it loaded the model"}),
}


def _settings(mesh: str, attention: str, compute_dtype: str):
    from tpu_runtime.bridge.comfy import BridgeSettings
    from tpu_runtime.engine.attention import AttentionConfig
    from tpu_runtime.engine.sharding import parse_mesh

    return BridgeSettings(mesh=parse_mesh(mesh), attention=AttentionConfig(impl=attention),
                          compute_dtype=compute_dtype)


class TPUDiffusionModel:
    """ComfyUI's own diffusion model (any class ComfyUI loads) run on the TPU runtime."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    RETURN_NAMES = ("model",)
    FUNCTION = "apply"
    DESCRIPTION = ("Runs ComfyUI's own diffusion model on the TPU (or any JAX device): put it between Load "
                   "Diffusion Model (or a LoRA loader) and the sampler. Samplers, schedulers, CFG, LoRA, VACE, "
                   "context windows and EasyCache stay ComfyUI's; each model call runs as a compiled program "
                   "(one per input shape, kept on disk for the next start).")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL", {"tooltip": "from Load Diffusion Model, Load Checkpoint or a "
                                                 "LoRA loader"})},
                "optional": dict(BRIDGE_INPUTS)}

    def apply(self, model, mesh: str = "auto", attention: str = "auto", compute_dtype: str = "auto"):
        from tpu_runtime.bridge.diffusion import diffusion_model_on_runtime

        settings = _settings(mesh, attention, compute_dtype)
        runtime = node_runtime()
        clone = diffusion_model_on_runtime(model, settings)
        for bridged in _bridged_modules(clone):  # a bad mesh fails here, not at step 1
            spec = settings.mesh or bridged.rules.auto_mesh(bridged.module, len(runtime.devices))
            bridged.rules.check_mesh(bridged.module, spec, len(runtime.devices))
        return (clone,)


def _bridged_modules(clone) -> list:
    """The bridged modules of a TPU Diffusion Model's clone: its forward's (or SAM 3's image encoder's), and its text
    connectors'."""
    from tpu_runtime.bridge.comfy import BridgedForward

    return [v.bridged for v in clone.object_patches.values() if isinstance(v, BridgedForward)]


VAE_INPUTS = {
    "mesh": ("STRING", {"default": "auto", "tooltip": "dp=N,sp=N,tp=N over all devices; auto: every device. The "
             "frames are split over the devices along their width (then height), the VAE's weights are whole on "
             "each"}),
    "attention": DEVICE_INPUTS["attention"],
}

TEXT_INPUTS = {
    "mesh": ("STRING", {"default": "auto", "tooltip": "dp=N,sp=N,tp=N over all devices; auto: attention heads on "
             "tp (as many devices as divide them), the rest on sp. The text encoder's weights are split over tp"}),
    "attention": DEVICE_INPUTS["attention"],
}


def _bridge_settings(mesh: str, attention: str):
    from tpu_runtime.bridge.comfy import BridgeSettings
    from tpu_runtime.engine.attention import AttentionConfig
    from tpu_runtime.engine.sharding import parse_mesh

    return BridgeSettings(mesh=parse_mesh(mesh), attention=AttentionConfig(impl=attention))


def _check_meshes(bridged_modules, devices: int) -> None:
    """A bad mesh fails when the node runs, before any decode or encode."""
    for bridged in bridged_modules:
        spec = bridged.mesh_spec or bridged.rules.auto_mesh(bridged.module, devices)
        bridged.rules.check_mesh(bridged.module, spec, devices)


class TPUVAE:
    """ComfyUI's own VAE (any VAE Load VAE loads) run on the TPU runtime."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("VAE",)
    RETURN_NAMES = ("vae",)
    FUNCTION = "apply"
    DESCRIPTION = ("Runs ComfyUI's own VAE on the TPU (or any JAX device): put it between Load VAE and the nodes that "
                   "decode or encode (VAE Decode, VAE Encode, the tiled ones, Wan Image to Video, ...). A causal "
                   "video VAE (Wan) decodes chunk by chunk with its caches on the devices: two compiled programs "
                   "whatever the frame count; other VAEs one per latent shape. Frames are split over the devices.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"vae": ("VAE", {"tooltip": "from Load VAE or a checkpoint loader"})},
                "optional": dict(VAE_INPUTS)}

    def apply(self, vae, mesh: str = "auto", attention: str = "auto"):
        from tpu_runtime.bridge.vae import bridged_parts, vae_on_runtime

        settings = _bridge_settings(mesh, attention)
        runtime = node_runtime()
        on_runtime = vae_on_runtime(vae, settings)
        _check_meshes(bridged_parts(on_runtime).values(), len(runtime.devices))
        return (on_runtime,)


class TPUTextEncoder:
    """ComfyUI's own text encoder (any CLIP Load CLIP loads) run on the TPU runtime."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("CLIP",)
    RETURN_NAMES = ("clip",)
    FUNCTION = "apply"
    DESCRIPTION = ("Runs ComfyUI's own text encoder (umT5-XXL, T5-XXL, LLaMA, CLIP...) on the TPU (or any JAX device): "
                   "put it between Load CLIP and CLIP Text Encode (or any node that encodes with the CLIP). "
                   "Tokenizers, prompt weights and schedules stay ComfyUI's; the weights are split over the devices; "
                   "one compiled program per padded prompt length.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"clip": ("CLIP", {"tooltip": "from Load CLIP, Dual CLIP Loader or a checkpoint "
                                               "loader"})},
                "optional": dict(TEXT_INPUTS)}

    def apply(self, clip, mesh: str = "auto", attention: str = "auto"):
        from tpu_runtime.bridge.text import bridged_text_models, text_encoder_on_runtime

        settings = _bridge_settings(mesh, attention)
        runtime = node_runtime()
        on_runtime = text_encoder_on_runtime(clip, settings)
        _check_meshes(bridged_text_models(on_runtime).values(), len(runtime.devices))
        return (on_runtime,)


VISION_INPUTS = {
    "mesh": ("STRING", {"default": "auto", "tooltip": "dp=N,sp=N,tp=N over all devices; auto: attention heads on "
             "tp (as many devices as divide them), the rest on sp. The image model's weights are split over tp"}),
    "attention": DEVICE_INPUTS["attention"],
}


class TPUCLIPVision:
    """ComfyUI's own CLIP vision model (any model Load CLIP Vision loads) run on the TPU runtime."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("CLIP_VISION",)
    RETURN_NAMES = ("clip_vision",)
    FUNCTION = "apply"
    DESCRIPTION = ("Runs ComfyUI's own CLIP vision model (clip_vision_h, SigLIP, ...) on the TPU (or any JAX device): "
                   "put it between Load CLIP Vision and CLIP Vision Encode. Resizing, cropping and normalising the "
                   "image stay ComfyUI's; the image model runs as one compiled program per image batch.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"clip_vision": ("CLIP_VISION", {"tooltip": "from Load CLIP Vision or a checkpoint "
                                                             "loader"})},
                "optional": dict(VISION_INPUTS)}

    def apply(self, clip_vision, mesh: str = "auto", attention: str = "auto"):
        from tpu_runtime.bridge.vision import bridged_vision_models, clip_vision_on_runtime

        settings = _bridge_settings(mesh, attention)
        runtime = node_runtime()
        on_runtime = clip_vision_on_runtime(clip_vision, settings)
        _check_meshes(bridged_vision_models(on_runtime).values(), len(runtime.devices))
        return (on_runtime,)


AUDIO_INPUTS = {
    "mesh": ("STRING", {"default": "auto", "tooltip": "dp=N,sp=N,tp=N over all devices; auto: attention heads on "
             "tp (as many devices as divide them), the rest on sp. The audio encoder's weights are split over tp"}),
    "attention": DEVICE_INPUTS["attention"],
}


class TPUAudioEncoder:
    """ComfyUI's own audio encoder (any model Load Audio Encoder loads) run on the TPU runtime."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("AUDIO_ENCODER",)
    RETURN_NAMES = ("audio_encoder",)
    FUNCTION = "apply"
    DESCRIPTION = ("Runs ComfyUI's own audio encoder (wav2vec2, Whisper) on the TPU (or any JAX device): put it between "
                   "Load Audio Encoder and Audio Encoder Encode (Wan 2.2 S2V, InfiniteTalk, HuMo). Resampling the "
                   "waveform stays ComfyUI's; the model runs as one compiled program per clip length.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"audio_encoder": ("AUDIO_ENCODER", {"tooltip": "from Load Audio Encoder"})},
                "optional": dict(AUDIO_INPUTS)}

    def apply(self, audio_encoder, mesh: str = "auto", attention: str = "auto"):
        from tpu_runtime.bridge.audio_encoder import audio_encoder_on_runtime, bridged_audio_models

        settings = _bridge_settings(mesh, attention)
        runtime = node_runtime()
        on_runtime = audio_encoder_on_runtime(audio_encoder, settings)
        _check_meshes(bridged_audio_models(on_runtime).values(), len(runtime.devices))
        return (on_runtime,)


NODE_CLASS_MAPPINGS = {"TPUDiffusionModel": TPUDiffusionModel, "TPUVAE": TPUVAE, "TPUTextEncoder": TPUTextEncoder,
                       "TPUCLIPVision": TPUCLIPVision, "TPUAudioEncoder": TPUAudioEncoder}
NODE_DISPLAY_NAME_MAPPINGS = {"TPUDiffusionModel": "TPU Diffusion Model", "TPUVAE": "TPU VAE",
                              "TPUTextEncoder": "TPU Text Encoder", "TPUCLIPVision": "TPU CLIP Vision",
                              "TPUAudioEncoder": "TPU Audio Encoder"}
