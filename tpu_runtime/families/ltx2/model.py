"""LTX-2 (Lightricks; 2.0 and 2.3) on JAX through torchax: video with its sound track, from text or from a first
frame, in one or two stages. Recognise and load a model, run the stages.

The stages match diffusers' ``LTX2Pipeline`` / ``LTX2ImageToVideoPipeline`` number for number (same weights,
prompt, image and seed give the same frames and waveform); each is one compiled program per shape:

- encode: Gemma 3 over ``[negative, positive]`` (left-padded to 1024 tokens), every layer's hidden states stacked,
  then the text connectors: a video and a sound prompt stream.
- image (image to video): the picture through diffusers' H.264 round trip and resize, then the video VAE's encoder.
- sample: one program for a whole denoising step of the video and the sound together: every guidance pass the
  settings call for (the CFG batch, spatio-temporal guidance, modality isolation: each a call of the transformer),
  the guidance terms combined on the x0 predictions and rescaled, and the Euler steps. The scales enter as
  numbers, so a new scale, seed or prompt compiles nothing; the passes a step runs are part of the program.
- decode: the video VAE (the whole video at once, non-causal as diffusers decodes it); the audio VAE and the
  vocoder to a waveform.
- upsample (two stages): the spatial latent upsampler doubles the latents' width and height; a second sampling run
  refines them from the upsampled latents (diffusers' two-stage recipe).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ...engine.attention import AttentionConfig
from ...engine.family import ComponentSource, ModelFamily, builder, model_class
from ...engine.folders import inspect_family_folder, read_config
from ...engine.runtime import Runtime
from ...engine.sharding import MeshSpec
from ...engine.stages import ImageConditioning, SampleSettings, TextEmbeddings, VideoLatents, config_signature
from ...engine.validation import check_number, frame_problem, raise_problems, size_problems
from ...errors import InputError, ModelFolderError, StageFileError
from . import SPEC
from .programs import COEFFICIENTS, TEXT_LEN, Geometry, LTX2Programs, Passes
from .rules import CONNECTOR_INPUT_RULES, RULES, connector_rules
from .schedule import SIGMA_SCHEDULES, audio_latent_frames, positions, schedule_steps, timesteps

log = logging.getLogger(__name__)

COMPONENTS = ("scheduler", "text_encoder", "tokenizer", "connectors", "transformer", "vae", "audio_vae", "vocoder")
UPSAMPLER = "latent_upsampler"
# The classes of ComfyUI's single files' components (a diffusers folder names its own in model_index.json).
FILE_CLASSES = {"transformer": ("diffusers", "LTX2VideoTransformer3DModel"), "connectors": ("ltx2", "LTX2TextConnectors"),
                "vae": ("diffusers", "AutoencoderKLLTX2Video"), "audio_vae": ("diffusers", "AutoencoderKLLTX2Audio"),
                "text_encoder": ("transformers", "Gemma3TextModel")}
# diffusers' LTX2Pipeline.__call__ defaults
NATIVE = (512, 768, 121)
SIZE_MULTIPLE = 32  # diffusers' LTX2Pipeline.check_inputs
DEFAULT_STEPS = 30
DEFAULTS = {"guidance": 3.0, "audio_guidance": 7.0, "stg_scale": 1.0, "modality_scale": 3.0, "guidance_rescale": 0.7,
            "frame_rate": 24.0, "stg_blocks": (28,)}


def generation_of(transformer_config: dict, connectors_config: dict) -> str:
    """"2.3" (gated attention, prompt modulation, per-modality text projections) or "2.0"."""
    if transformer_config.get("cross_attn_mod") or connectors_config.get("per_modality_projections"):
        return "2.3"
    return "2.0"


class LTX2Family(LTX2Programs, ModelFamily):
    """A loaded LTX-2 model from a diffusers folder. Components load on first use, once."""

    FAMILY = SPEC.name
    FAMILY_NAME = SPEC.display_name
    DEFAULT_GUIDANCE = DEFAULTS["guidance"]
    DEFAULT_STEPS = DEFAULT_STEPS
    RULES = RULES
    OWN_SETTINGS = frozenset({"audio_guidance", "stg_scale", "stg_blocks", "modality_scale", "guidance_rescale",
                              "frame_rate", "sigmas", "noise_scale"})
    image_input = "optional"  # text to video, or image to video with a first frame
    last_image_input = False

    def __init__(self, path: str | Path | None = None, *, files: "dict | None" = None, dtype: str = "auto", runtime: Runtime | None = None,
                 mesh: "str | dict | MeshSpec | None" = None, attention: "AttentionConfig | str | None" = None,
                 fsdp: bool = False, vae_sharding: str = "auto", target_devices=None, index: dict | None = None,
                 layers: int | None = None, upsampler: str | Path | None = None):
        if (path is None) == (files is None):
            raise InputError("give an LTX-2 diffusers folder or its single files (checkpoint, text encoder): one of "
                             "the two")
        self.files = None
        self._names: dict[str, dict[str, str]] = {}
        self._upscaler_config = None
        if files is not None:
            self.path = None
            self._inspect_files(files)
        else:
            self.path = Path(path).expanduser()
            self.index = inspect_family_folder(self.path, SPEC, required=COMPONENTS, index=index,
                                               weights=target_devices is None)
            self.configs = {name: read_config(self.path / name) for name in
                            ("text_encoder", "connectors", "transformer", "vae", "audio_vae", "vocoder")}
            self.scheduler_config = read_config(self.path / "scheduler", "scheduler_config.json")
        self.configs["transformer"] = self._with_layers(self.configs["transformer"], layers)
        self.upsampler_path = self._find_upsampler(upsampler)
        t, c = self.configs["transformer"], self.configs["connectors"]
        self.transformer_config, self.vae_config, self.audio_vae_config = t, self.configs["vae"], \
            self.configs["audio_vae"]
        self.generation = generation_of(t, c)
        self.signature = config_signature(self.configs)
        self.vae_scale_spatial = int(self.vae_config.get("spatial_compression_ratio") or 32)
        self.vae_scale_temporal = int(self.vae_config.get("temporal_compression_ratio") or 8)
        # height and width: multiples of 32 (diffusers' LTX-2 pipelines refuse anything else) and of the video
        # VAE's compression times the transformer's patch (a VAE of 64x would need 64)
        self.size_multiple = math.lcm(SIZE_MULTIPLE, self.vae_scale_spatial * int(t.get("patch_size", 1)))
        self.video_text_dim = int(c["video_connector_num_attention_heads"]) * int(c["video_connector_attention_head_dim"])
        self.audio_text_dim = int(c["audio_connector_num_attention_heads"]) * int(c["audio_connector_attention_head_dim"])
        self.perturbed_attention = bool(t.get("perturbed_attn", False))
        heads = math.gcd(int(t["num_attention_heads"]), int(t.get("audio_num_attention_heads", t["num_attention_heads"])))
        self._setup(dtype, runtime, mesh, attention, fsdp, heads=heads, vae_sharding=vae_sharding,
                    target_devices=target_devices)

    def _find_upsampler(self, upsampler) -> Path | None:
        """The spatial latent upsampler: the folder given, else ``latent_upsampler/`` inside the model's folder."""
        if upsampler:
            path = Path(upsampler).expanduser()
            if not (path / "config.json").is_file():
                raise ModelFolderError(f"latent upsampler {path} is not a diffusers model folder (config.json and "
                                       "safetensors weights): pass the folder of LTX2LatentUpsamplerModel")
            return path
        if self.path is None:
            return self.files.latent_upscaler
        inside = self.path / UPSAMPLER
        return inside if (inside / "config.json").is_file() else None

    def _inspect_files(self, files) -> None:
        """Configs and key names from ComfyUI's single files (``files.py``), checked before anything compiles."""
        from .architectures import SCHEDULER
        from .files import LTX2Files, checkpoint_configs, gemma_names, spiece_model, upscaler_names

        if isinstance(files, dict):
            unknown = set(files) - {"checkpoint", "text_encoder", "latent_upscaler", "tokenizer"}
            if unknown:
                raise InputError(f"LTX-2 single files take checkpoint, text_encoder, latent_upscaler and tokenizer, "
                                 f"not {', '.join(sorted(unknown))}")
            files = LTX2Files(**{k: Path(v).expanduser() for k, v in files.items() if v})
        self.files = files
        for what, p in (("checkpoint", files.checkpoint), ("text encoder", files.text_encoder),
                        ("latent upscaler", files.latent_upscaler)):
            if p is not None and not Path(p).is_file():
                raise ModelFolderError(f"LTX-2 {what} file {p} does not exist: check the path (ComfyUI keeps them in "
                                       "models/checkpoints, models/text_encoders and models/latent_upscale_models)")
        configs, self._names = checkpoint_configs(files.checkpoint)
        self._vocoder_class = configs.pop("vocoder_class")["name"]
        text, self._names["text_encoder"] = gemma_names(files.text_encoder)
        self.configs = {"text_encoder": {"model_type": "gemma3_text", **text}, **configs}
        if int(text["hidden_size"]) != int(configs["connectors"]["caption_channels"]):
            raise ModelFolderError(f"text encoder {files.text_encoder} gives {text['hidden_size']}-wide hidden states, "
                                   f"the checkpoint's connectors take {configs['connectors']['caption_channels']}: use "
                                   "the Gemma 3 12B file made for LTX-2")
        if files.tokenizer is None and spiece_model(files.text_encoder) is None:
            raise InputError(f"{files.text_encoder} carries no tokenizer (tensor spiece_model): use ComfyUI's Gemma 3 "
                             "file, which ships it, or give a Gemma tokenizer folder (--tokenizer)")
        if files.latent_upscaler is not None:
            self._upscaler_config, self._names[UPSAMPLER] = upscaler_names(files.latent_upscaler)
        self.index = dict(FILE_CLASSES, vocoder=("ltx2", self._vocoder_class))
        self.scheduler_config = dict(SCHEDULER)

    # --- loading ---------------------------------------------------------------------------------------------
    def _rules_for(self, name: str):
        """The text connectors' rules depend on their heads: Megatron where ``tp`` divides a connector's heads
        (2.3's 32), its attention split by input where not (2.0's 30 on tp=8); see ``rules.py``."""
        if name != "connectors":
            return super()._rules_for(name)
        config, rules = self.configs["connectors"], CONNECTOR_INPUT_RULES
        for modality in ("video", "audio"):
            heads = int(config[f"{modality}_connector_num_attention_heads"])
            rules += connector_rules(f"{modality}_connector", heads % self.mesh_spec.tp == 0)
        return rules

    def _source(self, name: str) -> ComponentSource:
        from ...engine.weights import safetensors_files

        if name == "text_encoder" and self.path is not None:
            return self._gemma_source()
        if self.path is None and name != UPSAMPLER:
            return self._file_source(name)
        if name == UPSAMPLER:
            if self.upsampler_path is None:
                raise InputError(f"{self.label} has no spatial latent upsampler: give its folder (--upsampler, the "
                                 "loader's upsampler input; LTX-2's latent_upsampler/)")
            from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel

            if self._upscaler_config is not None and self.upsampler_path == self.files.latent_upscaler:
                return ComponentSource(LTX2LatentUpsamplerModel, builder(LTX2LatentUpsamplerModel,
                                                                         self._upscaler_config),
                                       [] if self.abstract else [self.upsampler_path],
                                       f"LTX-2 latent upscaler ({self.upsampler_path})", names=self._names[UPSAMPLER])
            config = read_config(self.upsampler_path)
            files = [] if self.abstract else safetensors_files(self.upsampler_path)
            return ComponentSource(LTX2LatentUpsamplerModel, builder(LTX2LatentUpsamplerModel, config), files,
                                   f"LTX-2 latent upsampler ({self.upsampler_path})")
        if name not in self.configs:
            raise KeyError(name)
        cls = model_class(*self.index[name])
        files = [] if self.abstract else safetensors_files(self.path / name)
        return ComponentSource(cls, builder(cls, self.configs[name]), files, f"LTX-2 {name} ({self.path / name})")

    def _gemma_source(self) -> ComponentSource:
        """Gemma 3's text model alone (``Gemma3ForConditionalGeneration``'s language model: LTX-2 never runs the
        vision tower or the language-model head), read from the folder's checkpoint under either of the names
        transformers has saved it with."""
        from transformers import Gemma3Config, Gemma3TextConfig, Gemma3TextModel

        from ...engine.weights import safetensors_files

        config = dict(self.configs["text_encoder"])
        if config.get("model_type") == "gemma3_text":
            text_config = Gemma3TextConfig(**{k: v for k, v in config.items() if not k.startswith("_")})
        else:
            text_config = Gemma3Config(**{k: v for k, v in config.items() if not k.startswith("_")}).text_config
        text_config._attn_implementation = "eager"  # masked padding rows stay finite (no -inf softmax)

        def names(keys: list[str]) -> dict[str, str]:
            prefixes = ("language_model.model.", "model.language_model.", "model.")
            return {k: k[len(p):] for k in keys for p in prefixes if k.startswith(p)
                    and not k.startswith(("model.vision", "model.multi_modal"))}

        files = [] if self.abstract else safetensors_files(self.path / "text_encoder")
        return ComponentSource(Gemma3TextModel, lambda: Gemma3TextModel(text_config), files,
                               f"LTX-2 text encoder ({self.path / 'text_encoder'})", names=names)

    def _file_source(self, name: str) -> ComponentSource:
        """A component of the single files: its diffusers class built from the config read off the shapes, its
        tensors from the file under their diffusers names."""
        if name == "text_encoder":
            from transformers import Gemma3TextConfig, Gemma3TextModel

            config = {k: v for k, v in self.configs["text_encoder"].items() if not k.startswith("_")}
            text_config = Gemma3TextConfig(**config)
            text_config._attn_implementation = "eager"
            path = self.files.text_encoder
            return ComponentSource(Gemma3TextModel, lambda: Gemma3TextModel(text_config),
                                   [] if self.abstract else [path], f"LTX-2 text encoder ({path})",
                                   names=self._names["text_encoder"])
        if name not in self.configs:
            raise KeyError(name)
        cls = model_class(*self.index[name])
        path = self.files.checkpoint
        return ComponentSource(cls, builder(cls, self.configs[name]), [] if self.abstract else [path],
                               f"LTX-2 {name} ({path})", names=self._names[name])

    def _load_tokenizer(self):
        from transformers import AutoTokenizer

        if self.path is None and self.files.tokenizer is None:
            from .files import GemmaSentencePieceTokenizer, spiece_model

            return GemmaSentencePieceTokenizer(spiece_model(self.files.text_encoder))
        folder = self.files.tokenizer if self.path is None else self.path / "tokenizer"
        tokenizer = AutoTokenizer.from_pretrained(folder)
        tokenizer.padding_side = "left"  # diffusers: Gemma takes left-padded prompts
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    def scheduler(self):
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)

    # --- facts -----------------------------------------------------------------------------------------------
    def native_size(self) -> tuple[int, int, int]:
        return NATIVE

    def default_fps(self) -> int:
        return int(DEFAULTS["frame_rate"])

    @property
    def label(self) -> str:
        return self.path.name if self.path is not None else self.files.checkpoint.stem

    def describe(self) -> dict:
        source = str(self.path) if self.path is not None else {k: str(v) for k, v in vars(self.files).items() if v}
        return {**super().describe(), "source": source,
                "upsampler": str(self.upsampler_path) if self.upsampler_path else None}

    def source_paths(self) -> list[Path]:
        if self.path is None:
            return [p for p in vars(self.files).values() if p]
        return [self.path] + ([self.upsampler_path] if self.upsampler_path else [])

    @property
    def sample_rate(self) -> int:
        """The waveform's samples per second (the vocoder's output rate)."""
        return int(self.configs["vocoder"].get("output_sampling_rate", 24000))

    # --- validation ------------------------------------------------------------------------------------------
    def validate(self, height: int, width: int, num_frames: int) -> None:
        m = self.size_multiple
        why = f" for LTX-2 (diffusers' LTX-2 pipelines take multiples of {SIZE_MULTIPLE}; this VAE compresses " \
              f"{self.vae_scale_spatial}x)"
        problems = size_problems(height, width, m, why)
        problem = frame_problem(num_frames, self.vae_scale_temporal, NATIVE[2], "LTX-2")
        raise_problems(problems + ([problem] if problem else []))

    def validate_settings(self, s: SampleSettings) -> None:
        if s.scheduler is not None:
            raise InputError(f"scheduler {s.scheduler!r}: LTX-2 samples with flow-matching Euler only (its sigma "
                             "schedule is chosen with sigmas: default, distilled, stage2); leave scheduler unset")
        check_number("audio_guidance", s.audio_guidance, above=0.0, optional=True)
        for name in ("stg_scale", "guidance_rescale"):
            check_number(name, getattr(s, name), minimum=0.0, optional=True)
        check_number("modality_scale", s.modality_scale, minimum=0.0, optional=True)
        check_number("frame_rate", s.frame_rate, above=0.0, optional=True)
        check_number("noise_scale", s.noise_scale, minimum=0.0, below=1.0 + 1e-9, optional=True)
        if s.sigmas is not None and s.sigmas not in SIGMA_SCHEDULES:
            raise InputError(f"sigmas={s.sigmas!r}: choose one of {', '.join(SIGMA_SCHEDULES)}")
        fixed = schedule_steps(s.sigmas)
        if fixed is not None and s.steps != fixed:
            raise InputError(f"steps={s.steps}: the {s.sigmas} sigma schedule has {fixed} steps; leave steps at "
                             f"{fixed}")
        layers = int(self.transformer_config["num_layers"])
        for block in s.stg_blocks or ():
            if not isinstance(block, int) or isinstance(block, bool) or not 0 <= block < layers:
                raise InputError(f"stg_blocks={list(s.stg_blocks)}: this transformer has blocks 0..{layers - 1}")
        self.lora_targets(s)

    def lora_targets(self, settings: SampleSettings) -> dict[str, tuple]:
        if settings.loras_2:
            raise InputError(f"{self.label} has one transformer: a second LoRA slot (--lora-2, lora_2) is the refine "
                             "stage's of --two-stage (e.g. the distilled LoRA); give LoRAs for one sampling as --lora")
        return super().lora_targets(settings)

    def _lora_original_name(self, name: str) -> str:
        """LoRA files for LTX-2 come in diffusers' names or in the original ones (``diffusion_model.`` + ltx-core's
        names: Lightricks' distilled LoRA, ComfyUI-trained LoRAs); both reach every transformer weight."""
        from .files import transformer_to_original

        return transformer_to_original(name)

    def guidance(self, s: SampleSettings) -> tuple[Passes, np.ndarray]:
        """The passes a step runs and the guidance coefficients (``programs.COEFFICIENTS``) for settings ``s``,
        as diffusers decides them: CFG when either guidance is above 1, STG when its scale is above 0 (and the
        transformer perturbs attention in one of the blocks: otherwise the pass equals the positive one and is
        not run), modality isolation when its scale is above 1."""
        g = self.DEFAULT_GUIDANCE if s.guidance is None else float(s.guidance)
        ag = DEFAULTS["audio_guidance"] if s.audio_guidance is None else float(s.audio_guidance)
        stg = DEFAULTS["stg_scale"] if s.stg_scale is None else float(s.stg_scale)
        mod = DEFAULTS["modality_scale"] if s.modality_scale is None else float(s.modality_scale)
        r = DEFAULTS["guidance_rescale"] if s.guidance_rescale is None else float(s.guidance_rescale)
        layers = int(self.transformer_config["num_layers"])
        blocks = tuple(DEFAULTS["stg_blocks"] if s.stg_blocks is None else s.stg_blocks)
        perturbed = tuple(b for b in blocks if b < layers) if self.perturbed_attention else ()
        passes = Passes(cfg=g > 1 or ag > 1, stg_blocks=perturbed if stg > 0 else (), modality=mod > 1)
        values = {"cfg": g - 1, "audio_cfg": ag - 1, "stg": stg, "audio_stg": stg, "modality": mod - 1,
                  "audio_modality": mod - 1, "rescale": r, "rescale_keep": 1 - r, "audio_rescale": r,
                  "audio_rescale_keep": 1 - r}
        return passes, np.array([values[n] for n in COEFFICIENTS], dtype=np.float32)

    def uses_cfg(self, s: SampleSettings) -> bool:
        return self.guidance(s)[0].cfg  # the sound's guidance alone keeps the CFG batch

    def frame_rate(self, s: SampleSettings) -> float:
        return DEFAULTS["frame_rate"] if s.frame_rate is None else float(s.frame_rate)

    # --- stage 1: text -----------------------------------------------------------------------------------------
    def tokenize(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        tokenizer = self._component("tokenizer")
        out = tokenizer([t.strip() for t in texts], padding="max_length", max_length=TEXT_LEN, truncation=True,
                        add_special_tokens=True, return_tensors="pt")
        return out.input_ids, out.attention_mask

    def text_shape(self) -> tuple[int, ...]:
        return (1, TEXT_LEN, self.video_text_dim)

    def encode(self, prompt: str, negative_prompt: str = "") -> TextEmbeddings:
        """The video and the sound prompt streams of ``prompt`` and ``negative_prompt``, one program run."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise InputError("prompt is empty: describe the video (and its sound) you want")
        negative_prompt = negative_prompt or ""
        ids, mask = self.tokenize([negative_prompt, prompt])
        program = self.encode_program()
        executable = self.compile_stage(program)
        start = time.perf_counter()
        video, audio = self.runtime.to_cpu(executable(program.example[0], self.put(ids.to(torch.int32)),
                                                      self.put(mask.to(torch.int32))))
        self._record_run("encode", start)
        return TextEmbeddings(video[1:2], video[0:1], prompt, negative_prompt, self.signature,
                              audio_prompt_embeds=audio[1:2], negative_audio_prompt_embeds=audio[0:1])

    # --- image to video --------------------------------------------------------------------------------------
    def encode_image(self, image, last_image=None, *, height: int, width: int, num_frames: int) -> ImageConditioning:
        """The first frame as sampling takes it: the picture through diffusers' H.264 round trip (libx264 at the
        pipeline's CRF, as LTX-2 was trained) and its resize, then the video VAE's encoder (its posterior's mode,
        normalised). One compiled program per size."""
        from types import SimpleNamespace

        from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf, resolve_default_image_crf
        from diffusers.video_processor import VideoProcessor
        from PIL import Image

        from ...engine.images import as_pil

        self.check_images(image is not None, last_image is not None)
        self.validate(height, width, num_frames)
        picture = as_pil(image, "image").convert("RGB")
        # the CRF diffusers picks for the text encoder's generation (Gemma 3: 33)
        crf = resolve_default_image_crf(SimpleNamespace(config=SimpleNamespace(
            model_type=self.configs["text_encoder"].get("model_type"))))
        if crf:
            picture = Image.fromarray(apply_image_conditioning_crf(np.array(picture), crf))
        # resized as LTX2ImageToVideoPipeline's video processor resizes: bilinear
        pixels = VideoProcessor(vae_scale_factor=self.vae_scale_spatial, resample="bilinear").preprocess(
            picture, height=height, width=width)
        program = self.image_program(height, width)
        executable = self.compile_stage(program)
        start = time.perf_counter()
        latents = self.runtime.to_cpu(executable(program.example[0], self.put(pixels[:, :, None].to(self.dtype))))
        self._record_run("image", start)
        return ImageConditioning(latents.float(), height, width, num_frames, self.signature)

    # --- stage 2: sampling -------------------------------------------------------------------------------------
    def geometry(self, height: int, width: int, num_frames: int, frame_rate: float) -> Geometry:
        t, a = self.transformer_config, self.audio_vae_config
        return Geometry(frames=(num_frames - 1) // self.vae_scale_temporal + 1, height=height // self.vae_scale_spatial,
                        width=width // self.vae_scale_spatial, channels=int(t["in_channels"]),
                        audio_frames=audio_latent_frames(num_frames, frame_rate, a),
                        audio_channels=int(t["audio_in_channels"]))

    def latent_shape(self, height: int, width: int, num_frames: int) -> tuple[int, ...]:
        g = self.geometry(height, width, num_frames, DEFAULTS["frame_rate"])
        return (1, g.channels, g.frames, g.height, g.width)

    def sample(self, embeddings: TextEmbeddings, settings: SampleSettings,
               on_step: Callable[[int, int], None] | None = None, should_stop: Callable[[], bool] | None = None,
               image: ImageConditioning | None = None, latents: VideoLatents | None = None) -> VideoLatents:
        """Denoise the video and its sound from seeded noise; ``on_step(i, total)`` after each step,
        ``should_stop()`` before each. ``image``: image to video (the image encode's output for this size).
        ``latents``: refine these (the upsampler's output: diffusers' second stage) instead of starting from
        noise, with ``settings.noise_scale`` of fresh noise (default: the schedule's first sigma)."""
        from diffusers import LTX2Pipeline
        from diffusers.utils.torch_utils import randn_tensor

        s = settings
        passes, coefficients = self.guidance(s)
        self.check_sample(embeddings, s, image, passes.cfg)
        if embeddings.audio_prompt_embeds is None:
            raise StageFileError("the text embeddings have no sound prompt stream: re-run the text encode stage with "
                                 "this LTX-2 model")
        if latents is not None:
            self._check_refine(latents, s, image)
        elif s.noise_scale is not None:
            raise InputError("noise_scale applies when sampling starts from given latents (the refine stage after "
                             "the upsampler): leave it unset")
        frame_rate = self.frame_rate(s)
        g = self.geometry(s.height, s.width, s.num_frames, frame_rate)
        if latents is not None:
            g = Geometry(g.frames, g.height, g.width, g.channels, int(latents.audio.shape[2]), g.audio_channels)
        tokens = g.frames * g.height * g.width
        steps_t, sigmas = timesteps(self.scheduler(), s.sigmas, s.steps, tokens)
        program = self.sample_program(g, passes, image=image is not None)
        run = self.step_function(program, s, ["transformer"] * len(steps_t), passes.cfg)

        # The random draws, in diffusers' order on the CPU generator: the video's noise, then the sound's.
        generator = torch.Generator("cpu").manual_seed(int(s.seed))
        stats = self._latent_statistics()
        audio_mean, audio_std = self._audio_statistics()
        pack = LTX2Pipeline._pack_latents
        keep = None
        shape = (1, g.channels, g.frames, g.height, g.width)
        if latents is not None:  # the refine stage: normalised latents with fresh noise mixed in
            noise_scale = float(sigmas[0]) if s.noise_scale is None else float(s.noise_scale)
            x = pack(LTX2Pipeline._normalize_latents(latents.latents.float(), *stats,
                                                     float(self.vae_config.get("scaling_factor", 1.0))))
            x = LTX2Pipeline._create_noised_state(x, noise_scale, generator)
            xa = LTX2Pipeline._pack_audio_latents(latents.audio.float())
            xa = LTX2Pipeline._normalize_audio_latents(xa, audio_mean, audio_std)
            xa = LTX2Pipeline._create_noised_state(xa, noise_scale, generator)
        else:
            noise = randn_tensor(shape, generator=generator, device=torch.device("cpu"), dtype=torch.float32)
            if image is not None:  # the first latent frame is the image's, the rest noise
                mask = torch.zeros((1, 1) + shape[2:])
                mask[:, :, 0] = 1.0
                x = pack(image.latents.float().repeat(1, 1, g.frames, 1, 1) * mask + noise * (1 - mask))
                keep = pack(mask).squeeze(-1)
            else:
                x = pack(noise)
            audio_shape = (1, int(self.audio_vae_config["latent_channels"]), g.audio_frames,
                           int(self.audio_vae_config["mel_bins"]) // 4)
            xa = LTX2Pipeline._pack_audio_latents(randn_tensor(audio_shape, generator=generator,
                                                               device=torch.device("cpu"), dtype=torch.float32))
        cfg = passes.cfg
        video_text = torch.cat([embeddings.negative_prompt_embeds, embeddings.prompt_embeds]) if cfg \
            else embeddings.prompt_embeds
        audio_text = torch.cat([embeddings.negative_audio_prompt_embeds, embeddings.audio_prompt_embeds]) if cfg \
            else embeddings.audio_prompt_embeds
        spec = ("dp",) if cfg else ()
        video_text_dev, audio_text_dev = self.put(video_text.to(self.dtype), spec), self.put(audio_text.to(self.dtype),
                                                                                             spec)
        video_coords, audio_coords = positions(self._parts["transformer"], g.frames, g.height, g.width,
                                               g.audio_frames, frame_rate)
        fixed = [self.put(t) for t in (torch.from_numpy(coefficients), video_coords, audio_coords)]
        keep_dev = self.put(keep) if keep is not None else None
        carry = {"x": self.put(x), "xa": self.put(xa)}
        state = self._states["transformer"]

        def step(i):
            carry["x"], carry["xa"] = run(
                i, state, carry["x"], carry["xa"], video_text_dev, audio_text_dev,
                self.put(torch.from_numpy(steps_t[i:i + 1].copy())), self.put(torch.from_numpy(sigmas[i:i + 2].copy())),
                fixed[0], fixed[1], fixed[2], keep_dev)
            return carry["x"]

        try:
            self.run_steps(len(steps_t), step, on_step, should_stop)
        finally:
            self.finish_step_cache()
        start = time.perf_counter()
        video = self.runtime.to_cpu(carry["x"]).float()
        audio = self.runtime.to_cpu(carry["xa"]).float()
        video = LTX2Pipeline._denormalize_latents(LTX2Pipeline._unpack_latents(video, g.frames, g.height, g.width),
                                                  *stats, float(self.vae_config.get("scaling_factor", 1.0)))
        audio = LTX2Pipeline._unpack_audio_latents(LTX2Pipeline._denormalize_audio_latents(audio, audio_mean, audio_std),
                                                   g.audio_frames, num_mel_bins=int(self.audio_vae_config["mel_bins"]) // 4)
        self._record_run("sample", start)
        return VideoLatents(video.contiguous(), s.height, s.width, s.num_frames, self.signature,
                            audio=audio.contiguous())

    def _check_refine(self, latents: VideoLatents, s: SampleSettings, image) -> None:
        self.check_made_here(latents)
        if latents.audio is None:
            raise StageFileError("the latents to refine have no sound latents: give the upsampler's output of an LTX-2 "
                                 "sampling run")
        if image is not None:
            raise InputError("refining upsampled latents takes no image: the first stage's latents already hold it")
        made, asked = (latents.height, latents.width, latents.num_frames), (s.height, s.width, s.num_frames)
        if made != asked:
            raise InputError(f"the latents to refine are for {made[2]} frames of {made[1]}x{made[0]} (width x "
                             f"height), the sampler asks for {asked[2]} frames of {asked[1]}x{asked[0]}: set the "
                             "sampler to the upsampled size")

    # --- two stages: the latent upsampler ----------------------------------------------------------------------
    def upsample(self, latents: VideoLatents) -> VideoLatents:
        """The video latents at twice the width and height (the spatial latent upsampler), the sound's as they
        are: what the refine stage samples from."""
        self.check_made_here(latents)
        z = latents.latents
        if z.ndim != 5 or z.shape[1] != int(self.transformer_config["in_channels"]):
            raise StageFileError(f"latents have shape {tuple(z.shape)}; the LTX-2 upsampler takes video latents "
                                 f"[1, {self.transformer_config['in_channels']}, F, H/32, W/32]")
        program = self.upsample_program(tuple(z.shape))
        executable = self.compile_stage(program)
        start = time.perf_counter()
        out = self.runtime.to_cpu(executable(program.example[0], self.put(z.float())))
        self._record_run("upsample", start)
        return VideoLatents(out.float().contiguous(), latents.height * 2, latents.width * 2, latents.num_frames,
                            self.signature, audio=latents.audio)

    # --- stage 3: decode ---------------------------------------------------------------------------------------
    def decode(self, latents: VideoLatents, tiling: bool = False, group_norm: str = "stock") -> torch.Tensor:
        """Frames ``[F, H, W, 3]`` float32 in 0..1 from stage-2 latents (the sound: ``decode_audio``)."""
        if tiling:
            raise InputError("VAE tiling is a CogVideoX option; to split the LTX-2 decode over devices use "
                             "vae_sharding width")
        if group_norm != "stock":
            raise InputError("group_norm applies to the CogVideoX VAE: leave it stock")
        self.check_made_here(latents)
        z = latents.latents
        channels = int(self.vae_config["latent_channels"])
        if z.ndim != 5 or z.shape[0] != 1 or z.shape[1] != channels:
            raise StageFileError(f"latents have shape {tuple(z.shape)}; this model's VAE decodes [1, {channels}, F, "
                                 f"H/{self.vae_scale_spatial}, W/{self.vae_scale_spatial}]")
        program = self.decode_program(tuple(z.shape))
        executable = self.compile_stage(program)
        start = time.perf_counter()
        frames = self.runtime.to_cpu(executable(program.example[0], self.put(z.float(),
                                                                             self._vae_input_spec(z.shape))))
        self._record_run("decode", start)
        return frames

    def decode_audio(self, latents: VideoLatents) -> torch.Tensor:
        """The sound track ``[channels, samples]`` float32 at ``sample_rate`` from stage-2 latents."""
        self.check_made_here(latents)
        if latents.audio is None:
            raise StageFileError("the latents have no sound latents: sample them with an LTX-2 model")
        program = self.audio_decode_program(tuple(latents.audio.shape))
        executable = self.compile_stage(program)
        start = time.perf_counter()
        waveform = self.runtime.to_cpu(executable(program.example[0], self.put(latents.audio.float())))
        self._record_run("decode", start)
        return waveform.float()

    def vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return latents

    def _latent_statistics(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The video VAE's per-channel latent mean and std (buffers in its weights)."""
        return self._vae_buffer("vae", "latents_mean"), self._vae_buffer("vae", "latents_std")

    def _audio_statistics(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._vae_buffer("audio_vae", "latents_mean"), self._vae_buffer("audio_vae", "latents_std")

    def _vae_buffer(self, component: str, name: str) -> torch.Tensor:
        """A buffer of a loaded component, from its device copy (the host module was freed), float32 on the CPU;
        an abstract model (plan) has zeros of its shape."""
        self._component(component)
        value = self._states[component][name]
        if self.abstract:
            return torch.zeros(value.shape)
        return self.runtime.to_cpu(value).float()

    # --- plan ------------------------------------------------------------------------------------------------
    def plan_programs(self, s: SampleSettings) -> list:
        """Every program one generation with settings ``s`` runs, for ``plan`` to compile."""
        self.check_settings(s)
        passes, _ = self.guidance(s)
        self.check_cfg_mesh(passes.cfg)
        g = self.geometry(s.height, s.width, s.num_frames, self.frame_rate(s))
        z_shape = (1, g.channels, g.frames, g.height, g.width)
        a_shape = (1, int(self.audio_vae_config["latent_channels"]), g.audio_frames,
                   int(self.audio_vae_config["mel_bins"]) // 4)
        return [self.encode_program(), self.sample_program(g, passes), self.decode_program(z_shape),
                self.audio_decode_program(a_shape)]
