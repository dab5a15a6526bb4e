"""What every family's nodes share: the loaded-model cache, ComfyUI's unload hook, the inputs every loader and
sampler has, and running the sampler and the decode with ComfyUI's progress bar and Cancel.

Values between nodes are CPU torch tensors in small dicts or dataclasses (ComfyUI can hold and cache them); device
buffers stay in the runtime.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

_models: dict[tuple, object] = {}  # (family, source, dtype, mesh, attention, layout) -> loaded family
_models_lock = threading.Lock()

DTYPE_INPUT = (["auto", "bfloat16", "float32"],
               {"default": "auto", "tooltip": "the weights' and the computation's dtype; auto: bfloat16 on TPU/GPU, "
                "float32 on CPU"})
DEVICE_INPUTS = {
    "mesh": ("STRING", {"default": "auto", "tooltip": "dp=N,sp=N,tp=N over all devices; auto: CFG batch on dp, "
             "heads on tp (dp=2,tp=4 on a v6e-8)"}),
    "attention": (["auto", "splash", "cudnn", "blockwise", "reference"], {"default": "auto",
                  "tooltip": "auto: splash on TPU, cuDNN on GPU, blockwise on CPU"}),
}
# Placed after every other loader input, so that a workflow saved before they existed keeps its values in place.
LAYOUT_INPUTS = {
    "vae_sharding": (["auto", "width", "replicated"], {"default": "auto", "tooltip": "the VAE decode on a mesh: "
                     "width splits every frame over the chips, its width first, then its height (each chip holds "
                     "and computes a slice); replicated decodes the whole video on every chip; auto: width on "
                     "more than one chip"}),
    "fsdp": ("BOOLEAN", {"default": False, "tooltip": "also split every weight matrix over the mesh's dp axis "
             "(gathered before use): less memory per chip for a large model on a small slice, more "
             "communication; needs dp of 2 or more"}),
}


def _release_all() -> None:
    """Drop every loaded model's device buffers; the caller holds ``_models_lock``."""
    for family in _models.values():
        family.release()
    _models.clear()


def node_runtime():
    """The process-wide runtime, started (by the first node that needs it) with the compilation cache folder of
    ComfyUI's settings dialog (``tpu_runtime.bridge.settings_store``)."""
    from tpu_runtime.bridge.settings_store import runtime

    return runtime()


def load_model(key: tuple, build):
    """The loaded model for ``key``, built by ``build(runtime)`` on first use; the same key shares one copy of
    the weights on the devices. Loading a different model first releases the others: a video model fills an
    accelerator's memory, so holding two at once would run out of it."""
    with _models_lock:
        family = _models.get(key)
        if family is None:
            runtime = node_runtime()
            _release_all()
            family = build(runtime)
            _models[key] = family
        return family


def unload_all() -> None:
    """Release every loaded model's device buffers: the families' and the native bridge's."""
    import sys

    with _models_lock:
        _release_all()
    bridge = sys.modules.get("tpu_runtime.bridge.comfy")  # imported only once a bridge node ran
    if bridge is not None:
        bridge.release_all()


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


# --- what the node kinds (kinds.py) share -----------------------------------------------------------------
class PatchedModel:
    """What a LoRA or step-cache node passes on: the loaded model plus what the sampler applies when it runs: the
    LoRAs to merge and the step cache (ComfyUI's ``LoraLoaderModelOnly`` way: the model is patched when used, so
    chains of nodes stack and removing a node removes its patch). Everything else is the model's own; encode and
    decode do not read the transformer."""

    def __init__(self, family, loras: tuple = (), loras_2: tuple = (), cache=None):
        self.family, self.loras, self.loras_2, self.cache = family, tuple(loras), tuple(loras_2), cache

    def __getattr__(self, name):
        return getattr(self.family, name)

    @classmethod
    def of(cls, model, **changes) -> "PatchedModel":
        """``model`` (loaded or patched already) with ``changes`` to its patches."""
        current = dict(loras=model.loras, loras_2=model.loras_2, cache=model.cache) \
            if isinstance(model, PatchedModel) else {}
        return cls(base_model(model), **{**current, **changes})


def base_model(model):
    return model.family if isinstance(model, PatchedModel) else model


def image_cond_input(image_type: str) -> dict:
    """The sampler's optional input from the image encode node."""
    return {"image_cond": (image_type, {"tooltip": "image-to-video: the Image Encode node's output; connect its "
                                        "width, height and length outputs to this sampler's too (the video's size "
                                        "is set once, on the Image Encode)"})}


def setting_input(setting) -> tuple:
    """A family's declared setting (``engine.settings.Setting``) as a node input: its widget, its default (or the
    choice that means "the model's"), its range and its help as the tooltip. A number the model decides is an
    input with no widget: left unconnected, the model's value is used; connect a number (a Float node) to set
    it. No widget holds a value that secretly means "unset"."""
    tooltip = setting.help
    if setting.model_decides:
        options = {"forceInput": True, "tooltip": f"{tooltip}; unconnected: {setting.default_text()}",
                   "min": setting.minimum if setting.minimum is not None else setting.above,
                   "max": setting.node_max if setting.node_max is not None else setting.below,
                   "step": setting.node_step}
        return ("INT" if setting.kind is int else "FLOAT"), {k: v for k, v in options.items() if v is not None}
    unset = setting.default is None and setting.node_unset is not None
    if unset:
        tooltip += f"; {repr(setting.node_unset) if setting.node_unset != '' else 'empty'}: {setting.default_text()}"
    default = setting.node_unset if setting.default is None else setting.default
    if setting.kind is bool:
        return "BOOLEAN", {"default": bool(default), "tooltip": tooltip}
    if setting.choices:
        return list(setting.choices), {"default": default if default is not None else setting.choices[0],
                                       "tooltip": tooltip}
    if setting.kind is str:
        return "STRING", {"default": default or "", "tooltip": tooltip}
    low = setting.minimum
    if low is None and setting.above is not None:  # the first value a widget step above the bound
        low = setting.above + (setting.node_step or 0)
    options = {"default": default, "min": low, "max": setting.node_max if setting.node_max is not None else
               setting.below, "step": setting.node_step, "tooltip": tooltip}
    return ("INT" if setting.kind is int else "FLOAT"), {k: v for k, v in options.items() if v is not None}


def setting_inputs(spec, stage: str, section: str) -> dict:
    """The node inputs of ``spec``'s settings of ``stage`` in ``section`` ("required" or "optional"), by their
    input names."""
    return {s.input_name: setting_input(s) for s in spec.settings_of(stage) if s.node == section}


def setting_values(spec, stage: str, inputs: dict) -> dict:
    """The values of ``spec``'s settings of ``stage`` among a node's ``inputs`` (by input name), by setting name;
    an input left unconnected, or at the choice meaning "the model's", as None."""
    out = {}
    for setting in spec.settings_of(stage):
        if setting.node is not None and setting.input_name in inputs:
            value = inputs[setting.input_name]
            out[setting.name] = None if setting.node_unset is not None and value == setting.node_unset else value
    return out


def size_inputs(size_step: int, length_step: int, width: int, height: int, length: int, length_tip: str,
                where: str) -> dict:
    """The video's width, height and length (frames) as widgets that hold only sizes the family's rules allow:
    multiples of ``size_step``, ``length_step * N + 1`` frames (ComfyUI's widgets snap to ``min + k * step``)."""
    return {
        "width": ("INT", {"default": width, "min": size_step, "max": 4096, "step": size_step,
                          "tooltip": f"the video's width in pixels, a multiple of {size_step}{where}"}),
        "height": ("INT", {"default": height, "min": size_step, "max": 4096, "step": size_step,
                           "tooltip": f"the video's height in pixels, a multiple of {size_step}{where}"}),
        "length": ("INT", {"default": length, "min": 1, "max": 1025, "step": length_step,
                           "tooltip": f"the video's length in frames: {length_tip}{where}"}),
    }


def sampler_inputs(model_type: str, embeds_type: str, spec) -> dict:
    """The inputs every sampler has, with the family's native defaults and widget steps (``spec.nodes.sampler``,
    ``spec.sampling``)."""
    s, sampling = spec.nodes.sampler, spec.sampling
    schedulers = list(sampling.schedulers)
    scheduler_tip = (f"model default: the model's own scheduler config; or {', '.join(schedulers)}" if schedulers
                     else "the model's own (its sigma schedule is the sigmas input)")
    return {
        "model": (model_type, {"tooltip": "the loader's model, or a LoRA / Step Cache node's after it"}),
        "embeds": (embeds_type, {"tooltip": "the Text Encode node's prompt embeddings"}),
        **size_inputs(s.size_step, s.length_step, s.width, s.height, s.frames, s.frames_tip,
                      "; image to video: connect the Image Encode's output of the same name"),
        "steps": ("INT", {"default": sampling.steps, "min": 1, "max": 1000,
                          "tooltip": "denoising steps (one compiled program serves every step)"}),
        "cfg": ("FLOAT", {"default": sampling.guidance, "min": 0.0, "max": 30.0, "step": 0.1,
                          "tooltip": "classifier-free guidance scale; 1 or less turns CFG off (half the work per "
                          "step)"}),
        "seed": ("INT", {"default": 0, "min": 0, "max": 0xFFFFFFFFFFFFFFFF, "control_after_generate": True,
                         "tooltip": "the noise's seed: the same seed, settings and prompt make the same video"}),
        "scheduler": (["model default", *schedulers], {"default": "model default", "tooltip": scheduler_tip}),
    }


def run_sampler(model, embeds, settings, image_cond=None, **refine):
    """Sample with ComfyUI's progress bar (one tick per step) and Cancel (checked before every step), with the
    LoRAs of the LoRA nodes before it (none: any merged earlier are removed) and the image encode node's output
    for image-to-video; ``refine``: ``latents`` to refine (two-stage generation)."""
    import dataclasses

    from .comfy_bridge import interrupt_requested, progress_bar, raise_if_interrupted

    patched = isinstance(model, PatchedModel)
    settings = dataclasses.replace(settings, loras=model.loras if patched else (),
                                   loras_2=model.loras_2 if patched else (), cache=model.cache if patched else None)
    model = base_model(model)

    bar = progress_bar(settings.steps)

    def on_step(i, total):
        if bar is not None:
            bar.update_absolute(i, total)

    try:
        latents = model.sample(embeds, settings, on_step=on_step, should_stop=interrupt_requested, image=image_cond,
                               **refine)
    except Exception:
        raise_if_interrupted()  # a cancelled prompt is reported as cancelled, not as an error
        raise
    if model.step_cache_calibrated:
        save_mag_ratios(model, model.step_cache_calibrated)
    return ({"samples": latents.latents, "tpu_video": latents},)


def save_mag_ratios(model, calibrated: dict) -> None:
    """A calibrating sampler run's MagCache ratios: into ComfyUI's output folder as mag_ratios_<model>.json (paste
    the file's path or its contents into the step cache node's mag_ratios), and into the log."""
    import json
    import re

    from .comfy_bridge import output_directory

    value = calibrated["transformer"] if list(calibrated) == ["transformer"] else calibrated
    text = json.dumps(value)
    folder = output_directory()
    if folder is not None:
        path = folder / f"mag_ratios_{re.sub(r'[^A-Za-z0-9_.-]+', '_', model.label)}.json"
        path.write_text(text + "\n")
        log.warning("MagCache ratios of %s written to %s: give that path (or the list) to the step cache node's "
                    "mag_ratios", model.label, path)
    log.warning("MagCache ratios of %s: %s", model.label, text)


def latent_value(model, samples):
    """The ``VideoLatents`` of a LATENT: our sampler's own value, or a plain ComfyUI LATENT whose sizes follow from
    its shape (e.g. after ComfyUI's latent nodes)."""
    from tpu_runtime.errors import StageFileError
    from tpu_runtime.engine.stages import VideoLatents

    z = samples["samples"]
    info = samples.get("tpu_video")
    if isinstance(info, VideoLatents) and z is info.latents:
        return info  # the sampler's own value (on a multi-host slice the workers hold it too)
    if isinstance(info, VideoLatents) and tuple(info.latents.shape) == tuple(z.shape):
        return VideoLatents(z, info.height, info.width, info.num_frames, info.model_signature, audio=info.audio)
    if z.ndim != 5:
        s = model.vae_scale_spatial
        raise StageFileError(f"LATENT samples have shape {tuple(z.shape)}; {model.FAMILY_NAME} decodes video "
                             f"latents [B, C, T, H/{s}, W/{s}]: connect a video sampler's output")
    s, t = model.vae_scale_spatial, model.vae_scale_temporal
    return VideoLatents(z, z.shape[3] * s, z.shape[4] * s, (z.shape[2] - 1) * t + 1, model.signature)


def decode_latent(model, samples, audio: bool = False, **options):
    """Frames from a LATENT (``latent_value``); with ``audio`` also the sound track as ComfyUI's AUDIO
    (``{"waveform": [1, channels, samples], "sample_rate"}``)."""
    from .comfy_bridge import progress_bar

    latents = latent_value(model, samples)
    bar = progress_bar(2 if audio else 1)
    frames = model.decode(latents, **options)
    if bar is not None:
        bar.update_absolute(1, 2 if audio else 1)
    if not audio:
        return (frames,)
    waveform = model.decode_audio(latents)
    if bar is not None:
        bar.update_absolute(2, 2)
    return frames, {"waveform": waveform[None].contiguous(), "sample_rate": model.sample_rate}
