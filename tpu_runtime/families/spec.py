"""What a model family declares about itself, once: the registry (``registry.py``) asks these declarations
whenever anything picks a family — opening a model, ``plan``'s known models, the multi-host worker and its
message codec, ``bench``, the CLI's demos, the ComfyUI loaders' folder lists and the node classes.

Declarations are plain data: importing them touches no device and imports no torch (ComfyUI imports every pack
at start-up). Whatever is heavy (the family class, its released architectures, its tiny builders, its single-file
reader) is named as ``"module:attribute"`` inside the family's package, the way Python's entry points name a
plugin, and imported only when asked for (``FamilySpec.load``). So the family's own modules can read their
declaration (``from . import SPEC``) without an import circle.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path

from ..engine.settings import Setting

__all__ = ["Demo", "FamilySpec", "FileRole", "FilesLoaderNode", "NodeSpec", "Recipe", "SamplerNode", "Sampling",
           "Setting"]


@dataclass(frozen=True)
class FileRole:
    """One single file a family loads instead of a diffusers folder (ComfyUI's model files)."""

    name: str  # the family constructor's name for it, e.g. "transformer"
    flag: str  # the CLI option, e.g. "--transformer"
    folder: str  # ComfyUI's folder type, e.g. "diffusion_models"
    required: bool
    help: str
    directory: bool = False  # a folder given by its path (a tokenizer, configs), not a file picked from a list


@dataclass(frozen=True)
class Demo:
    """A tiny random-weight model the CLI's ``demo`` and ``bench`` build on the spot (``builder(folder, *args)``,
    a ``"module:function"`` of the family's package), and its small size."""

    builder: str
    args: tuple
    height: int
    width: int
    frames: int


@dataclass(frozen=True)
class SamplerNode:
    """The family's sampler node: its size defaults, the frames rule's tooltip and the widgets' steps, so that a
    widget cannot hold a size the family's models refuse: ``size_step`` for width and height (a multiple of it),
    ``length_step`` for the frame count (``length_step * N + 1``). Where the family's generations differ (Wan 2.1
    takes multiples of 16, TI2V-5B of 32), the step is the finer rule and the model refuses the rest, naming the
    nearest values. Its other inputs are the sampling settings every sampler has and the family's own
    (``FamilySpec.settings``), and where the family refines (``Sampling.refine``) the latents to refine and how
    much fresh noise they get."""

    width: int
    height: int
    frames: int
    frames_tip: str
    size_step: int = 16
    length_step: int = 1


@dataclass(frozen=True)
class Sampling:
    """How the family samples by default: ``steps`` and ``guidance`` (the sampler node's, ``generate``'s and
    ``plan``'s defaults), and the scheduler names its models take (besides their own). ``refine``: its sampler
    can start from given latents with some fresh noise (a recipe's later sampling: the upsampler's latents)."""

    steps: int = 50
    guidance: float = 6.0
    schedulers: tuple[str, ...] = ()
    refine: bool = False


@dataclass(frozen=True)
class Recipe:
    """A generation the family makes in several stage calls, run by ``generate`` when asked (LTX-2's two-stage:
    sample at half size, upsample the latents, refine). ``stages``: the calls in order, each a stage method:
    "sample" takes the next of the settings ``settings`` gives and the latents so far (none for the first), any
    other stage takes the latents. ``settings``: ``"module:function"`` in the family's package, ``(family,
    final settings) -> one SampleSettings per "sample"``, refusing what the recipe cannot run."""

    name: str
    help: str
    stages: tuple[str, ...]
    settings: str

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")


@dataclass(frozen=True)
class NodeSpec:
    """How the family's ComfyUI nodes are named and what differs between families; the node kinds themselves are
    written once (``nodes/kinds.py``). Class names are ``prefix + kind`` (``TPUWanSampler``), display names
    ``"<title> <Kind> (TPU)"``, types ``type_prefix + _MODEL / _EMBEDS / _IMAGE``: saved workflows depend on the
    class names and types, so they never change. A display name may change, but ComfyUI's node search must find it
    whole (tests/test_node_inputs.py: every word within its first 31 characters), so titles stay short."""

    prefix: str
    title: str
    category: str
    type_prefix: str
    loader_description: str
    loader_tooltip: str
    sampler: SamplerNode
    image_size: tuple[int, int, int]  # the image encode's width, height, frames defaults
    image_frames_tip: str
    text_encode_doc: str = "Text-encoder embeddings for a prompt and a negative prompt."
    image_encode_doc: str = "The first frame VAE-encoded on the devices for the sampler."
    sampler_doc: str = "Denoise a video latent: one compiled program per shape, reused for every step and seed."
    decode_doc: str = "VAE decode to an IMAGE batch [frames, H, W, 3] for ComfyUI's CreateVideo / SaveVideo."
    lora_optional: dict = field(default_factory=dict)  # the LoRA node's optional inputs (Wan 2.2's expert)
    files_loader: "FilesLoaderNode | None" = None
    audio: bool = False  # the decode node gives ComfyUI's AUDIO beside the IMAGE batch (a sound track)
    upsample_doc: str = ""  # a latent Upsample node (two-stage generation), described so; "": none


@dataclass(frozen=True)
class FilesLoaderNode:
    """A loader of the family's single files: its inputs in order (``required`` then ``optional``, where the names
    "@device" and "@layout" stand for the shared device and layout inputs), as (input name, file role) pairs, and
    its description."""

    description: str
    required: tuple[tuple[str, str, str], ...]  # (input name, FileRole.name, tooltip)
    optional: tuple  # (input name, FileRole.name, tooltip) or "@device" / "@layout"


@dataclass(frozen=True)
class FamilySpec:
    """A model family, declared once.

    ``package``: the family's package; the ``"module:attribute"`` names below are inside it. ``family_class``:
    the ``ModelFamily`` subclass, whose constructor takes a folder (and ``index=``, the model_index.json the
    registry read) or ``files=`` (single files by ``FileRole.name``). ``pipelines``: the diffusers
    ``_class_name``s it runs; ``pipeline_prefix``: the prefix of its family's other pipelines (refused with
    ``unsupported``). ``recognise_files``: a function ``(role -> path) -> bool`` saying whether single files are
    this family's, read from tensor names and shapes. ``architectures``: released models by name, as config-only
    folders (``plan``). ``message_types``: the dataclasses its constructor takes that a multi-host message carries
    by value. ``step_cache``: its transformers take a step cache (``STEP_CACHE_BLOCKS``; the Step Cache node).

    What its models take and run: ``sampling`` (default steps, guidance, schedulers), ``settings`` (its own
    sampler, decode and loader options), ``stages`` (stage calls of its own beyond encode, encode_image, sample
    and decode, e.g. LTX-2's ``upsample``: each is replayed on a multi-host slice like those), ``recipes``
    (generations in several stage calls). ``lora_keys``: a regular expression the keys of a LoRA made for its
    transformer match (so a LoRA given to another family's model is named as this family's). ``bench``: its
    loading benchmarks, ``"module:function"`` by name (``bench --load-mb``)."""

    name: str
    display_name: str
    package: str
    family_class: str
    pipelines: tuple[str, ...]
    pipeline_prefix: str
    unsupported: str
    example_repo: str
    folder_names: tuple[str, ...]  # ComfyUI folder types searched for its diffusers folders
    nodes: NodeSpec
    architectures: str | None = None
    demos: dict[str, Demo] = field(default_factory=dict)
    file_roles: tuple[FileRole, ...] = ()
    recognise_files: str | None = None
    message_types: tuple[str, ...] = ()
    step_cache: bool = False
    sampling: Sampling = Sampling()
    settings: tuple[Setting, ...] = ()
    stages: tuple[str, ...] = ()
    recipes: tuple[Recipe, ...] = ()
    lora_keys: str = ""
    bench: dict[str, str] = field(default_factory=dict)

    def settings_of(self, stage: str) -> tuple[Setting, ...]:
        """Its settings of one stage ("sample", "decode", "open"), in declaration order."""
        return tuple(s for s in self.settings if s.stage == stage)

    def setting(self, name: str) -> Setting:
        for s in self.settings:
            if s.name == name:
                return s
        raise KeyError(name)

    def load(self, ref: str):
        """The object ``ref`` ("module:attribute" inside the family's package) names, its module imported now."""
        module, _, attribute = ref.partition(":")
        return getattr(importlib.import_module(f"{self.package}.{module}"), attribute)

    def build_demo(self, name: str, folder: Path) -> Path:
        demo = self.demos[name]
        return self.load(demo.builder)(folder, *demo.args)
