"""What every family's nodes share: the loaded-model cache, ComfyUI's unload hook, and the node kinds.

Each family has the same kinds of node (Loader → Text Encode [+ Image Encode] → Sampler → Decode, LoRA between
loader and sampler) with the same inputs where the families agree; a family module only sets its types, its
category and its family-specific inputs. Values between nodes are CPU torch tensors in small dicts or dataclasses
(ComfyUI can hold and cache them); device buffers stay in the runtime.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

_models: dict[tuple, object] = {}  # (family, source, dtype, mesh, attention, layout) -> loaded family
_models_lock = threading.Lock()

DTYPE_INPUT = (["auto", "bfloat16", "float32"],
               {"default": "auto", "tooltip": "auto: bfloat16 on TPU/GPU, float32 on CPU"})
DEVICE_INPUTS = {
    "mesh": ("STRING", {"default": "auto", "tooltip": "dp=N,sp=N,tp=N over all devices; auto: CFG batch on dp, "
             "heads on tp (dp=2,tp=4 on a v6e-8)"}),
    "attention": (["auto", "splash", "cudnn", "blockwise", "reference"], {"default": "auto",
                  "tooltip": "auto: splash on TPU, cuDNN on GPU, blockwise on CPU"}),
    "cache_dir": ("STRING", {"default": "", "tooltip": "persistent XLA compilation cache; empty: "
                  "$TPU_VIDEO_CACHE_DIR or ~/.cache/tpu_video_nodes/xla_cache (one per process)"}),
}
# Placed after every other loader input, so that a workflow saved before they existed keeps its values in place.
LAYOUT_INPUTS = {
    "vae_sharding": (["auto", "width", "replicated"], {"default": "auto", "tooltip": "the VAE decode on a mesh: "
                     "width splits every frame over the chips, its width first, then its height (each chip holds "
                     "and computes a slice); replicated decodes the whole video on every chip; auto: width on "
                     "more than one chip"}),
    "fsdp": ("BOOLEAN", {"default": False, "tooltip": "also split every weight matrix over the mesh's dp axis "
             "(gathered before use): less memory per chip for a large model on a small slice (Wan 2.2 A14B on a "
             "v6e-4), more communication; needs dp of 2 or more"}),
}


def _release_all() -> None:
    """Drop every loaded model's device buffers; the caller holds ``_models_lock``."""
    for family in _models.values():
        family.release()
    _models.clear()


def load_model(key: tuple, build, cache_dir: str = ""):
    """The loaded model for ``key``, built by ``build(runtime)`` on first use; the same key shares one copy of
    the weights on the devices. Loading a different model first releases the others: a video model fills an
    accelerator's memory, so holding two at once would run out of it."""
    from tpu_runtime.runtime import get_runtime

    with _models_lock:
        family = _models.get(key)
        if family is None:
            runtime = get_runtime(cache_dir=cache_dir.strip() or None)
            _release_all()
            family = build(runtime)
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


# --- node kinds ------------------------------------------------------------------------------------------------
class TextEncodeNode:
    """Text-encoder embeddings for a prompt and a negative prompt."""

    MODEL_TYPE = EMBEDS_TYPE = ""  # a family's subclass sets both, and RETURN_TYPES = (EMBEDS_TYPE,)
    RETURN_NAMES = ("embeds",)
    FUNCTION = "encode"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": (cls.MODEL_TYPE,), "prompt": ("STRING", {"multiline": True, "default": ""}),
                             "negative_prompt": ("STRING", {"multiline": True, "default": ""})}}

    def encode(self, model, prompt: str, negative_prompt: str):
        return (model.encode(prompt, negative_prompt),)


class ImageEncodeNode:
    """The image encode stage: the first frame (and, for Wan FLF2V, the last) as the sampler takes them, for one
    video size. Connect ComfyUI's Load Image (or any IMAGE); set the size the sampler will use."""

    MODEL_TYPE = IMAGE_TYPE = ""  # a family's subclass sets both, and RETURN_TYPES = (IMAGE_TYPE,)
    RETURN_NAMES = ("image_cond",)
    FUNCTION = "encode"
    SIZE = (832, 480, 81)  # width, height, frames defaults: the family's native size
    FRAMES_TIP = ""

    @classmethod
    def INPUT_TYPES(cls):
        width, height, frames = cls.SIZE
        return {
            "required": {
                "model": (cls.MODEL_TYPE,),
                "image": ("IMAGE", {"tooltip": "the first frame; resized (stretched, not cropped) to width x height"}),
                "width": ("INT", {"default": width, "min": 16, "max": 4096, "step": 16,
                                  "tooltip": "the video's width: set the sampler to the same"}),
                "height": ("INT", {"default": height, "min": 16, "max": 4096, "step": 16}),
                "frames": ("INT", {"default": frames, "min": 1, "max": 1024, "step": 1, "tooltip": cls.FRAMES_TIP}),
            },
            "optional": {"last_image": ("IMAGE", {"tooltip": "Wan2.1-FLF2V only: the last frame"})},
        }

    def encode(self, model, image, width, height, frames, last_image=None):
        from tpu_runtime.images import as_pil

        from .comfy_bridge import progress_bar

        family = base_model(model)
        family.check_images(image is not None, last_image is not None, ("the image input", "last_image"))
        first = as_pil(image, "image")
        last = as_pil(last_image, "last_image") if last_image is not None else None
        bar = progress_bar(1)
        cond = family.encode_image(first, last, height=height, width=width, num_frames=frames)
        if bar is not None:
            bar.update_absolute(1, 1)
        return (cond,)


class LoraModel:
    """What a LoRA node passes on: the loaded model plus the LoRAs to merge when it samples (ComfyUI's
    ``LoraLoaderModelOnly`` way: the model is patched when used, so chains of LoRA nodes stack and removing a node
    removes its LoRA). Everything else is the model's own; encode and decode do not read the transformer."""

    def __init__(self, family, loras: tuple = (), loras_2: tuple = ()):
        self.family, self.loras, self.loras_2 = family, tuple(loras), tuple(loras_2)

    def __getattr__(self, name):
        return getattr(self.family, name)


def base_model(model):
    return model.family if isinstance(model, LoraModel) else model


NO_LORAS = "(no LoRA in models/loras)"
EXPERTS = ["both", "high noise", "low noise"]


class LoraNode:
    """Adds a LoRA file (ComfyUI's models/loras) at a strength to the model; chain several."""

    MODEL_TYPE = ""  # a family's subclass sets it, and RETURN_TYPES = (MODEL_TYPE,)
    RETURN_NAMES = ("model",)
    FUNCTION = "apply"
    DESCRIPTION = ("Adds a LoRA at a strength. It is merged into the transformer's weights on the devices when the "
                   "sampler runs: the sampler's compiled program is unchanged, and a new strength compiles nothing.")

    @classmethod
    def INPUT_TYPES(cls):
        from .model_folders import find_files

        return {"required": {
            "model": (cls.MODEL_TYPE,),
            "lora_name": (sorted(find_files("loras")) or [NO_LORAS],),
            "strength": ("FLOAT", {"default": 1.0, "min": -10.0, "max": 10.0, "step": 0.01,
                                   "tooltip": "1: the LoRA as trained; 0: off; negative: subtracted"}),
        }}

    def apply(self, model, lora_name: str, strength: float, expert: str = "both"):
        from tpu_runtime.errors import InputError
        from tpu_runtime.lora import LoraSpec

        from .model_folders import file_path

        family = base_model(model)
        if expert not in EXPERTS:
            raise InputError(f"expert {expert!r} must be one of {EXPERTS}")
        if expert == "low noise" and not family.two_experts:
            raise InputError(f"{family.label} has one transformer: set expert to 'both' (the low-noise expert is a "
                             "Wan 2.2 A14B part)")
        spec = LoraSpec(str(file_path("loras", lora_name)), float(strength))
        high = expert in ("both", "high noise")
        low = family.two_experts and expert in ("both", "low noise")
        targets = {**({"transformer": (spec,)} if high else {}), **({"transformer_2": (spec,)} if low else {})}
        family.apply_loras(targets, merge=False)  # read and checked now, so a wrong file is reported on this node
        return (LoraModel(family, getattr(model, "loras", ()) + ((spec,) if high else ()),
                          getattr(model, "loras_2", ()) + ((spec,) if low else ())),)


def image_cond_input(image_type: str) -> dict:
    """The sampler's optional input from the image encode node."""
    return {"image_cond": (image_type, {"tooltip": "image-to-video: the Image Encode node's output (encoded at "
                                        "this sampler's width, height and frames)"})}


def sampler_inputs(model_type: str, embeds_type: str, width: int, height: int, frames: int, frames_tip: str,
                   guidance: float, schedulers: list[str]) -> dict:
    """The inputs every sampler has, with the family's native defaults."""
    return {
        "model": (model_type,),
        "embeds": (embeds_type,),
        "width": ("INT", {"default": width, "min": 16, "max": 4096, "step": 16}),
        "height": ("INT", {"default": height, "min": 16, "max": 4096, "step": 16}),
        "frames": ("INT", {"default": frames, "min": 1, "max": 1024, "step": 1, "tooltip": frames_tip}),
        "steps": ("INT", {"default": 50, "min": 1, "max": 1000}),
        "guidance": ("FLOAT", {"default": guidance, "min": 0.0, "max": 30.0, "step": 0.1,
                               "tooltip": "CFG scale; 1 or less turns CFG off (half the work per step)"}),
        "seed": ("INT", {"default": 0, "min": 0, "max": 0xFFFFFFFFFFFFFFFF, "control_after_generate": True}),
        "scheduler": (["model default", *schedulers], {"default": "model default"}),
    }


def run_sampler(model, embeds, settings, image_cond=None):
    """Sample with ComfyUI's progress bar (one tick per step) and Cancel (checked before every step), with the
    LoRAs of the LoRA nodes before it (none: any merged earlier are removed) and the image encode node's output
    for image-to-video."""
    import dataclasses

    from .comfy_bridge import interrupt_requested, progress_bar, raise_if_interrupted

    settings = dataclasses.replace(settings, loras=getattr(model, "loras", ()), loras_2=getattr(model, "loras_2", ()))
    model = base_model(model)

    bar = progress_bar(settings.steps)

    def on_step(i, total):
        if bar is not None:
            bar.update_absolute(i, total)

    try:
        latents = model.sample(embeds, settings, on_step=on_step, should_stop=interrupt_requested, image=image_cond)
    except Exception:
        raise_if_interrupted()  # a cancelled prompt is reported as cancelled, not as an error
        raise
    return ({"samples": latents.latents, "tpu_video": latents},)


def decode_latent(model, samples, **options):
    """Frames from our sampler's LATENT, or from a plain ComfyUI LATENT whose sizes follow from its shape."""
    from tpu_runtime.errors import StageFileError
    from tpu_runtime.family import VideoLatents

    from .comfy_bridge import progress_bar

    z = samples["samples"]
    info = samples.get("tpu_video")
    if isinstance(info, VideoLatents) and z is info.latents:
        latents = info  # the sampler's own value (on a multi-host slice the workers hold it too)
    elif isinstance(info, VideoLatents) and tuple(info.latents.shape) == tuple(z.shape):
        latents = VideoLatents(z, info.height, info.width, info.num_frames, info.model_signature)
    else:
        if z.ndim != 5:
            s = model.vae_scale_spatial
            raise StageFileError(f"LATENT samples have shape {tuple(z.shape)}; {model.FAMILY_NAME} decodes video "
                                 f"latents [B, C, T, H/{s}, W/{s}]: connect a video sampler's output")
        s, t = model.vae_scale_spatial, model.vae_scale_temporal
        latents = VideoLatents(z, z.shape[3] * s, z.shape[4] * s, (z.shape[2] - 1) * t + 1, model.signature)
    bar = progress_bar(1)
    frames = model.decode(latents, **options)
    if bar is not None:
        bar.update_absolute(1, 1)
    return (frames,)
