"""The base class every model family builds on (``ModelFamily``): the stage API the CLI, the nodes, ``plan`` and a
multi-host slice call, and what all families do alike.

A family package (``families/<name>/``) holds only what is particular to its models: its declaration (``SPEC``:
settings, stages, recipes, node spec), what it recognises, how its components are built, its rule tables, what
its stage programs compute. ``ModelFamily`` is made of parts with one job each:

- ``Components`` (``components.py``): components built on ``meta``, loaded from safetensors once, placed by the
  family's rule table, the host copy freed; ``plan`` builds the same modules abstract;
- ``Checks`` (``checks.py``): sizes, settings (the family's own options against their declarations), images,
  stage values and the mesh, validated before anything compiles;
- ``FamilyLoras`` (``lora.py``): LoRA slots and merges on the devices;
- ``StepCaching`` (``stepcache.py``): the step cache's checks and its step function;
- ``CompiledStages`` (``compiled.py``): the program table entry of each stage program, its inputs' placement and
  what each stage spent.

and here: dtype, mesh and attention choices; the stages written once over the family's hooks (``encode`` over
``tokenize`` and ``encode_program``; ``sample`` over ``sampling_run``: one compiled step program called once per
step, waiting for each so progress is honest and Cancel stops at the next step boundary; ``decode`` over
``decode_programs``). Each stage's programs are built by one method of the same name in every family
(``encode_program``, ``image_programs``, ``sample_program``, ``decode_programs``, ``plan_programs``) that
returns ``StageProgram``s: the function, its example arguments (weights as placed, inputs as shape structs placed
on the mesh) and its key. ``plan`` compiles the very same programs for a TPU topology this process cannot run on
(a family made with ``target_devices``: weights are never read, only their shapes and dtypes).

Construction and every stage call (those below, and those the family's declaration adds: ``SPEC.stages``) run on
every process of a multi-host slice (``replay.py``).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from ..errors import InputError, Interrupted
from .attention import AttentionConfig, target_platform
from .checks import Checks
from .compiled import CompiledStages
from .components import ComponentSource, Components, builder, model_class  # noqa: F401 (a family module's names)
from .dtypes import DTYPES
from .lora import FamilyLoras
from .replay import replayed_init, replayed_method
from .runtime import Runtime, get_runtime
from .sharding import MeshSpec, default_mesh, frame_split_spec, parse_mesh, validate_mesh
from .stages import ImageConditioning, SampleSettings, SamplingRun, StageProgram, StageTimings, TextEmbeddings, \
    VideoLatents
from .stepcache import StepCaching

log = logging.getLogger(__name__)

# width: split the decode's frame width over the devices (seeds 000/001); auto: width on a mesh of more than one
# device (each chip then holds and computes a slice of every frame instead of the whole video), else replicated.
VAE_SHARDINGS = ("auto", "replicated", "width")

# The stage calls every family has, replayed on the workers of a multi-host slice with the construction; a
# family's own stage calls (its declaration's ``stages``) join them.
STAGE_CALLS = ("encode", "encode_image", "sample", "decode", "apply_loras", "release")


class ModelFamily(Components, Checks, FamilyLoras, StepCaching, CompiledStages):
    """A loaded model of one family. A family sets ``SPEC`` (its declaration: ``FAMILY``, ``FAMILY_NAME``,
    ``DEFAULT_GUIDANCE`` and ``DEFAULT_STEPS`` come from it) and ``RULES``, reads its configs and calls
    ``_setup``, and implements the hooks below: ``_source`` (how a component is built and loaded),
    ``tokenize`` / ``text_shape`` / ``encode_program``, ``validate`` (and ``validate_settings``),
    ``encode_image`` / ``image_programs`` where it takes images, ``sampling_run``, ``decode_programs`` /
    ``decode_inputs`` / ``latent_channels``, ``plan_programs`` and its facts (``native_size``, ``default_fps``)."""

    SPEC = None  # the family's FamilySpec
    FAMILY = "?"
    FAMILY_NAME = "?"  # as users write it
    DEFAULT_GUIDANCE = 6.0
    DEFAULT_STEPS = 50

    def __init_subclass__(cls, **kwargs):
        """The declaration's facts as class attributes; construction and every stage call replayed on the
        workers of a multi-host slice."""
        super().__init_subclass__(**kwargs)
        spec = cls.__dict__.get("SPEC")
        if spec is not None:
            cls.FAMILY, cls.FAMILY_NAME = spec.name, spec.display_name
            cls.DEFAULT_GUIDANCE, cls.DEFAULT_STEPS = spec.sampling.guidance, spec.sampling.steps
        if "__init__" in cls.__dict__:
            cls.__init__ = replayed_init(cls.__dict__["__init__"])
        for name in cls.stage_calls():
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "replayed", False):
                setattr(cls, name, replayed_method(method))

    @classmethod
    def stage_calls(cls) -> tuple[str, ...]:
        """The calls a multi-host slice replays on its workers: every family's and this family's own."""
        return STAGE_CALLS + tuple(cls.SPEC.stages if cls.SPEC is not None else ())

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
        self._init_components()
        self._init_loras()

    @staticmethod
    def _with_layers(config: dict, layers: int | None) -> dict:
        """A transformer config with ``layers`` blocks instead of its own (``plan --layers``: a quick check of a
        full-width model at reduced depth)."""
        if layers is None:
            return config
        if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
            raise InputError(f"layers={layers} must be a positive number of transformer layers")
        return {**config, "num_layers": layers}

    @replayed_method
    def release(self) -> None:
        """Drop the device copies of the weights and what LoRA merges kept (ComfyUI's 'unload models')."""
        self.release_components()
        self._loras.clear()

    # --- stage 1: text ---------------------------------------------------------------------------------------
    def tokenize(self, texts: list[str]) -> tuple[torch.Tensor, ...]:
        """Token tensors for ``texts`` as the encode program takes them (ids, and a mask where the family uses
        one)."""
        raise NotImplementedError

    def text_shape(self) -> tuple[int, ...]:
        """The shape ``[1, L, D]`` of one prompt's embeddings."""
        raise NotImplementedError

    def encode_program(self) -> StageProgram:
        """The text encoder over ``[negative, positive]``'s tokens: embeddings ``[2, L, D]`` (or, for a model with
        a sound track, a video and a sound stream)."""
        raise NotImplementedError

    @replayed_method
    def encode(self, prompt: str, negative_prompt: str = "") -> TextEmbeddings:
        """Embeddings of ``prompt`` and ``negative_prompt``, one program run over both."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise InputError("prompt is empty: describe the video you want")
        negative_prompt = negative_prompt or ""
        tokens = self.tokenize([negative_prompt, prompt])
        out, = self.run_stage([self.encode_program()], [self.put(t.to(torch.int32)) for t in tokens])
        video, audio = out if isinstance(out, tuple) else (out, None)
        streams = {} if audio is None else {"audio_prompt_embeds": audio[1:2], "negative_audio_prompt_embeds": audio[0:1]}
        return TextEmbeddings(video[1:2], video[0:1], prompt, negative_prompt, self.signature, **streams)

    # --- stage 1b: the image (image-to-video) ---------------------------------------------------------------------
    def encode_image(self, image, last_image=None, *, height: int, width: int, num_frames: int) -> ImageConditioning:
        """The first (and last) frame as sampling takes them for a ``num_frames`` x ``height`` x ``width`` video."""
        self.check_images(image is not None, last_image is not None)
        raise NotImplementedError

    def image_programs(self, height: int, width: int, num_frames: int, images: int = 1) -> list[StageProgram]:
        """The programs of the image encode stage for ``images`` pictures."""
        raise NotImplementedError

    # --- stage 2: sampling ---------------------------------------------------------------------------------------
    def sampling_run(self, embeddings: TextEmbeddings, s: SampleSettings, cfg: bool,
                     image: ImageConditioning | None = None, latents: VideoLatents | None = None) -> SamplingRun:
        """One sampling run's step program, initial values and per-step inputs (the random draws in the order
        the family's reference pipeline draws them), for checked settings ``s``."""
        raise NotImplementedError

    @replayed_method
    def sample(self, embeddings: TextEmbeddings, settings: SampleSettings,
               on_step: Callable[[int, int], None] | None = None, should_stop: Callable[[], bool] | None = None,
               image: ImageConditioning | None = None, latents: VideoLatents | None = None) -> VideoLatents:
        """Denoise from seeded noise; ``on_step(i, total)`` after each step, ``should_stop()`` before each.
        ``image``: image to video (the image encode's output for this size). ``latents``: refine these (a recipe's
        later sampling) instead of starting from noise, where the family refines."""
        s = settings
        cfg = self.uses_cfg(s)
        self.check_sample(embeddings, s, image, cfg)
        if latents is not None:
            self.check_refine(latents, s, image)
        run = self.sampling_run(embeddings, s, cfg, image=image, latents=latents)
        for name in run.program.components:  # every expert on the devices before the first step
            self.component(name)
        step = self.step_function(run.program, s, run.experts, cfg, image=image is not None)
        carry = list(run.carry)

        def one(i):
            out = step(i, self._states[run.experts[i]], *run.arguments(i, tuple(carry)))
            carry[:] = out if isinstance(out, (tuple, list)) else (out,)
            return carry[0]

        try:
            self.run_steps(len(run.experts), one, on_step, should_stop)
        finally:
            self.finish_step_cache()
        start = time.perf_counter()
        result = run.finish(tuple(carry))
        self.record_run("sample", start)
        return result

    def run_steps(self, count: int, step: Callable[[int], object], on_step=None, should_stop=None) -> None:
        """Call ``step(i)`` for i in 0..count-1, waiting for each; ``should_stop()`` before each, ``on_step(i+1,
        count)`` after. ``step`` returns a device array of its result to wait on."""
        start = time.perf_counter()
        for i in range(count):
            if should_stop is not None and should_stop():
                raise Interrupted(f"sampling interrupted before step {i + 1} of {count}")
            with self.memory_named(f"{self.label}'s sampling step", f"at step {i + 1} of {count}"):
                result = step(i)
                # JAX dispatches asynchronously: without waiting, the loop would queue every step at once, the
                # progress bar would race ahead of the device and Cancel could not stop the steps already queued.
                # A step takes seconds on real models; the wait costs only the next dispatch's latency.
                result.block_until_ready()
            if on_step is not None:
                on_step(i + 1, count)
        self.record_run("sample", start)

    def cfg_batch(self, positive: torch.Tensor, negative: torch.Tensor, cfg: bool, spec: tuple = ("dp",)):
        """A prompt stream on the devices as the step takes it: ``[negative, positive]`` with CFG (its halves on
        dp), else the positive prompt alone, in the model's dtype."""
        return self.put((torch.cat([negative, positive]) if cfg else positive).to(self.dtype), spec)

    # --- stage 3: decode -----------------------------------------------------------------------------------------
    def latent_channels(self) -> int:
        """The channels of the latents the VAE decodes."""
        raise NotImplementedError

    def decode_programs(self, z_shape: tuple[int, ...], **options) -> list[StageProgram]:
        """The programs that decode latents ``[1, C, T, h, w]`` to frames ``[F, H, W, 3]`` in 0..1, with the
        family's decode options (its declaration's "decode" settings, each given or at its default)."""
        raise NotImplementedError

    def decode_inputs(self, z: torch.Tensor) -> list:
        """The decode programs' inputs after the weights, on the devices (the latents placed by the VAE's
        layout)."""
        return [self.put(z.float(), self.vae_input_spec(z.shape))]

    def decode_chunks(self, z_shape: tuple[int, ...]) -> list[int]:
        """Where each later chunk of a streamed decode starts (its later program's calls)."""
        return []

    @replayed_method
    def decode(self, latents: VideoLatents, **options) -> torch.Tensor:
        """Frames ``[F, H, W, 3]`` float32 in 0..1 from stage-2 latents, with the family's decode ``options``."""
        options = self.check_options(options, "decode")
        self.check_latents(latents)
        z = latents.latents
        programs = self.decode_programs(tuple(z.shape), **options)
        return torch.cat(self.run_stage(programs, self.decode_inputs(z), self.decode_chunks(tuple(z.shape))))

    def decode_variants(self) -> dict[str, tuple]:
        """The decode's options with several lowerings worth comparing (``bench``): option -> choices."""
        return {s.name: s.choices for s in self.SPEC.settings_of("decode") if s.choices}

    def vae_input_spec(self, shape) -> tuple:
        """``width``: VAE tensors [B, C, T, H, W] split on W over the mesh axes with the most devices that divide it
        (all of them on a v6e-8 at 1280 wide; dp alone for a 720-wide video = 90 latent columns on dp=2,tp=4), and
        on H over those left that divide it (tp for 480 = 60 latent rows there), so that as many chips as the
        frame allows share it (XLA adds the convolutions' halos); otherwise replicated."""
        if self.vae_sharding != "width":
            return ()
        spec = frame_split_spec(dict(self.mesh.shape), tuple(shape))
        if not spec and self.mesh_spec.devices > 1 and tuple(shape[-2:]) not in self._unsplit_frames:
            self._unsplit_frames.add(tuple(shape[-2:]))
            log.warning("vae_sharding width: no axis of mesh %s divides the latent frame %dx%d, so the decode is "
                        "replicated; a latent width or height divisible by %d would split", self.mesh_spec,
                        shape[-1], shape[-2], min(n for n in self.mesh.shape.values() if n > 1))
        return spec

    _vae_input_spec = vae_input_spec

    # --- plan ------------------------------------------------------------------------------------------------
    def plan_programs(self, s: SampleSettings) -> list[StageProgram]:
        """Every program one generation with settings ``s`` runs, for ``plan`` to compile (checked first)."""
        raise NotImplementedError

    # --- what the CLI and the nodes ask of every family --------------------------------------------------------
    def native_size(self) -> tuple[int, int, int]:
        """(height, width, frames) the model was trained at."""
        raise NotImplementedError

    def default_fps(self) -> int:
        """Frames per second of the model's training videos (the mp4's default)."""
        raise NotImplementedError

    def fps_of(self, s: SampleSettings) -> int | None:
        """The frames per second settings ``s`` make the video for, where a setting says (None: the model's)."""
        return None

    def agree(self, what: str, values):
        """A host decision every process of a multi-host slice takes alike: the first process's ``values``."""
        slice_ = getattr(self.runtime, "slice", None)
        return values if slice_ is None else slice_.agree(what, values)

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

    def describe(self) -> dict:
        """Plain facts for generation_config.json."""
        return {"family": self.FAMILY, "generation": self.generation, "model_signature": self.signature}
