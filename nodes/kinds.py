"""The node kinds, written once for every family: Loader (a diffusers folder) and Files Loader (ComfyUI's single
files) → Text Encode [+ Image Encode] → Sampler [→ Upsample → Sampler] → Decode, with LoRA and Step Cache
between loader and sampler.

``family_nodes(spec)`` makes a family's node classes from its declaration (``FamilySpec.nodes``): class names
``prefix + kind`` (``TPUWanSampler``), display names ``"<title> <kind> (TPU)"``, the family's types, defaults, widget
steps and the inputs only it has. Class names are what saved workflows hold: they never change; a change of input
names or order is migrated for saved workflows by ``migration.py``. Every input has a tooltip. Inputs take
ComfyUI's own names where ComfyUI has one (``cfg``, ``length``); the engine and the command line keep theirs
(``guidance``, ``frames``), and a refusal from the engine is said in the node's names. Each node checks its inputs
and calls the engine; no model math lives here.
"""

from __future__ import annotations

import re
from contextlib import contextmanager

from .common import (
    DEVICE_INPUTS,
    DTYPE_INPUT,
    LAYOUT_INPUTS,
    PatchedModel,
    base_model,
    decode_latent,
    image_cond_input,
    latent_value,
    load_model,
    run_sampler,
    sampler_inputs,
    setting_inputs,
    setting_values,
    size_inputs,
)

NONE = "none"
NO_FILES = "(none found)"
NO_LORAS = "(no LoRA in models/loras)"
EXPERTS = ["both", "high noise", "low noise"]


def no_models(spec) -> str:
    """The loader's only choice when no folder of the family is found."""
    return f"(no {spec.nodes.title} folder found: see model_path)"


def _types(spec) -> tuple[str, str, str]:
    prefix = spec.nodes.type_prefix
    return f"{prefix}_MODEL", f"{prefix}_EMBEDS", f"{prefix}_IMAGE"


class _Node:
    """What every kind knows: its family (``SPEC``) and that family's types."""

    SPEC = None

    @classmethod
    def types(cls) -> tuple[str, str, str]:
        return _types(cls.SPEC)

    @classmethod
    def model_input(cls, tooltip: str = "the loader's model (or a LoRA / Step Cache node's after it)") -> tuple:
        return (cls.types()[0], {"tooltip": tooltip})


# The engine's (and the command line's) names of the sampling settings -> the node inputs' (ComfyUI's) names.
NODE_NAMES = {"frames": "length", "guidance": "cfg"}


@contextmanager
def said_in_node_names(spec):
    """Refusals from the engine say a setting as the engine names it (``frames=10 must be 4*N+1``); on a node, say
    it with the node's input names (``length=10``)."""
    from tpu_runtime.errors import InputError

    names = {**NODE_NAMES, **{s.name: s.input_name for s in spec.settings if s.input_name != s.name}}
    alternatives = "|".join(map(re.escape, sorted(names, key=len, reverse=True)))
    said = re.compile(rf"\b({alternatives})(?==)|(?<=leave )({alternatives})(?= unset)")
    try:
        yield
    except InputError as error:
        message = said.sub(lambda m: names[m.group(1) or m.group(2)], str(error))
        if message == str(error):
            raise
        raise type(error)(message) from error


def _device_options(dtype, mesh, attention, vae_sharding, fsdp) -> dict:
    return dict(dtype=dtype, mesh=mesh.strip() or "auto", attention=attention, vae_sharding=vae_sharding,
                fsdp=bool(fsdp))


class Loader(_Node):
    """Pick a diffusers folder of the family from ComfyUI's model folders (or give a path); weights load onto the
    devices the first time a stage needs them, and the same model and settings are loaded once."""

    RETURN_NAMES = ("model",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        from .model_folders import find_models

        names = sorted(find_models(cls.SPEC)) or [no_models(cls.SPEC)]
        return {
            "required": {"model": (names, {"tooltip": cls.SPEC.nodes.loader_tooltip}), "dtype": DTYPE_INPUT},
            "optional": {"model_path": ("STRING", {"default": "", "tooltip": "a diffusers folder anywhere, by its "
                                                   "path (overrides model); empty: the model picked above"}),
                         **DEVICE_INPUTS, **LAYOUT_INPUTS, **setting_inputs(cls.SPEC, "open", "optional")},
        }

    def load(self, model: str, dtype: str, model_path: str = "", mesh: str = "auto", attention: str = "auto",
             vae_sharding: str = "auto", fsdp: bool = False, **family_options):
        from tpu_runtime.engine.folders import resolve_model_path
        from tpu_runtime.errors import InputError
        from tpu_runtime.families import registry

        from .model_folders import folder_path

        unknown = sorted(set(family_options) - set(setting_inputs(self.SPEC, "open", "optional")))
        if unknown:
            raise InputError(f"{type(self).__name__} has no input {', '.join(unknown)}")
        folder = str(resolve_model_path(model_path.strip() or str(folder_path(self.SPEC, model))))
        options = _device_options(dtype, mesh, attention, vae_sharding, fsdp)
        extra = {k: (v.strip() if isinstance(v, str) else v) or None for k, v in family_options.items()}
        key = (self.SPEC.name, folder, *options.values(), *sorted(extra.items()))
        cls = registry.family_class(self.SPEC)
        return (load_model(key, lambda runtime: cls(folder, runtime=runtime, **options, **extra)),)


class ModelFilesLoader(_Node):
    """The family from the single files ComfyUI's own templates use, picked from ComfyUI's model folders."""

    RETURN_NAMES = ("model",)
    FUNCTION = "load"

    @classmethod
    def _roles(cls) -> dict:
        return {r.name: r for r in cls.SPEC.file_roles}

    @classmethod
    def INPUT_TYPES(cls):
        from .model_folders import find_files

        def names(role, optional=False):
            found = sorted(find_files(cls._roles()[role].folder))
            return ([NONE] if optional else []) + (found or ([] if optional else [NO_FILES]))

        spec = cls.SPEC.nodes.files_loader
        required = {name: (names(role), {"tooltip": tip}) for name, role, tip in spec.required}
        optional = {}
        for entry in spec.optional:
            if entry == "@device":
                optional.update(DEVICE_INPUTS)
            elif entry == "@layout":
                optional.update(LAYOUT_INPUTS)
            elif cls._roles()[entry[1]].directory:  # a folder: its path
                optional[entry[0]] = ("STRING", {"default": "", "tooltip": entry[2]})
            else:
                name, role, tip = entry
                optional[name] = (names(role, optional=True), {"default": NONE, "tooltip": tip})
        return {"required": {**required, "dtype": DTYPE_INPUT}, "optional": optional}

    def load(self, *args, **kwargs):
        from tpu_runtime.errors import InputError
        from tpu_runtime.families import registry

        from .model_folders import file_path

        order = [n for n in self.INPUT_TYPES()["required"]] + [n for n in self.INPUT_TYPES()["optional"]]
        if len(args) > len(order):
            raise InputError(f"{type(self).__name__}.load takes {len(order)} inputs, got {len(args)}")
        values = {**dict(zip(order, args)), **kwargs}
        spec = self.SPEC.nodes.files_loader
        roles = self._roles()
        files = {}
        for entry in spec.required + tuple(e for e in spec.optional if isinstance(e, tuple)):
            name, role, _ = entry
            choice = values.get(name, NONE)
            if isinstance(choice, str):
                choice = choice.strip()
            if choice not in (NONE, "", None):
                files[role] = choice if roles[role].directory else file_path(roles[role].folder, choice)
        options = _device_options(values["dtype"], values.get("mesh", "auto"), values.get("attention", "auto"),
                                  values.get("vae_sharding", "auto"), values.get("fsdp", False))
        key = (f"{self.SPEC.name}-files", tuple(sorted((k, str(v)) for k, v in files.items())), *options.values())
        cls = registry.family_class(self.SPEC)
        return (load_model(key, lambda runtime: cls(files=files, runtime=runtime, **options)),)


class TextEncode(_Node):
    """Text-encoder embeddings for a prompt and a negative prompt."""

    RETURN_NAMES = ("embeds",)
    FUNCTION = "encode"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": cls.model_input("the loader's model (its text encoder runs here)"),
            "prompt": ("STRING", {"multiline": True, "default": "",
                                  "tooltip": "what the video shows: subject, motion, camera, light, style"}),
            "negative_prompt": ("STRING", {"multiline": True, "default": "",
                                           "tooltip": "what the video should not show (used where CFG is on: cfg "
                                           "above 1); may be empty"})}}

    def encode(self, model, prompt: str, negative_prompt: str):
        return (model.encode(prompt, negative_prompt),)


class ImageEncode(_Node):
    """The image encode stage: the first frame (and, for Wan FLF2V, the last) as the sampler takes them, for one
    video size. Connect ComfyUI's Load Image (or any IMAGE); the video's size is set here, and its width, height
    and length outputs go to the sampler's inputs of the same names, so it is set once."""

    RETURN_NAMES = ("image_cond", "width", "height", "length")
    OUTPUT_TOOLTIPS = ("the encoded image, for the sampler's image_cond",
                       "the video's width: connect it to the sampler's width",
                       "the video's height: connect it to the sampler's height",
                       "the video's length: connect it to the sampler's length")
    FUNCTION = "encode"

    @classmethod
    def INPUT_TYPES(cls):
        width, height, frames = cls.SPEC.nodes.image_size
        s = cls.SPEC.nodes.sampler
        return {
            "required": {
                "model": cls.model_input("the loader's model (its VAE encodes the image)"),
                "image": ("IMAGE", {"tooltip": "the first frame; resized (stretched, not cropped) to width x height"}),
                **size_inputs(s.size_step, s.length_step, width, height, frames, cls.SPEC.nodes.image_frames_tip,
                              "; connect this output to the sampler's input of the same name"),
            },
            "optional": {"last_image": ("IMAGE", {"tooltip": "first-and-last-frame models only: the last frame"})},
        }

    def encode(self, model, image, width, height, length, last_image=None):
        from tpu_runtime.engine.images import as_pil

        from .comfy_bridge import progress_bar

        family = base_model(model)
        family.check_images(image is not None, last_image is not None, ("the image input", "last_image"))
        first = as_pil(image, "image")
        last = as_pil(last_image, "last_image") if last_image is not None else None
        bar = progress_bar(1)
        with said_in_node_names(self.SPEC):
            cond = family.encode_image(first, last, height=height, width=width, num_frames=length)
        if bar is not None:
            bar.update_absolute(1, 1)
        return cond, width, height, length


class LoRA(_Node):
    """Adds a LoRA file (ComfyUI's models/loras) at a strength to the model; chain several."""

    RETURN_NAMES = ("model",)
    FUNCTION = "apply"
    DESCRIPTION = ("Adds a LoRA at a strength. It is merged into the transformer's weights on the devices when the "
                   "sampler runs: the sampler's compiled program is unchanged, and a new strength compiles nothing.")

    @classmethod
    def INPUT_TYPES(cls):
        from .model_folders import find_files

        inputs = {"required": {
            "model": cls.model_input("the loader's model (or another LoRA / Step Cache node's)"),
            "lora_name": (sorted(find_files("loras")) or [NO_LORAS],
                          {"tooltip": f"a LoRA file for {cls.SPEC.display_name} in ComfyUI's models/loras"}),
            "strength": ("FLOAT", {"default": 1.0, "min": -10.0, "max": 10.0, "step": 0.01,
                                   "tooltip": "1: the LoRA as trained; 0: off; negative: subtracted"}),
        }}
        if cls.SPEC.nodes.lora_optional:
            inputs["optional"] = dict(cls.SPEC.nodes.lora_optional)
        return inputs

    def apply(self, model, lora_name: str, strength: float, expert: str = "both"):
        from tpu_runtime.engine.lora import LoraSpec
        from tpu_runtime.errors import InputError

        from .model_folders import file_path

        family = base_model(model)
        if expert not in EXPERTS:
            raise InputError(f"expert {expert!r} must be one of {EXPERTS}")
        if expert == "low noise" and not family.two_experts:
            raise InputError(f"{family.label} has one transformer: set expert to 'both' (the low-noise expert is a "
                             "two-expert model's)")
        spec = LoraSpec(str(file_path("loras", lora_name)), float(strength))
        high = expert in ("both", "high noise")
        low = family.two_experts and expert in ("both", "low noise")
        targets = {**({"transformer": (spec,)} if high else {}), **({"transformer_2": (spec,)} if low else {})}
        family.apply_loras(targets, merge=False)  # read and checked now, so a wrong file is reported on this node
        loras, loras_2 = (model.loras, model.loras_2) if isinstance(model, PatchedModel) else ((), ())
        return (PatchedModel.of(model, loras=loras + ((spec,) if high else ()),
                                loras_2=loras_2 + ((spec,) if low else ())),)


# diffusers' MagCacheConfig / FirstBlockCacheConfig thresholds: the widget's default is magcache's (its default
# method); the value shown is the value used.
DEFAULT_THRESHOLD = {"magcache": 0.06, "first-block": 0.05}


class StepCache(_Node):
    """Skips whole transformer passes as diffusers' MagCache and FirstBlockCache do; the sampler after it runs
    with it (frames equal diffusers' with the same cache config)."""

    RETURN_NAMES = ("model",)
    FUNCTION = "apply"
    DESCRIPTION = ("Step caching for the sampler after it: magcache skips steps fixed in advance by the model's "
                   "calibrated ratios (published for some released models; give others in mag_ratios, or calibrate "
                   "them); first-block skips a step when the first block's output barely changed. Each method's "
                   "programs compile once: a new threshold or ratios compile nothing.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": cls.model_input("the loader's model (or a LoRA node's after it)"),
            "method": (["magcache", "first-block"], {"default": "magcache", "tooltip": "magcache: skip steps fixed "
                       "in advance by the model's calibrated ratios; first-block: skip a step when the first "
                       "block's output barely changed"}),
            "threshold": ("FLOAT", {"default": DEFAULT_THRESHOLD["magcache"], "min": 0.0, "max": 10.0,
                                    "step": 0.001, "tooltip": "skip while the accumulated error stays at or under "
                                    "this (diffusers' defaults: magcache 0.06, first-block 0.05)"}),
            "max_skip": ("INT", {"default": 3, "min": 1, "max": 100,
                                 "tooltip": "magcache: at most this many steps skipped in a row"}),
            "retention": ("FLOAT", {"default": 0.2, "min": 0.0, "max": 0.99, "step": 0.05,
                                    "tooltip": "magcache: this fraction of each transformer's first steps always "
                                    "runs"}),
        }, "optional": {
            "mag_ratios": ("STRING", {"default": "", "multiline": True,
                                      "tooltip": "magcache: the model's ratios, comma-separated, a JSON list or one "
                                      "list per transformer, or a JSON file's path; empty: the published ones"}),
            "calibrate": ("BOOLEAN", {"default": False,
                                      "tooltip": "magcache: skip nothing and measure this model's ratios (written to "
                                      "the output folder as mag_ratios_<model>.json)"}),
        }}

    def apply(self, model, method: str, threshold: float, max_skip: int, retention: float, mag_ratios: str = "",
              calibrate: bool = False):
        from tpu_runtime.engine.stages import SampleSettings
        from tpu_runtime.tools.options import step_cache

        family = base_model(model)
        magcache = method == "magcache"
        cache = step_cache(method, threshold, max_skip if magcache else None,
                           retention if magcache else None, mag_ratios.strip() or None, bool(calibrate), where="node")
        height, width, frames = family.native_size()
        family.check_step_cache(SampleSettings(height, width, frames, cache=cache))  # the ratios there are, now
        return (PatchedModel.of(model, cache=cache),)


class Sampler(_Node):
    """Denoise a video latent: one compiled program per shape, reused for every step and every seed."""

    RETURN_TYPES = ("LATENT",)
    RETURN_NAMES = ("samples",)
    FUNCTION = "sample"

    @classmethod
    def INPUT_TYPES(cls):
        model, embeds, image = cls.types()
        spec = cls.SPEC
        optional = {**setting_inputs(spec, "sample", "optional"), **image_cond_input(image)}
        if spec.sampling.refine:
            optional.update(REFINE_INPUTS)
        return {"required": {**sampler_inputs(model, embeds, spec), **setting_inputs(spec, "sample", "required")},
                "optional": optional}

    def sample(self, model, embeds, width, height, length, steps, cfg, seed, scheduler, image_cond=None,
               samples=None, noise_scale=None, **extra):
        from tpu_runtime.engine.stages import SampleSettings

        check_size_agrees(type(self).__name__, width, height, length, image_cond)
        refine = {} if samples is None else {"latents": latent_value(base_model(model), samples)}
        options = setting_values(self.SPEC, "sample", extra)
        if samples is not None and noise_scale is not None:
            options["noise_scale"] = noise_scale
        settings = SampleSettings(height, width, length, steps, cfg, seed,
                                  None if scheduler == "model default" else scheduler, options=options)
        with said_in_node_names(self.SPEC):
            return run_sampler(model, embeds, settings, image_cond, **refine)


def check_size_agrees(node: str, width: int, height: int, length: int, image_cond) -> None:
    """Image to video: the video's size is the image encoding's. A sampler whose own width, height or length
    differ (set by hand rather than connected from the Image Encode's outputs) is refused, naming both."""
    from tpu_runtime.engine.stages import ImageConditioning
    from tpu_runtime.errors import InputError

    if not isinstance(image_cond, ImageConditioning):
        return
    encoded = (image_cond.width, image_cond.height, image_cond.num_frames)
    if (width, height, length) != encoded:
        raise InputError(f"{node}: width x height x length = {width}x{height}x{length}, but the image was encoded "
                         f"for {encoded[0]}x{encoded[1]}x{encoded[2]}: connect the Image Encode's width, height and "
                         "length outputs to this sampler's inputs of the same names (the size is then set once, on "
                         "the Image Encode), or set the same values here")


# The sampler's inputs for refining given latents (a recipe's later sampling: the Upsample node's output).
REFINE_INPUTS = {
    "samples": ("LATENT", {"tooltip": "refine these latents (the Upsample node's) instead of starting from noise: "
                           "set width and height to their size and sigmas to stage2"}),
    "noise_scale": ("FLOAT", {"forceInput": True, "min": 0.0, "max": 1.0, "step": 0.01,
                              "tooltip": "how much fresh noise the refined latents get; unconnected: the "
                              "schedule's first sigma (diffusers' recipe)"}),
}


class Upsample(_Node):
    """The latents at twice the width and height, for a second, refining sampler."""

    RETURN_TYPES = ("LATENT",)
    RETURN_NAMES = ("samples",)
    FUNCTION = "upsample"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": cls.model_input("the loader's model (its latent upsampler runs here)"),
                             "samples": ("LATENT", {"tooltip": "the first sampler's latents"})}}

    def upsample(self, model, samples):
        from .comfy_bridge import progress_bar

        family = base_model(model)
        bar = progress_bar(1)
        latents = family.upsample(latent_value(family, samples))
        if bar is not None:
            bar.update_absolute(1, 1)
        return ({"samples": latents.latents, "tpu_video": latents},)


class Decode(_Node):
    """VAE decode to an IMAGE batch [frames, H, W, 3] for ComfyUI's CreateVideo / SaveVideo."""

    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("frames",)
    FUNCTION = "decode"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": cls.model_input("the loader's model (its VAE decodes here)"),
                             "samples": ("LATENT", {"tooltip": "the sampler's latents (or any ComfyUI video LATENT "
                                                    "of this model)"}),
                             **setting_inputs(cls.SPEC, "decode", "required")}}

    def decode(self, model, samples, **options):
        return decode_latent(model, samples, audio=self.SPEC.nodes.audio, **options)


# kind -> (class-name suffix, display-name suffix, the node's description from the spec)
KINDS = {
    "Loader": (Loader, "Loader", lambda n: n.loader_description),
    "ModelFilesLoader": (ModelFilesLoader, "Files Loader", lambda n: n.files_loader.description),
    "TextEncode": (TextEncode, "Text Encode", lambda n: n.text_encode_doc),
    "ImageEncode": (ImageEncode, "Image Encode", lambda n: n.image_encode_doc),
    "LoRA": (LoRA, "LoRA", lambda n: LoRA.DESCRIPTION),
    "StepCache": (StepCache, "Step Cache", lambda n: StepCache.DESCRIPTION),
    "Sampler": (Sampler, "Sampler", lambda n: n.sampler_doc),
    "Upsample": (Upsample, "Upsample", lambda n: n.upsample_doc),
    "Decode": (Decode, "Decode", lambda n: n.decode_doc),
}


def family_nodes(spec) -> tuple[dict, dict]:
    """The node classes of family ``spec`` and their display names: class name -> class, class name -> title."""
    classes, titles = {}, {}
    model, embeds, image = _types(spec)
    returns = {"Loader": (model,), "ModelFilesLoader": (model,), "TextEncode": (embeds,),
               "ImageEncode": (image, "INT", "INT", "INT"), "LoRA": (model,), "StepCache": (model,)}
    for kind, (base, title, describe) in KINDS.items():
        if kind == "ModelFilesLoader" and spec.nodes.files_loader is None:
            continue
        if kind == "StepCache" and not spec.step_cache:
            continue
        if kind == "Upsample" and not spec.nodes.upsample_doc:
            continue
        name = spec.nodes.prefix + kind
        attrs = {"SPEC": spec, "CATEGORY": spec.nodes.category, "DESCRIPTION": describe(spec.nodes),
                 "__doc__": describe(spec.nodes), "__module__": __name__}
        if kind in returns:
            attrs["RETURN_TYPES"] = returns[kind]
        if kind == "Decode" and spec.nodes.audio:
            attrs.update(RETURN_TYPES=("IMAGE", "AUDIO"), RETURN_NAMES=("frames", "audio"))
        classes[name] = type(name, (base,), attrs)
        titles[name] = f"{spec.nodes.title} {title} (TPU)"
    return classes, titles
