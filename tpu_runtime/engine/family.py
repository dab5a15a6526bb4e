"""The base class every model family builds on: it turns a family's stage programs into compiled programs on a
mesh, and does what all families do alike.

A family package (``families/<name>/``) holds only what is particular to its models: what it recognises, how its
components are built, its rule tables, what one denoising step computes. Everything here is the same for all of
them:

- dtype, mesh and attention choices, validated before anything compiles;
- components built with their parameters on ``meta`` and loaded from safetensors once (``weights.py``), placed on
  the devices by the family's rule table, and the host copy freed; ``plan`` builds the same modules abstract;
- the text encode stage (the family tokenizes and builds the program), the sample preamble's checks, LoRA merges;
- the program table entry for a stage (key = family, stage, model signature, shapes, options, mesh), and the
  compile time and XLA compile counts each stage spent;
- the denoising loop: one compiled step program called once per step, waiting for each step so progress is
  honest and Cancel stops at the next step boundary.

Each stage's programs are built by one method (``encode_program``, ``sample_program``, ``decode_programs``...)
that returns ``StageProgram``s: the function, its example arguments (weights as placed, inputs as shape structs
placed on the mesh) and its key. The stage methods compile and run them; ``plan`` compiles the very same programs
for a TPU topology this process cannot run on (a family made with ``target_devices``: weights are never read, only
their shapes and dtypes).

Construction and the calls named in ``replay.REPLAYED`` run on every process of a multi-host slice.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..errors import InputError, Interrupted, ModelFolderError, StageFileError
from .attention import AttentionConfig, attention_scope, target_platform
from .dtypes import DTYPES, jax_dtype
from .lora import LoraMerger, LoraSpec, name_aliases, read_lora
from .replay import REPLAYED, replayed_init, replayed_method
from .runtime import Runtime, compile_stats, get_runtime
from .sharding import MeshSpec, default_mesh, frame_split_spec, parse_mesh, validate_mesh
from .stages import ImageConditioning, SampleSettings, StageProgram, StageTimings, TextEmbeddings, VideoLatents
from .stepcache import BlockSpec
from .validation import check_number
from .weights import build_empty, keep_fp32_modules, load_into_meta_module, meta_tensors

log = logging.getLogger(__name__)

# width: split the decode's frame width over the devices (seeds 000/001); auto: width on a mesh of more than one
# device (each chip then holds and computes a slice of every frame instead of the whole video), else replicated.
VAE_SHARDINGS = ("auto", "replicated", "width")


@dataclass
class ComponentSource:
    """How one torch component is built and where its tensors are: ``cls`` (its library's fp32 rules come from
    it), ``build()`` (the module from its config), the safetensors ``files``, ``names`` (file key -> module name;
    None: the same), file keys to ``ignore`` (regexes), ``dtype`` (None: the model's), and ``finish`` (what the
    module needs once built: our attention processor...)."""

    cls: type
    build: Callable[[], torch.nn.Module]
    files: list
    what: str
    names: "dict[str, str] | Callable[[list[str]], dict[str, str]] | None" = None
    ignore: tuple[str, ...] = ()
    dtype: torch.dtype | None = None
    finish: Callable[[torch.nn.Module], torch.nn.Module] | None = None


def model_class(library: str, name: str) -> type:
    """A class named in ``model_index.json`` (library, class name), e.g. ("diffusers", "AutoencoderKLWan")."""
    import importlib

    # diffusers names a model that lives in one of its pipeline packages by that package (LTX-2's connectors and
    # vocoder: ["ltx2", "LTX2TextConnectors"]), as its own loader resolves it.
    module = library if library in ("diffusers", "transformers") else f"diffusers.pipelines.{library}"
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        raise ModelFolderError(f"a component of library {library!r} cannot be loaded here (diffusers and "
                               "transformers models, and the models of diffusers' pipelines)") from None
    except AttributeError:
        raise ModelFolderError(f"{library} has no {name}: update diffusers/transformers, or re-download "
                               "model_index.json") from None


def builder(cls: type, config: dict) -> Callable[[], torch.nn.Module]:
    """``cls`` made from a saved config: diffusers' ``from_config``, transformers' config class."""
    if cls.__module__.startswith("diffusers."):
        return lambda: cls.from_config(config)
    kwargs = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("torch_dtype", "dtype")}
    return lambda: cls(cls.config_class(**kwargs))


@contextlib.contextmanager
def forwards_replaced(root: torch.nn.Module, replacement: Callable[[torch.nn.Module], Callable | None]):
    """While the block runs, every submodule of ``root`` for which ``replacement(module)`` gives a function runs
    that function as its forward (for tracing through XLA); the originals come back afterwards."""
    saved = []
    try:
        for module in root.modules():
            forward = replacement(module)
            if forward is not None:
                saved.append((module, module.__dict__.get("forward")))
                module.forward = forward
        yield
    finally:
        for module, previous in reversed(saved):
            if previous is None:
                del module.forward
            else:
                module.forward = previous


class ModelFamily:
    """A loaded model of one family. A family sets ``FAMILY`` and ``FAMILY_NAME`` (from its spec), ``RULES``
    (component -> sharding rule table), reads its configs and calls ``_setup``, and implements ``_source`` (how a
    component is built and loaded), ``tokenize`` and ``encode_program``, ``validate`` / ``validate_settings``,
    ``sample``, ``decode``, ``plan_programs`` and its facts (``native_size``, ``default_fps``)."""

    FAMILY = "?"
    FAMILY_NAME = "?"  # as users write it
    DEFAULT_GUIDANCE = 6.0
    RULES: dict[str, tuple] = {}
    two_experts = False  # Wan 2.2 A14B: a second (low-noise) transformer
    image_input = "none"  # "none": text-to-video; "required": image-to-video; "optional": either (Wan TI2V-5B)
    last_image_input = False  # Wan FLF2V: a last image as well as the first
    #: Step caching (``stepcache.py``): where the transformer keeps its blocks and what they take and return;
    #: None: this family has none (the option is refused).
    STEP_CACHE_BLOCKS: "BlockSpec | None" = None
    #: How diffusers' pipeline of this family calls CFG's two passes: "halves" (one call each, so one cache state
    #: and one decision per pass, though we run them as one batch) or "batch" (one call, one state).
    CFG_CONTEXTS = "batch"
    step_cache_report: dict | None = None  # what the last sampling run's step cache did (``finish_step_cache``)
    step_cache_calibrated: dict | None = None  # a calibrating run's MagCache ratios, one list per transformer

    def __init_subclass__(cls, **kwargs):
        """Every family's construction and stage calls are replayed on the workers of a multi-host slice."""
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            cls.__init__ = replayed_init(cls.__dict__["__init__"])
        for name in REPLAYED:
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "replayed", False):
                setattr(cls, name, replayed_method(method))

    def _setup(self, dtype: str, runtime: Runtime | None, mesh, attention, fsdp: bool, heads: int,
               vae_sharding: str = "auto", target_devices=None) -> None:
        """dtype, mesh and attention for ``heads`` attention heads; call once the model's configs are read.

        ``target_devices``: the devices of a topology to compile for without running (``plan``); the model is then
        abstract: components are built on ``meta`` and placed as shape structs, nothing is read or run."""
        if vae_sharding not in VAE_SHARDINGS:
            raise InputError(f"vae_sharding must be one of {VAE_SHARDINGS}, got {vae_sharding!r}")
        self.runtime = runtime or get_runtime()
        self.abstract = target_devices is not None
        self.devices = list(target_devices) if self.abstract else list(self.runtime.devices)
        if dtype == "auto":
            dtype = "float32" if self.devices[0].platform == "cpu" else "bfloat16"
        if dtype not in DTYPES:
            raise InputError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
        self.dtype_name = dtype
        self.dtype = DTYPES[dtype]
        self.heads = int(heads)
        devices = len(self.devices)
        self.mesh_spec: MeshSpec = parse_mesh(mesh) or default_mesh(devices, self.heads)
        validate_mesh(self.mesh_spec, devices, self.heads)
        self.mesh = self.runtime.make_mesh(self.mesh_spec, self.devices)
        if isinstance(attention, str) or attention is None:
            attention = AttentionConfig(impl=attention or "auto")
        self.attention = attention.resolve(target_platform(self.mesh))
        self.fsdp = bool(fsdp)
        if self.fsdp and self.mesh_spec.dp == 1:
            raise InputError(f"fsdp splits the weights over the mesh's dp axis, and mesh {self.mesh_spec} has dp=1: "
                             "turn fsdp off, or give a mesh with dp=2 (CFG's batch) or more")
        # The decode's layout, resolved once: "auto" is the width split wherever there is more than one device.
        self.vae_sharding = ("width" if self.mesh_spec.devices > 1 else "replicated") if vae_sharding == "auto" \
            else vae_sharding
        self._unsplit_frames: set[tuple] = set()
        self.timings = StageTimings()
        self._parts: dict[str, object] = {}
        self._states: dict[str, dict] = {}
        self._loras: dict[str, LoraMerger] = {}

    @staticmethod
    def _with_layers(config: dict, layers: int | None) -> dict:
        """A transformer config with ``layers`` blocks instead of its own (``plan --layers``: a quick check of a
        full-width model at reduced depth)."""
        if layers is None:
            return config
        if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
            raise InputError(f"layers={layers} must be a positive number of transformer layers")
        return {**config, "num_layers": layers}

    # --- components ------------------------------------------------------------------------------------------
    def _source(self, name: str) -> ComponentSource:
        """How torch component ``name`` is built and loaded; ``KeyError`` for a component the model lacks."""
        raise KeyError(name)

    def _load_tokenizer(self):
        """The model's tokenizer (a host object, never placed)."""
        raise KeyError("tokenizer")

    def _rules_for(self, name: str):
        """The sharding rule table for component ``name``."""
        return self.RULES.get(name, ())

    # FSDP splits the transformers' and encoders' weights, never the VAE's: its weights are small (0.25 GiB for
    # Wan's) against its activations, gathering them would cost every convolution of every frame, and with them
    # split over dp and the frames over the width the Wan decode on an 8-device CPU mesh gave wrong frames (0.13
    # off; each split alone is exact).
    FSDP_SKIPS = ("vae",)

    def _fsdp_for(self, name: str) -> bool:
        return self.fsdp and name not in self.FSDP_SKIPS

    def _build_component(self, name: str) -> torch.nn.Module:
        """Component ``name`` as a host module: loaded from its files, or (abstract) built without tensors."""
        source = self._source(name)
        dtype = source.dtype or self.dtype
        keep = keep_fp32_modules(source.cls, dtype)
        if self.abstract:
            part = build_empty(source.build, dtype, keep)
        else:
            from .weights import TensorSource

            tensors = TensorSource(source.files)
            names = source.names
            if callable(names):
                names = names(tensors.keys())
            elif names is None:
                names = {k: k for k in tensors.keys()}
            part = load_into_meta_module(source.build, tensors, names, dtype, source.what, keep_fp32=keep,
                                         ignore=source.ignore)
            left = meta_tensors(part)
            if left:
                raise ModelFolderError(f"{source.what} left {len(left)} tensor(s) unset (e.g. {left[:3]})")
        return source.finish(part) if source.finish is not None else part

    def _component(self, name: str):
        """Component ``name``, loaded once; torch modules are moved to the devices and their host copy freed.
        An abstract model builds the module on ``meta`` and keeps shape structs as its state."""
        if name in self._parts:
            return self._parts[name]
        start = time.perf_counter()
        if name == "tokenizer":
            part = self._load_tokenizer()
        else:
            try:
                part = self._build_component(name).requires_grad_(False)
            except KeyError:
                if self.abstract:
                    raise RuntimeError(f"{self.label} is planned for devices this process cannot run on: it has no "
                                       f"{name} to use; compile its stage programs with plan") from None
                raise
            if self.abstract:
                self._states[name] = self.runtime.abstract_state(part, self.mesh, self._rules_for(name),
                                                                 self._fsdp_for(name))
            else:
                self._states[name] = self.runtime.module_state(part, self.mesh, self._rules_for(name),
                                                               fsdp=self._fsdp_for(name))
                # The device copy is the one used from now on; free the host copy (real models are many GB).
                part.to("meta")
        self._parts[name] = part
        seconds = time.perf_counter() - start
        self.timings.load += seconds
        log.info("loaded %s in %.1f s", self._origin(name), seconds)
        return part

    def _origin(self, name: str) -> str:
        """Where component ``name`` is read from, for messages."""
        return f"{self.label}/{name}"

    def source_paths(self) -> list[Path]:
        """The files and folders the model is read from (every host of a slice must have the same)."""
        return [self.path]

    @replayed_method
    def release(self) -> None:
        """Drop the device copies of the weights (ComfyUI's 'unload models')."""
        self._states.clear()
        self._parts.clear()
        self._loras.clear()

    # --- LoRA ------------------------------------------------------------------------------------------------
    def _lora_original_name(self, name: str) -> str:
        """The name the original checkpoint (and LoRA files trained on it) gives parameter ``name``."""
        return name

    def lora_targets(self, settings: SampleSettings) -> dict[str, tuple]:
        """Component -> the LoRAs ``settings`` asks for on it."""
        if settings.loras_2 and not self.two_experts:
            raise InputError(f"{self.label} has one transformer: the low-noise LoRA slot (--lora-2, lora_2) is for "
                             "two-expert Wan 2.2 models; give these LoRAs as --lora")
        targets = {"transformer": tuple(settings.loras)}
        if self.two_experts:
            targets["transformer_2"] = tuple(settings.loras_2)
        for specs in targets.values():
            for spec in specs:
                if not isinstance(spec, LoraSpec):
                    raise InputError(f"a LoRA must be given as a file and a strength, got {spec!r}")
        return targets

    @replayed_method
    def apply_loras(self, targets: dict[str, tuple], merge: bool = True) -> None:
        """Merge the LoRAs of ``targets`` (component -> LoraSpecs, as ``lora_targets`` gives) into those weights
        on the devices, removing any others merged before; nothing happens when they are the ones already merged.
        Every file is read and checked before any weight changes; ``merge=False`` only reads and checks them."""
        import jax

        for component, specs in targets.items():
            if component not in self._loras and not specs:
                continue
            self._component(component)
            start = time.perf_counter()
            merger = self._loras.setdefault(component, LoraMerger(self.runtime, component))
            state = self._states[component]
            params = {name: tuple(value.shape) for name, value in state.items()}
            aliases = name_aliases(params, self._lora_original_name)
            what = f"{self.label} ({component})" if self.two_experts else self.label

            def read(path, params=params, aliases=aliases, what=what):
                return read_lora(path, params, aliases, what, self.FAMILY_NAME)

            if not merge:
                for spec in specs:
                    merger.read(spec, read)
                continue
            if merger.apply(state, specs, read):
                jax.block_until_ready([state[name] for name in merger.touched])
                seconds = time.perf_counter() - start
                self.timings.lora += seconds
                log.info("%s: %s merged in %.2f s (%d weights)", what, ", ".join(
                    f"{Path(spec.path).name}:{spec.strength:g}" for spec in specs) or "LoRAs removed", seconds,
                    len(merger.touched))

    # --- checks ----------------------------------------------------------------------------------------------
    def check_images(self, image_given: bool, last_image_given: bool, how: tuple[str, str] = ("--image",
                     "--last-image")) -> None:
        """Refuse an image this model does not take, or a missing one it needs (``how``: what the user sets)."""
        first, last = how
        if self.image_input == "none" and (image_given or last_image_given):
            raise InputError(f"{self.label} is a text-to-video model and takes no image: drop {first}, or load an "
                             "image-to-video model (e.g. CogVideoX-5b-I2V, Wan2.1-I2V-14B-480P)")
        if self.image_input == "required" and not image_given:
            raise InputError(f"{self.label} is an image-to-video model: give the first frame with {first}")
        if last_image_given and not self.last_image_input:
            raise InputError(f"{self.label} takes only a first image: drop {last} (first-and-last-frame video is "
                             "Wan2.1-FLF2V-14B's)")
        if self.last_image_input and image_given and not last_image_given:
            raise InputError(f"{self.label} makes a video between a first and a last frame: give {last} too")
        if last_image_given and not image_given:
            raise InputError(f"{last} needs {first} as well (the first frame)")

    def check_conditioning(self, image: "ImageConditioning | None", s: "SampleSettings") -> None:
        """Refuse sampling without the image an image-to-video model needs, or with one made for another model
        or another video size."""
        if image is None:
            if self.image_input == "required":
                raise InputError(f"{self.label} is an image-to-video model: encode the first frame (image encode "
                                 "stage) and pass it to the sampler")
            return
        if self.image_input == "none":
            raise InputError(f"{self.label} is a text-to-video model and takes no image: disconnect the image")
        if image.model_signature != self.signature:
            raise StageFileError("the image was encoded by a different model than the one sampling: re-run the "
                                 "image encode stage with this model")
        made, asked = (image.height, image.width, image.num_frames), (s.height, s.width, s.num_frames)
        if made != asked:
            raise InputError(f"the image was encoded for {made[2]} frames of {made[1]}x{made[0]} (width x height), "
                             f"the sampler asks for {asked[2]} frames of {asked[1]}x{asked[0]}: encode it at the "
                             "sampler's size, or set the sampler to the image encode's size")

    def check_made_here(self, value: "TextEmbeddings | VideoLatents") -> None:
        """Refuse embeddings or latents that a model of another architecture made."""
        if value.model_signature == self.signature:
            return
        if isinstance(value, TextEmbeddings):
            raise StageFileError("the text embeddings were made by a different model than the one sampling: "
                                 "re-run the text encode stage with this model")
        raise StageFileError("the latents were sampled by a different model than the one decoding: decode with "
                             "the model that sampled them, or re-run sampling")

    def check_embeddings(self, embeddings: TextEmbeddings, expected: tuple[int, ...]) -> None:
        self.check_made_here(embeddings)
        if tuple(embeddings.prompt_embeds.shape) != tuple(expected):
            raise StageFileError(
                f"text embeddings have shape {tuple(embeddings.prompt_embeds.shape)}, this model takes "
                f"{tuple(expected)}: re-run the text encode stage with this model"
            )

    def uses_cfg(self, s: SampleSettings) -> bool:
        """Whether settings ``s`` sample with the CFG batch (negative and positive prompt), as diffusers decides."""
        return (self.DEFAULT_GUIDANCE if s.guidance is None else float(s.guidance)) > 1.0

    def check_cfg_mesh(self, cfg: bool) -> None:
        validate_mesh(self.mesh_spec, len(self.devices), self.heads, batch=2 if cfg else 1)

    def check_settings(self, s: SampleSettings) -> None:
        """Settings a model can run, checked before anything runs: every number against its rule (zero and
        negative values are refused, never replaced), the sizes, and the options of this family."""
        check_number("steps", s.steps, minimum=1, integer=True)
        check_number("seed", s.seed, minimum=0, integer=True)
        check_number("guidance", s.guidance, minimum=0.0, optional=True)
        check_number("guidance_2", s.guidance_2, minimum=0.0, optional=True)
        check_number("shift", s.shift, above=0.0, optional=True)
        check_number("boundary", s.boundary, above=0.0, below=1.0, optional=True)
        self.validate(s.height, s.width, s.num_frames)
        self.validate_settings(s)
        self.check_foreign_settings(s)
        self.check_step_cache(s)

    #: The settings of ``stages.FAMILY_SETTINGS`` this family reads; any other one given is refused.
    OWN_SETTINGS: frozenset[str] = frozenset()

    def check_foreign_settings(self, s: SampleSettings) -> None:
        """Refuse a setting of another family's models (given a value), never ignore it."""
        from .stages import FAMILY_SETTINGS

        for name, owner in FAMILY_SETTINGS.items():
            value = getattr(s, name)
            if name not in self.OWN_SETTINGS and value is not None and value is not False:
                raise InputError(f"{name}={value} is an option of {owner} models; {self.label} is a "
                                 f"{self.FAMILY_NAME} model: leave {name} unset")

    # --- step caching ------------------------------------------------------------------------------------------
    def published_mag_ratios(self, s: SampleSettings, image: bool) -> "tuple[str, dict] | None":
        """MagCache's published ratios for this model, (which model's, one list per transformer), or None."""
        return None

    def check_step_cache(self, s: SampleSettings) -> None:
        """The step cache's settings, and (MagCache) that there are ratios to run with: the user's or the model's
        published ones; refused before anything compiles, naming both ways out."""
        cache = s.cache
        if cache is None or not cache.active:
            return
        cache.check()
        if self.STEP_CACHE_BLOCKS is None:
            raise InputError(f"{self.FAMILY_NAME} has no step caching yet: run it with cache none")
        if cache.method != "magcache" or cache.calibrate:
            return
        names = ["transformer"] + (["transformer_2"] if self.two_experts else [])
        given = cache.mag_ratios or {}
        if given:
            extra = sorted(set(given) - set(names) - {"*"})
            missing = [n for n in names if n not in given and "*" not in given]
            if extra or missing:
                raise InputError(f"mag ratios name {', '.join(extra or missing)}: this model's transformers are "
                                 f"{', '.join(names)}; give one list (used for each) or an object with one list per "
                                 "transformer")
            return
        if self.published_mag_ratios(s, image=False) is None:
            raise InputError(f"{self.label} ({self.FAMILY_NAME}) has no published MagCache ratios: they are "
                             "measured per model (the released Wan models have them). Give yours with --mag-ratios (comma-separated, or a JSON "
                             "file; the node's mag_ratios), or measure them with --cache magcache --cache-calibrate, "
                             "which writes mag_ratios.json")

    def step_function(self, program: StageProgram, s: SampleSettings, experts: list[str], cfg: bool,
                      image: bool = False) -> Callable:
        """``run(i, state, *args)`` for step ``i`` of a sampling run: the compiled ``program``, or with a step cache
        in ``s`` its cached programs (``experts``: the transformer each step uses). Compiled here, before the
        first step; ``step_cache_report`` holds what the cache did once the run ends."""
        self.step_cache_report = None
        cache = s.cache
        if cache is None or not cache.active:
            executable = self.compile_stage(program)
            return lambda i, state, *args: executable(state, *args)
        from .stepcache import StepCacheRunner

        source, ratios = "", None
        if cache.method == "magcache" and not cache.calibrate:
            if cache.mag_ratios:
                source, ratios = "given", cache.mag_ratios
            else:
                source, ratios = self.published_mag_ratios(s, image)
        runner = StepCacheRunner(self, cache, program, experts, cfg, ratios, source)
        self._step_cache_runner = runner
        return runner

    def finish_step_cache(self) -> None:
        """After a sampling run: what its step cache did, in ``step_cache_report`` (logged)."""
        runner = self.__dict__.pop("_step_cache_runner", None)
        if runner is not None:
            self.step_cache_report = runner.report()
            self.step_cache_calibrated = runner.calibrated() if runner.method == "calibrate" else None
            log.info("%s", runner.summary())

    def agree(self, what: str, values):
        """A host decision every process of a multi-host slice takes alike: the first process's ``values``."""
        slice_ = getattr(self.runtime, "slice", None)
        return values if slice_ is None else slice_.agree(what, values)

    def check_sample(self, embeddings: TextEmbeddings, s: SampleSettings, image: "ImageConditioning | None",
                     cfg: bool) -> None:
        """Everything a sampling run checks before it compiles: the settings, the image, where the embeddings
        come from, the mesh against the CFG batch; then the LoRAs are merged (a LoRA that does not fit is refused
        before anything compiles)."""
        self.check_settings(s)
        self.check_conditioning(image, s)
        self.check_embeddings(embeddings, self.text_shape())
        self.check_cfg_mesh(cfg)
        self.apply_loras(self.lora_targets(s))

    # --- stage 1: text ---------------------------------------------------------------------------------------
    def tokenize(self, texts: list[str]) -> tuple[torch.Tensor, ...]:
        """Token tensors for ``texts`` as the encode program takes them (ids, and a mask where the family uses
        one)."""
        raise NotImplementedError

    def text_shape(self) -> tuple[int, ...]:
        """The shape ``[1, L, D]`` of one prompt's embeddings."""
        raise NotImplementedError

    @replayed_method
    def encode(self, prompt: str, negative_prompt: str = "") -> TextEmbeddings:
        """Embeddings of ``prompt`` and ``negative_prompt``, one program run over both."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise InputError("prompt is empty: describe the video you want")
        negative_prompt = negative_prompt or ""
        tokens = self.tokenize([negative_prompt, prompt])
        program = self.encode_program()
        executable = self.compile_stage(program)
        inputs = [self.put(t.to(torch.int32)) for t in tokens]
        start = time.perf_counter()
        embeds = self.runtime.to_cpu(executable(program.example[0], *inputs))
        self._record_run("encode", start)
        return TextEmbeddings(embeds[1:2], embeds[0:1], prompt, negative_prompt, self.signature)

    # --- programs --------------------------------------------------------------------------------------------
    def _compile(self, stage: str, fn, key, *example, describe: str):
        """The compiled program of ``stage`` for ``key`` (compiled on first use), with its cost recorded."""
        before = compile_stats()
        start = time.perf_counter()
        full_key = (self.FAMILY, stage, self.signature, key, self.dtype_name, self.mesh_spec.sizes, self.fsdp)
        program = self.runtime.compiled(full_key, fn, *example, describe=describe)
        self.timings.programs[stage] = self.runtime.program_info(full_key)
        self.timings.compile[stage] = self.timings.compile.get(stage, 0.0) + time.perf_counter() - start
        delta = compile_stats().since(before)
        self.timings.compiles[stage] = self.timings.compiles.get(stage, 0) + delta.xla_compiles
        self.timings.cache_hits[stage] = self.timings.cache_hits.get(stage, 0) + delta.persistent_cache_hits
        return program

    def compile_stage(self, program: StageProgram):
        """The executable of ``program`` (compiled on first use, then from the program table)."""
        if self.abstract:
            raise RuntimeError(f"{self.label} is planned for devices this process cannot run on: compile its "
                               "stage programs with plan, not the runtime")
        with program.scope():
            executable = self._compile(program.stage, program.fn, program.key, *program.example,
                                       describe=program.describe)
        slice_ = getattr(self.runtime, "slice", None)
        if slice_ is not None:  # a multi-host slice: every host compiled it before any runs it
            slice_.barrier(program.describe)
        return executable

    def arg(self, shape, dtype, spec: tuple = ()):
        """An input of a stage program: a shape struct of ``dtype`` (torch or jax) placed on the mesh by ``spec``."""
        import jax

        if isinstance(dtype, torch.dtype):
            dtype = jax_dtype(dtype)
        return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=self.runtime.sharding(self.mesh, spec))

    def model_dtype(self):
        """The model dtype as a jax dtype (inside programs)."""
        return jax_dtype(self.dtype)

    def traced(self, *patches: Callable[[], contextlib.AbstractContextManager]):
        """What a stage is traced under: this model's attention settings on its mesh, and ``patches`` (module
        replacements for XLA) around it. Called with patches, it returns a scope for a ``StageProgram``."""
        if patches:
            @contextlib.contextmanager
            def scope():
                with contextlib.ExitStack() as stack:
                    stack.enter_context(attention_scope(self.attention, self.mesh))
                    for patch in patches:
                        stack.enter_context(patch())
                    yield

            return scope
        return attention_scope(self.attention, self.mesh)

    def _record_run(self, stage: str, start: float) -> None:
        self.timings.run[stage] = self.timings.run.get(stage, 0.0) + time.perf_counter() - start

    def put(self, value, spec: tuple = ()):
        """CPU tensors onto this model's mesh, placed by ``spec`` (replicated by default)."""
        return self.runtime.put(value, self.runtime.sharding(self.mesh, spec))

    def run_steps(self, count: int, step: Callable[[int], object], on_step=None, should_stop=None) -> None:
        """Call ``step(i)`` for i in 0..count-1, waiting for each; ``should_stop()`` before each, ``on_step(i+1,
        count)`` after. ``step`` returns a device array of its result to wait on."""
        start = time.perf_counter()
        for i in range(count):
            if should_stop is not None and should_stop():
                raise Interrupted(f"sampling interrupted before step {i + 1} of {count}")
            result = step(i)
            # JAX dispatches asynchronously: without waiting, the loop would queue every step at once, the
            # progress bar would race ahead of the device and Cancel could not stop the steps already queued.
            # A step takes seconds on real models; the wait costs only the next dispatch's latency.
            result.block_until_ready()
            if on_step is not None:
                on_step(i + 1, count)
        self._record_run("sample", start)

    def _vae_input_spec(self, shape) -> tuple:
        """``width``: VAE tensors [B, C, T, H, W] split on W over the mesh axes with the most devices that divide it
        (all of them on a v6e-8 at 1280 wide; dp alone for CogVideoX's 720 = 90 latent columns on dp=2,tp=4), and
        on H over those left that divide it (tp for CogVideoX's 480 = 60 latent rows there), so that as many chips
        as the frame allows share it (XLA adds the convolutions' halos); otherwise replicated."""
        if self.vae_sharding != "width":
            return ()
        spec = frame_split_spec(dict(self.mesh.shape), tuple(shape))
        if not spec and self.mesh_spec.devices > 1 and tuple(shape[-2:]) not in self._unsplit_frames:
            self._unsplit_frames.add(tuple(shape[-2:]))
            log.warning("vae_sharding width: no axis of mesh %s divides the latent frame %dx%d, so the decode is "
                        "replicated; a latent width or height divisible by %d would split", self.mesh_spec,
                        shape[-1], shape[-2], min(n for n in self.mesh.shape.values() if n > 1))
        return spec

    # --- what the CLI and the nodes ask of every family --------------------------------------------------------
    def native_size(self) -> tuple[int, int, int]:
        """(height, width, frames) the model was trained at."""
        raise NotImplementedError

    def default_fps(self) -> int:
        """Frames per second of the model's training videos (the mp4's default)."""
        raise NotImplementedError

    @property
    def label(self) -> str:
        """The model's name in messages: its folder's name."""
        return self.path.name

    # --- what bench compares with --------------------------------------------------------------------------
    def reference_pipeline(self) -> tuple[str, dict]:
        """diffusers' pipeline class for this model's folder and the call arguments it needs to make the same
        video (the oracle ``bench`` times against)."""
        return self.index["_class_name"], {}

    def vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Stage-2 latents as diffusers' pipeline hands them to ``vae.decode``."""
        raise NotImplementedError

    def decode_variants(self) -> dict[str, tuple]:
        """The decode's options with several lowerings worth comparing (``bench``): option -> choices."""
        return {}

    def describe(self) -> dict:
        """Plain facts for generation_config.json."""
        return {"family": self.FAMILY, "generation": self.generation, "model_signature": self.signature}
