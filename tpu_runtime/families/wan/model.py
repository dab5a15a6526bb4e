"""Wan on JAX through torchax: recognise and load a model, run the stages. text to video with Wan 2.1 (1.3B, 14B), Wan 2.2 A14B (two experts) and TI2V-5B;
image to video with Wan 2.1 I2V and FLF2V (CLIP vision features), Wan 2.2 I2V-A14B and TI2V-5B with an image.

The stages match diffusers' ``WanPipeline`` number for number (same weights, prompt and seed give the same
frames); each is one compiled program per shape:

- encode: umT5 on ``[negative, positive]`` with the attention mask, every row from the prompt's real length
  (EOS included) on set to exact zeros, as diffusers does; 512 tokens.
- sample: one program for a whole denoising step: both CFG branches as one batch of two (diffusers runs them as
  two calls; the numbers are the same), the transformer, guidance, and the scheduler update. The scheduler
  (flow-matching UniPC, the default, or flow-matching Euler) is a linear plan read off diffusers' own scheduler
  (``engine/schedulers.linear_plan``): its predictor-corrector history is carried between steps as arrays and its
  coefficients enter as a small matrix, so N steps compile once and a new seed or prompt compiles nothing.
  Wan 2.2's two experts have the same architecture, so they share that one program: a step passes the expert's
  weights and guidance (``transformer`` at timesteps >= boundary_ratio x 1000, ``transformer_2`` below).
  TI2V-5B's ``expand_timesteps`` gives every token the same timestep in text-to-video; the transformer computes
  exactly the same numbers from the scalar timestep, which is what the program passes.
- decode: the Wan VAE (one latent frame at a time with its causal conv cache, as diffusers does it), after
  de-normalising the latents with the VAE's ``latents_mean``/``latents_std``.

- image (image-to-video, ``WanImageToVideoPipeline``): the VAE encode of the conditioning video (first frame,
  zeros, FLF2V's last frame; TI2V-5B: the first frame alone), normalised, plus CLIP vision's second-to-last hidden
  states where the transformer attends to image features. Sampling concatenates the frame mask and the condition
  on channels at every step, or (TI2V-5B, ``expand_timesteps``) holds the first latent frame at the image's with
  timestep 0 on its tokens.

Models come from a diffusers folder (``model_index.json``) or from ComfyUI's single files (``files.py``); the
stage programs are built in ``programs.py``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import torch

from ...engine.attention import AttentionConfig
from ...engine.components import ComponentSource, builder, model_class
from ...engine.family import ModelFamily
from ...engine.folders import FolderOrFiles, inspect_family_folder, present, read_config
from ...engine.runtime import Runtime
from ...engine.schedulers import euler_simple_scheduler, linear_plan
from ...engine.sharding import MeshSpec
from ...engine.stages import (ImageConditioning, SampleSettings, SamplingRun, TextEmbeddings, VideoLatents,
                              config_signature)
from ...engine.stepcache import BlockSpec
from ...engine.validation import frame_problem, raise_problems, size_problems
from ...errors import InputError, ModelFolderError
from . import SPEC
from .files import WanFiles
from .programs import TEXT_LEN, WanFunctionalAttnProcessor, WanPrograms
from .rules import RULES

log = logging.getLogger(__name__)

SCHEDULERS = SPEC.sampling.schedulers
COMPONENTS = ("scheduler", "text_encoder", "tokenizer", "transformer", "vae")
# Scheduler of the released models (diffusers' conversion script): flow-matching UniPC, shift per generation.
DEFAULT_SCHEDULER = {
    "_class_name": "UniPCMultistepScheduler", "num_train_timesteps": 1000, "prediction_type": "flow_prediction",
    "use_flow_sigmas": True, "solver_order": 2, "solver_type": "bh2", "predict_x0": True,
    "lower_order_final": True, "final_sigmas_type": "zero", "timestep_spacing": "linspace",
}
DEFAULT_SHIFT = {"2.1": 3.0, "2.2-A14B": 12.0, "2.2-TI2V-5B": 5.0}
DEFAULT_BOUNDARY = 0.875  # Wan 2.2 T2V-A14B
DEFAULT_BOUNDARY_I2V = 0.9  # Wan 2.2 I2V-A14B
NATIVE = {"2.1-small": (480, 832, 81), "2.1": (720, 1280, 81), "2.2-A14B": (720, 1280, 81),
          "2.2-TI2V-5B": (704, 1280, 121)}
FPS = {"2.1": 16, "2.2-A14B": 16, "2.2-TI2V-5B": 24}


# The classes of ComfyUI's single files (a diffusers folder names its own in model_index.json).
FILE_CLASSES = {"transformer": ("diffusers", "WanTransformer3DModel"), "transformer_2": ("diffusers", "WanTransformer3DModel"),
                "vae": ("diffusers", "AutoencoderKLWan"), "text_encoder": ("transformers", "UMT5EncoderModel"),
                "image_encoder": ("transformers", "CLIPVisionModel")}


# --- recognising what the user has ---------------------------------------------------------------------------
def inspect_wan_folder(path: Path, weights: bool = True, index: dict | None = None) -> dict:
    """Check that ``path`` is a complete diffusers Wan folder; return its model_index. ``weights=False``: only the
    configs are needed (planning compiles with the weights' shapes alone)."""
    return inspect_family_folder(path, SPEC, required=COMPONENTS, index=index, weights=weights)


def generation_of(transformer_config: dict, vae_config: dict, two_experts: bool) -> str:
    """"2.1", "2.2-A14B" (two experts) or "2.2-TI2V-5B" (48-channel Wan 2.2 VAE)."""
    if two_experts:
        return "2.2-A14B"
    if int(vae_config.get("z_dim", 16)) == 48:
        return "2.2-TI2V-5B"
    return "2.1"


# --- the family ----------------------------------------------------------------------------------------------
class WanFamily(WanPrograms, FolderOrFiles, ModelFamily):
    """A loaded Wan model, from a diffusers folder or ComfyUI single files. Components load on first use, once."""

    SPEC = SPEC
    FILES = WanFiles
    RULES = RULES
    # diffusers' WanTransformer3DModel.blocks; the pipelines call CFG's two passes apart ("cond", "uncond")
    STEP_CACHE_BLOCKS = BlockSpec("blocks")
    CFG_CONTEXTS = "halves"

    def __init__(self, path: str | Path | None = None, *, files: "WanFiles | dict | None" = None,
                 dtype: str = "auto", runtime: Runtime | None = None, mesh: "str | dict | MeshSpec | None" = None,
                 attention: "AttentionConfig | str | None" = None, fsdp: bool = False,
                 vae_sharding: str = "auto", target_devices=None, index: dict | None = None,
                 layers: int | None = None):
        self._folder_or_files(path, files)
        self._names: dict[str, dict[str, str]] = {}  # single files: file key -> module name, per component
        if self.path is not None:
            self.index = inspect_wan_folder(self.path, weights=target_devices is None, index=index)
            self.transformer_config = read_config(self.path / "transformer")
            self.vae_config = read_config(self.path / "vae")
            self.text_config = read_config(self.path / "text_encoder")
            self.two_experts = present(self.index.get("transformer_2"))
            self.transformer_2_config = read_config(self.path / "transformer_2") if self.two_experts else None
            self.scheduler_config = read_config(self.path / "scheduler", "scheduler_config.json")
            self.boundary_ratio = self.index.get("boundary_ratio")
            self.expand_timesteps = bool(self.index.get("expand_timesteps", False))
            has_encoder = present(self.index.get("image_encoder"))
            self.image_encoder_config = read_config(self.path / "image_encoder") if has_encoder else None
        else:
            self._inspect_files(self.files)
        self.transformer_config = self._with_layers(self.transformer_config, layers)
        if self.transformer_2_config is not None:
            self.transformer_2_config = self._with_layers(self.transformer_2_config, layers)
        self.generation = generation_of(self.transformer_config, self.vae_config, self.two_experts)
        if self.two_experts and self.boundary_ratio is None:
            raise ModelFolderError("a two-expert Wan model needs boundary_ratio in model_index.json (0.875 for "
                                   "Wan2.2-T2V-A14B): add it, or re-download model_index.json")
        if self.transformer_2_config is not None and _arch(self.transformer_2_config) != _arch(self.transformer_config):
            raise ModelFolderError("the two experts (transformer and transformer_2) have different architectures: "
                                   "both must be the high- and low-noise halves of one Wan 2.2 model")
        configs = {"transformer": self.transformer_config, "vae": self.vae_config, "text_encoder": self.text_config}
        self.signature = config_signature(configs)
        self.vae_scale_spatial = int(self.vae_config.get("scale_factor_spatial", 8))
        self.vae_scale_temporal = int(self.vae_config.get("scale_factor_temporal", 4))
        self._image_inputs()
        self.size_multiple = self.vae_scale_spatial * int(self.transformer_config["patch_size"][1])
        self._setup(dtype, runtime, mesh, attention, fsdp, heads=self.transformer_config["num_attention_heads"],
                    vae_sharding=vae_sharding, target_devices=target_devices)

    def _image_inputs(self) -> None:
        """What images the model takes, read from its transformer: image-to-video models take the frame mask and
        the image's latents on channels (in = out + mask + latent channels); TI2V-5B optionally holds its first
        latent frame at the image; Wan 2.1 I2V/FLF2V also attend to CLIP vision features (``image_dim``), FLF2V
        to a first and a last image's (``pos_embed_seq_len``)."""
        c = self.transformer_config
        concat = int(c["in_channels"]) == int(c["out_channels"]) + self.vae_scale_temporal + int(self.vae_config["z_dim"])
        self.image_input = "required" if concat else "optional" if self.expand_timesteps else "none"
        self.concat_condition = concat
        self.uses_clip = c.get("image_dim") is not None
        self.last_image_input = c.get("pos_embed_seq_len") is not None
        if self.uses_clip and self.image_encoder_config is None:
            if self.path is not None:
                raise ModelFolderError(f"{self.path}'s transformer attends to CLIP image features but the folder has "
                                       "no image_encoder: re-download the model's image_encoder/ and image_processor/")
            raise InputError(f"{self.files.transformer.name} is a Wan 2.1 image-to-video model: give the CLIP vision "
                             "file too (--clip-vision models/clip_vision/clip_vision_h.safetensors, or the loader's "
                             "clip_vision input)")
        if not self.uses_clip:
            self.image_encoder_config = None  # a CLIP file given to a model without image features is not read

    def _inspect_files(self, files: WanFiles) -> None:
        from .files import transformer_names, umt5_names, vae_names

        self.transformer_config, self._names["transformer"] = transformer_names(files.transformer)
        self.two_experts = files.transformer_2 is not None
        self.transformer_2_config = None
        if self.two_experts:
            self.transformer_2_config, self._names["transformer_2"] = transformer_names(files.transformer_2)
        self.text_config, self._names["text_encoder"] = umt5_names(files.text_encoder)
        self.image_encoder_config = None
        if files.clip_vision is not None:
            from .files import clip_vision_names

            self.image_encoder_config, self._names["image_encoder"] = clip_vision_names(files.clip_vision)
        self.vae_config, self._names["vae"] = vae_names(files.vae)
        if self.text_config["d_model"] != self.transformer_config["text_dim"]:
            raise ModelFolderError(f"text encoder {files.text_encoder} gives {self.text_config['d_model']}-wide "
                                   f"embeddings, the transformer takes {self.transformer_config['text_dim']}: use "
                                   "the umT5-XXL file made for Wan")
        if self.vae_config["z_dim"] != self.transformer_config["out_channels"]:
            raise ModelFolderError(f"VAE {files.vae} has {self.vae_config['z_dim']} latent channels, the transformer "
                                   f"{self.transformer_config['out_channels']}: use wan2.2_vae with TI2V-5B and "
                                   "wan_2.1_vae with every other Wan model")
        generation = generation_of(self.transformer_config, self.vae_config, self.two_experts)
        self.scheduler_config = dict(DEFAULT_SCHEDULER, flow_shift=DEFAULT_SHIFT[generation])
        image_to_video = self.transformer_config["in_channels"] != self.transformer_config["out_channels"]
        self.boundary_ratio = (DEFAULT_BOUNDARY_I2V if image_to_video else DEFAULT_BOUNDARY) if self.two_experts \
            else None
        self.expand_timesteps = generation == "2.2-TI2V-5B"

    # --- loading ---------------------------------------------------------------------------------------------
    def _source(self, name: str) -> ComponentSource:
        config = {"transformer": self.transformer_config, "transformer_2": self.transformer_2_config,
                  "vae": self.vae_config, "text_encoder": self.text_config,
                  "image_encoder": self.image_encoder_config}.get(name)
        if config is None:
            raise KeyError(name)
        from ...engine.weights import safetensors_files

        cls = model_class(*(self.index[name] if self.path is not None else FILE_CLASSES[name]))
        build = builder(cls, config)
        if self.abstract:
            files, names, where = [], None, self.label
        elif self.path is not None:
            files, names, where = safetensors_files(self.path / name), None, self.path / name
        else:
            path = {"transformer": self.files.transformer, "transformer_2": self.files.transformer_2,
                    "text_encoder": self.files.text_encoder, "vae": self.files.vae,
                    "image_encoder": self.files.clip_vision}[name]
            files, names, where = [path], self._names[name], path
        source = ComponentSource(cls, build, files, f"Wan {name} ({where})", names=names)
        if name in ("transformer", "transformer_2"):
            source.ignore = (r"norm_added_q",)
            source.finish = _with_attention_processor
        if name == "image_encoder":
            # The CLIP vision encoder runs in float32 whatever the model's dtype (as the Wan I2V model cards load
            # it): it runs once per video, and its features steer every step.
            source.dtype, source.ignore = torch.float32, (r"position_ids$",)
            source.names = lambda keys, given=names: _clip_module_names(given or {k: k for k in keys}, build)
        return source

    def _origin(self, name: str) -> str:
        if self.path is not None:
            return super()._origin(name)
        roles = {"transformer": "transformer", "transformer_2": "transformer_2", "text_encoder": "text_encoder",
                 "tokenizer": "text_encoder", "vae": "vae", "image_encoder": "clip_vision"}
        return f"{name} from {Path(getattr(self.files, roles.get(name, 'transformer'))).name}"

    def _load_tokenizer(self):
        if self.path is not None:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(self.path / "tokenizer")
        from ...engine.tokenizers import SentencePieceTokenizer

        return SentencePieceTokenizer.from_file(self.files.text_encoder, eos=True)

    def scheduler(self, name: str | None = None, shift: float | None = None):
        """A fresh diffusers scheduler: the model's UniPC (or ``name`` "euler"), with ``shift`` if given."""
        import diffusers

        config = dict(self.scheduler_config)
        model_shift = config.get("flow_shift", config.get("shift", 1.0))
        shift = model_shift if shift is None else float(shift)
        if name is None:
            cls_name = config.get("_class_name", "UniPCMultistepScheduler")
            name = {"UniPCMultistepScheduler": "unipc", "FlowMatchEulerDiscreteScheduler": "euler"}.get(cls_name)
            if name is None:
                raise ModelFolderError(f"the model's scheduler {cls_name} is not supported: pick scheduler "
                                       f"{' or '.join(SCHEDULERS)}")
        if name == "unipc":
            return diffusers.UniPCMultistepScheduler.from_config(
                {k: v for k, v in config.items() if k != "shift"}, flow_shift=shift)
        if name == "euler":
            return diffusers.FlowMatchEulerDiscreteScheduler(
                num_train_timesteps=int(config.get("num_train_timesteps", 1000)), shift=shift)
        if name == "euler_simple":
            return euler_simple_scheduler(int(config.get("num_train_timesteps", 1000)), shift)
        raise InputError(f"scheduler {name!r} is not one Wan uses: pick one of {list(SCHEDULERS)}")

    # --- facts ---------------------------------------------------------------------------------------------------
    def native_size(self) -> tuple[int, int, int]:
        if self.generation == "2.1" and self.image_input == "required":
            # Wan 2.1 I2V 480P and 720P (and FLF2V, 720P) share one architecture: only their names tell the size
            # they were trained at; diffusers' image-to-video pipeline defaults to 480x832.
            return NATIVE["2.1"] if "720" in self.label.lower() else NATIVE["2.1-small"]
        if self.generation == "2.1":
            small = self.transformer_config["num_attention_heads"] * self.transformer_config["attention_head_dim"]
            return NATIVE["2.1-small" if small <= 2048 else "2.1"]
        return NATIVE[self.generation]

    def default_fps(self) -> int:
        return FPS[self.generation]

    def describe(self) -> dict:
        return {**super().describe(), "source": self.describe_source(), "two_experts": self.two_experts,
                "expand_timesteps": self.expand_timesteps}

    # --- validation ------------------------------------------------------------------------------------------
    def validate(self, height: int, width: int, num_frames: int) -> None:
        """Raise ``InputError`` for sizes this model cannot take, before anything compiles."""
        m = self.size_multiple
        why = f" for Wan {self.generation} (VAE x{self.vae_scale_spatial}, 2x2 patches)" if m != 16 else ""
        problems = size_problems(height, width, m, why)
        problem = frame_problem(num_frames, self.vae_scale_temporal, self.native_size()[2], f"Wan {self.generation}")
        raise_problems(problems + ([problem] if problem else []))

    def _lora_original_name(self, name: str) -> str:
        from .files import wan_transformer_to_original

        return wan_transformer_to_original(name)

    def validate_settings(self, s: SampleSettings) -> None:
        """The second expert's settings need a second expert."""
        if not self.two_experts:
            for name in ("guidance_2", "boundary"):
                if s.options.get(name) is not None:
                    raise InputError(f"{name}={s.options[name]} applies only to two-expert Wan 2.2 models (A14B); "
                                     f"this model has one transformer: leave {name} unset")

    # --- stage 1: text -----------------------------------------------------------------------------------------
    def tokenize(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        tokenizer = self.component("tokenizer")
        texts = [prompt_clean(t) for t in texts]
        out = tokenizer(texts, padding="max_length", max_length=TEXT_LEN, truncation=True, add_special_tokens=True,
                        return_attention_mask=True, return_tensors="pt")
        return out.input_ids, out.attention_mask

    def text_shape(self) -> tuple[int, ...]:
        return (1, TEXT_LEN, int(self.transformer_config["text_dim"]))

    # --- stage 1b: the image (image-to-video) ---------------------------------------------------------------
    def encode_image(self, image, last_image=None, *, height: int, width: int, num_frames: int) -> ImageConditioning:
        """The first (and last) frame as sampling takes them, for a ``num_frames`` x ``height`` x ``width`` video:
        the VAE encoding of the conditioning video (normalised, with its frame mask in front for the models that
        concatenate it) and, for Wan 2.1 I2V / FLF2V, the CLIP vision features. One compiled program per size."""
        from ...engine.images import as_pil, video_image

        self.check_images(image is not None, last_image is not None)
        self.validate(height, width, num_frames)
        images = [as_pil(image, "image")] + ([as_pil(last_image, "last image")] if last_image is not None else [])
        programs = self.image_programs(height, width, num_frames, len(images))
        vae_programs = [p for p in programs if p.part != "clip"]
        pixels = [self.put(video_image(im, height, width)[:, :, None].to(self.dtype)) for im in images]
        chunks = self.latent_shape(height, width, num_frames)[2] if not self.expand_timesteps else 1
        condition = torch.cat(self.run_stage(vae_programs, pixels, range(2, chunks)), dim=2).float()
        embeds = None
        if self.uses_clip:
            clip_pixels = self._clip_processor()(images=images, return_tensors="pt").pixel_values
            embeds, = self.run_stage(programs[-1:], [self.put(clip_pixels.float())])
        if self.concat_condition:
            condition = torch.cat([self._frame_mask(height, width, num_frames, len(images) == 2), condition], dim=1)
        return ImageConditioning(condition, height, width, num_frames, self.signature, image_embeds=embeds,
                                 last_image=len(images) == 2)

    def _clip_processor(self):
        """diffusers' CLIP preprocessing (resize the short side to 224, centre crop, CLIP's mean and std): the
        folder's ``image_processor``, or CLIPImageProcessor's defaults, which are clip_vision_h's."""
        from transformers import CLIPImageProcessor

        folder = self.path / "image_processor" if self.path is not None else None
        if folder is not None and folder.is_dir():
            return CLIPImageProcessor.from_pretrained(folder)
        size = int(self.image_encoder_config.get("image_size", 224))
        return CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})

    def _frame_mask(self, height: int, width: int, num_frames: int, last: bool) -> torch.Tensor:
        """diffusers' mask ``[1, 4, T, h, w]``: 1 on the pixel frames given (the first, and the last), the first
        repeated over the VAE's 4-frame groups, folded into 4 channels per latent frame."""
        t = self.vae_scale_temporal
        h, w = height // self.vae_scale_spatial, width // self.vae_scale_spatial
        mask = torch.zeros(1, 1, num_frames, h, w)
        mask[:, :, 0] = 1
        if last:
            mask[:, :, -1] = 1
        mask = torch.cat([mask[:, :, :1].repeat_interleave(t, dim=2), mask[:, :, 1:]], dim=2)
        return mask.view(1, -1, t, h, w).transpose(1, 2)

    # --- stage 2: sampling -------------------------------------------------------------------------------------
    def latent_shape(self, height: int, width: int, num_frames: int) -> tuple[int, ...]:
        frames = (num_frames - 1) // self.vae_scale_temporal + 1
        s = self.vae_scale_spatial
        return (1, int(self.transformer_config["out_channels"]), frames, height // s, width // s)

    def published_mag_ratios(self, s: SampleSettings, image: bool) -> tuple[str, dict] | None:
        from .magcache import published

        name = str(self.path) if self.path is not None else str(getattr(self.files, "transformer", ""))
        return published(self.transformer_config, self.two_experts, image, s.height, s.width, name)

    def _image_mode(self, image: ImageConditioning | None) -> str:
        """How sampling uses the image: "" (none), "concat" (on channels, with the mask), "first" (TI2V-5B's first
        latent frame held at the image, timestep 0 on its tokens)."""
        if image is None:
            return ""
        return "concat" if self.concat_condition else "first"

    def sampling_run(self, embeddings: TextEmbeddings, s: SampleSettings, cfg: bool,
                     image: ImageConditioning | None = None, latents: VideoLatents | None = None) -> SamplingRun:
        """Seeded noise denoised by the scheduler's linear plan; image-to-video: ``image`` is the image encode
        stage's output for this size. Wan 2.2's two experts take turns at the boundary with one program (the first
        guidance alone turns CFG on for both, as diffusers decides)."""
        from diffusers.utils.torch_utils import randn_tensor

        guidance = self.DEFAULT_GUIDANCE if s.guidance is None else float(s.guidance)
        guidance_2 = guidance if s.options.get("guidance_2") is None else float(s.options["guidance_2"])
        scheduler = self.scheduler(s.scheduler, s.options.get("shift"))
        plan = linear_plan(scheduler, s.steps)
        boundary = None
        if self.two_experts:
            ratio = self.boundary_ratio if s.options.get("boundary") is None else float(s.options["boundary"])
            boundary = ratio * scheduler.config.num_train_timesteps
        mode = self._image_mode(image)
        images = 0 if image is None or image.image_embeds is None else int(image.image_embeds.shape[0])
        program = self.sample_program(s.height, s.width, s.num_frames, cfg, plan, mode, images)
        experts = ["transformer_2" if boundary is not None and float(t) < boundary else "transformer"
                   for t in plan.timesteps]

        # The only random draw of text-to-video: the initial latents, float32, on the CPU generator.
        generator = torch.Generator("cpu").manual_seed(int(s.seed))
        shape = self.latent_shape(s.height, s.width, s.num_frames)
        noise = randn_tensor(shape, generator=generator, device=torch.device("cpu"), dtype=torch.float32)
        embeds_dev = self.cfg_batch(embeddings.prompt_embeds, embeddings.negative_prompt_embeds, cfg)
        kept_dev = tuple(self.put(torch.zeros(shape, dtype=torch.float32)) for _ in range(plan.kept))
        condition_dev = None if image is None else self.put(image.latents.float())
        image_embeds_dev = None
        if images:
            image_embeds_dev = self.cfg_batch(image.image_embeds, image.image_embeds, cfg)

        def arguments(i, carry):
            g = guidance_2 if experts[i] == "transformer_2" else guidance
            x, kept = carry
            return (x, kept, embeds_dev, self.put(torch.tensor([float(plan.timesteps[i])], dtype=torch.float32)),
                    self.put(torch.from_numpy(plan.matrices[i])), self.put(torch.tensor([g], dtype=torch.float32)),
                    condition_dev, image_embeds_dev)

        def finish(carry):
            result = self.runtime.to_cpu(carry[0]).float().contiguous()
            if mode == "first":  # diffusers puts the image's latent frame back in front before decoding
                result[:, :, :1] = image.latents[:, :, :1].float()
            return VideoLatents(result, s.height, s.width, s.num_frames, self.signature)

        return SamplingRun(program, experts, (self.put(noise), kept_dev), arguments, finish)

    # --- stage 3: decode ---------------------------------------------------------------------------------------
    def latent_channels(self) -> int:
        return int(self.vae_config["z_dim"])

    def decode_inputs(self, z: torch.Tensor) -> list:
        mean, std_inv = (self.put(t) for t in self._latent_statistics())
        return [self.put(z.float(), self.vae_input_spec(z.shape)), mean, std_inv]

    def decode_chunks(self, z_shape: tuple[int, ...]) -> list[int]:
        return list(range(2, z_shape[2]))

    def vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        mean, std_inv = self._latent_statistics()
        return latents / std_inv.to(latents.dtype) + mean.to(latents.dtype)

    def _latent_statistics(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's per-channel latent mean and 1/std, shaped to broadcast over [1, C, T, H, W]."""
        channels = int(self.vae_config["z_dim"])
        mean = torch.tensor(self.vae_config["latents_mean"], dtype=torch.float32).view(1, channels, 1, 1, 1)
        std_inv = 1.0 / torch.tensor(self.vae_config["latents_std"], dtype=torch.float32).view(1, channels, 1, 1, 1)
        return mean, std_inv


def _with_attention_processor(transformer: torch.nn.Module) -> torch.nn.Module:
    transformer.set_attn_processor(WanFunctionalAttnProcessor())
    return transformer


def _clip_module_names(names: dict[str, str], build) -> dict[str, str]:
    """File key -> module name for a CLIP vision model whose files say ``vision_model.…`` (older transformers,
    ComfyUI) while the installed transformers may name its parameters without that prefix, or the reverse."""
    with torch.device("meta"):
        prefixed = any(n.startswith("vision_model.") for n in build().state_dict())
    bare = {k: v.removeprefix("vision_model.") for k, v in names.items()}
    return {k: "vision_model." + v for k, v in bare.items()} if prefixed else bare


def _arch(config: dict) -> dict:
    return {k: v for k, v in config.items() if not k.startswith("_")}
