"""What every model family shares: the values passed between stages, the settings, the timings, and the base
class that turns a family's three stage functions into compiled programs on a mesh.

A family module (``cogvideox.py``, ``wan.py``) holds only what is particular to its models: how a folder or file
is recognised and loaded, how text is encoded, what one denoising step computes and how latents are decoded.
Everything here is the same for all of them:

- dtype, mesh and attention choices, validated before anything compiles;
- weights placed on the devices once, by the family's sharding rule table, and the host copy freed;
- the program table entry for a stage (key = family, stage, model signature, shapes, options, mesh), and the
  compile time and XLA compile counts each stage spent;
- the denoising loop: one compiled step program called once per step, waiting for each step so progress is
  honest and Cancel stops at the next step boundary.

Each stage's programs are built by one method (``encode_program``, ``sample_program``, ``decode_programs``) that
returns ``StageProgram``s: the function, its example arguments (weights as placed, inputs as shape structs
placed on the mesh) and its key. The stage methods compile and run it; ``plan`` compiles the very same programs
for a TPU topology this process cannot run on (a family made with ``target_devices``: weights are never read,
only their shapes and dtypes).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .attention import AttentionConfig, attention_scope, target_platform
from .errors import InputError, Interrupted, StageFileError
from .lora import LoraMerger, LoraSpec, name_aliases, read_lora
from .multihost import REPLAYED, replayed_init, replayed_method
from .runtime import Runtime, compile_stats, get_runtime
from .sharding import MeshSpec, default_mesh, frame_split_spec, parse_mesh, validate_mesh

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# width: split the decode's frame width over the devices (seeds 000/001); auto: width on a mesh of more than one
# device (each chip then holds and computes a slice of every frame instead of the whole video), else replicated.
VAE_SHARDINGS = ("auto", "replicated", "width")


# --- values passed between stages ----------------------------------------------------------------------------
@dataclass
class TextEmbeddings:
    """Stage 1 output: text-encoder embeddings for the prompt and the negative prompt, CPU tensors ``[1, L, D]``."""

    prompt_embeds: torch.Tensor
    negative_prompt_embeds: torch.Tensor
    prompt: str
    negative_prompt: str
    model_signature: str


@dataclass
class VideoLatents:
    """Stage 2 output: denoised latents ``[B, C, T, h, w]`` float32 on CPU, before the VAE's scaling."""

    latents: torch.Tensor
    height: int
    width: int
    num_frames: int
    model_signature: str


@dataclass
class ImageConditioning:
    """Image-encode output: what sampling takes from the first (and last) image, CPU tensors, for one video size.

    ``latents``: the VAE encoding of the conditioning (CogVideoX: the image posterior's mean ``[1, C, 1, h, w]``;
    Wan: the normalised latent condition, with its frame mask in front for the models that concatenate it);
    ``latents_std``: CogVideoX only, the posterior's std: sampling draws ``mean + std * noise`` from the seed as
    its first random draw, as diffusers does; ``image_embeds``: Wan 2.1 I2V / FLF2V, the CLIP vision hidden
    states ``[images, 257, 1280]``."""

    latents: torch.Tensor
    height: int
    width: int
    num_frames: int
    model_signature: str
    latents_std: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None
    last_image: bool = False


@dataclass
class SampleSettings:
    """One generation's sampling settings. Options a model does not have are refused by its family, not ignored."""

    height: int
    width: int
    num_frames: int
    steps: int = 50
    guidance: float = 6.0
    seed: int = 0
    scheduler: str | None = None  # None: the model's own
    dynamic_cfg: bool = False  # CogVideoX only
    shift: float | None = None  # Wan: flow shift; None: the model's scheduler config
    guidance_2: float | None = None  # Wan 2.2 two experts: guidance of the low-noise expert (default: guidance)
    boundary: float | None = None  # Wan 2.2 two experts: boundary ratio (default: the model's)
    loras: tuple = ()  # LoraSpec: merged into the transformer (Wan 2.2 two experts: the high-noise expert)
    loras_2: tuple = ()  # LoraSpec: Wan 2.2 two experts only: merged into the low-noise expert


@dataclass
class StageProgram:
    """One stage's program as the runtime compiles it. ``example`` holds the weights' states as placed (or their
    shape structs when planning) and every other input as a ``jax.ShapeDtypeStruct`` placed on the mesh;
    ``scope`` is what tracing needs around it (attention settings, module replacements); ``components`` names the
    weights it reads; ``part`` tells apart the programs of a stage that has several (Wan's frame-by-frame decode)."""

    stage: str
    fn: Callable
    example: tuple
    key: tuple
    describe: str
    scope: Callable[[], contextlib.AbstractContextManager]
    components: tuple[str, ...]
    part: str = ""

    @property
    def name(self) -> str:
        return f"{self.stage}_{self.part}" if self.part else self.stage


@dataclass
class StageTimings:
    """Seconds spent per stage, split into compile and run, and how many XLA programs each compiled."""

    load: float = 0.0
    compile: dict[str, float] = field(default_factory=dict)
    run: dict[str, float] = field(default_factory=dict)
    compiles: dict[str, int] = field(default_factory=dict)
    lora: float = 0.0  # seconds spent merging LoRAs into the weights (reading the files included)
    cache_hits: dict[str, int] = field(default_factory=dict)
    programs: dict[str, object] = field(default_factory=dict)  # each stage's latest CompiledProgram (time, memory)


def config_signature(configs: dict[str, dict]) -> str:
    """A short hash of component configs: stage files record it, so files from another model are refused."""
    h = hashlib.sha256()
    for name in sorted(configs):
        config = {k: v for k, v in configs[name].items()
                  if not k.startswith("_") and k not in ("torch_dtype", "dtype")}
        h.update(name.encode() + json.dumps(config, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def nearest_multiple(value, multiple: int) -> int:
    """The positive multiple of ``multiple`` nearest ``value`` (for error messages)."""
    try:
        return max(multiple, int(round(float(value) / multiple)) * multiple)
    except (TypeError, ValueError):
        return multiple


def size_problems(height, width, multiple: int, why: str = "") -> list[str]:
    """Messages for a height/width that is not a positive multiple of ``multiple``."""
    problems = []
    for name, value in (("height", height), ("width", width)):
        if not isinstance(value, int) or value <= 0 or value % multiple:
            problems.append(f"{name}={value} must be a positive multiple of {multiple}{why} "
                            f"(e.g. {nearest_multiple(value, multiple)})")
    return problems


def frame_problem(num_frames, rule: int, native: int, model: str) -> str | None:
    """A message for a frame count that is not ``rule * N + 1``, naming the nearest valid value."""
    if isinstance(num_frames, int) and num_frames >= 1 and (num_frames - 1) % rule == 0:
        return None
    try:
        k = max(0, round((float(num_frames) - 1) / rule))
    except (TypeError, ValueError):
        k = 0
    return (f"frames={num_frames} must be {rule}*N+1 for {model} "
            f"(e.g. {k * rule + 1} or {native}, the native length)")


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


def jax_dtype(dtype: torch.dtype):
    import jax.numpy as jnp

    return {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16}[dtype]


# --- the base class ------------------------------------------------------------------------------------------
class ModelFamily:
    """A loaded model of one family. Subclasses set ``FAMILY``, ``signature``, ``heads`` and the component loaders,
    and implement ``validate``, ``encode``, ``sample``, ``decode`` with the helpers below.

    Construction and the calls named in ``multihost.REPLAYED`` run on every process of a multi-host slice (a new
    stage method that runs programs on the devices belongs in that list)."""

    FAMILY = "?"
    FAMILY_NAME = "?"  # as users write it
    DEFAULT_GUIDANCE = 6.0
    two_experts = False  # Wan 2.2 A14B: a second (low-noise) transformer
    image_input = "none"  # "none": text-to-video; "required": image-to-video; "optional": either (Wan TI2V-5B)
    last_image_input = False  # Wan FLF2V: a last image as well as the first

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

    # --- components ------------------------------------------------------------------------------------------
    def _load_component(self, name: str):
        """Build component ``name`` on the host (a torch module or a tokenizer). Subclasses implement it."""
        raise NotImplementedError

    def _abstract_component(self, name: str) -> torch.nn.Module:
        """Component ``name`` built on ``meta`` with the dtypes loading would give it (for ``plan``)."""
        raise NotImplementedError

    def _rules_for(self, name: str):
        """The sharding rule table for component ``name``."""
        return ()

    # FSDP splits the transformers' and encoders' weights, never the VAE's: its weights are small (0.25 GiB for
    # Wan's) against its activations, gathering them would cost every convolution of every frame, and with them
    # split over dp and the frames over the width the Wan decode on an 8-device CPU mesh gave wrong frames (0.13
    # off; each split alone is exact).
    FSDP_SKIPS = ("vae",)

    def _fsdp_for(self, name: str) -> bool:
        return self.fsdp and name not in self.FSDP_SKIPS

    def _component(self, name: str):
        """Component ``name``, loaded once; torch modules are moved to the devices and their host copy freed.
        An abstract model builds the module on ``meta`` and keeps shape structs as its state."""
        if name in self._parts:
            return self._parts[name]
        start = time.perf_counter()
        if self.abstract:
            try:
                part = self._abstract_component(name).requires_grad_(False)
            except KeyError:
                raise RuntimeError(f"{self.label} is planned for devices this process cannot run on: it has no "
                                   f"{name} to use; compile its stage programs with plan") from None
            self._states[name] = self.runtime.abstract_state(part, self.mesh, self._rules_for(name),
                                                             self._fsdp_for(name))
        else:
            part = self._load_component(name)
        if isinstance(part, torch.nn.Module) and not self.abstract:
            part.requires_grad_(False)
            self._states[name] = self.runtime.module_state(part, self.mesh, self._rules_for(name),
                                                           fsdp=self._fsdp_for(name))
            # The device copy is the one used from now on; free the host copy (real models are many GB).
            part.to("meta")
        self._parts[name] = part
        seconds = time.perf_counter() - start
        self.timings.load += seconds
        log.info("loaded %s/%s in %.1f s", self.label, name, seconds)
        return part

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

    @staticmethod
    def check_steps(steps) -> None:
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise InputError(f"steps={steps} must be a positive whole number (50 is the usual choice)")

    def check_embeddings(self, embeddings: TextEmbeddings, expected: tuple[int, ...]) -> None:
        self.check_made_here(embeddings)
        if tuple(embeddings.prompt_embeds.shape) != tuple(expected):
            raise StageFileError(
                f"text embeddings have shape {tuple(embeddings.prompt_embeds.shape)}, this model takes "
                f"{tuple(expected)}: re-run the text encode stage with this model"
            )

    def check_cfg_mesh(self, cfg: bool) -> None:
        validate_mesh(self.mesh_spec, len(self.devices), self.heads, batch=2 if cfg else 1)

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
            return self._compile(program.stage, program.fn, program.key, *program.example,
                                 describe=program.describe)

    def arg(self, shape, dtype, spec: tuple = ()):
        """An input of a stage program: a shape struct of ``dtype`` (torch or jax) placed on the mesh by ``spec``."""
        import jax

        if isinstance(dtype, torch.dtype):
            from .runtime import jax_dtype_of

            dtype = jax_dtype_of(dtype)
        return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=self.runtime.sharding(self.mesh, spec))

    def traced(self):
        """What every stage is traced under: this model's attention settings on its mesh."""
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

    def _vae_placement(self) -> tuple[Callable, Callable]:
        """For the VAE programs that run a video in pieces (Wan's frames and chunks, CogVideoX's latent batches):
        ``keep(value)`` inside a program (a carried value stays placed as the next call takes it) and
        ``placed(struct)`` (that placement as the next program's input)."""
        import jax

        def keep(value):
            spec = self._vae_input_spec(value.shape)
            return jax.lax.with_sharding_constraint(value, self.runtime.sharding(self.mesh, spec))

        def placed(struct):
            return None if struct is None else self.arg(struct.shape, struct.dtype, self._vae_input_spec(struct.shape))

        return keep, placed

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

    def describe(self) -> dict:
        """Plain facts for generation_config.json."""
        return {"family": self.FAMILY, "generation": self.generation, "model_signature": self.signature}
