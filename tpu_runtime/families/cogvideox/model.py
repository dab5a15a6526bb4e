"""CogVideoX text- and image-to-video on JAX through torchax: recognise and load a folder, encode text (and the
first frame), sample, decode.

The stages match diffusers' ``CogVideoXPipeline`` number for number (same weights, prompt and seed give the
same frames), but each stage is one compiled program per shape (``programs.py``):

- encode: the T5 encoder on ``[negative, positive]`` token ids, padded to the transformer's text length.
- sample: one program for a whole denoising step (CFG batch, transformer, guidance, scheduler update). Timestep,
  guidance scale and scheduler coefficients enter as arrays, computed on the host from diffusers' own scheduler
  (``schedule.py``), so N steps compile once and a new seed or prompt compiles nothing. Every random tensor is
  drawn on the CPU from one ``torch.Generator`` in the order diffusers draws it.
- decode: the diffusers VAE, batch by batch exactly as diffusers batches it (GroupNorm statistics span a batch).

Generations: 2b (sin-cos positions), 5b (RoPE, linspace grid), 1.5 (RoPE slice grid, ``patch_size_t=2``: an odd
latent frame count gets one extra latent frame in front, dropped before decode).

Image to video (``CogVideoXImageToVideoPipeline``: 5b-I2V, 1.5-I2V): the image encode stage runs the VAE encoder
on the first frame and returns its posterior (mean, std); sampling draws the image latent from it as the seed's
first draw, scales it, puts it in front of zero frames and concatenates it on channels at every step (1.5-I2V
also passes ``ofs``), exactly as diffusers' ``prepare_latents`` and denoising loop do.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import torch

from ...engine.attention import AttentionConfig
from ...engine.components import ComponentSource, builder, model_class
from ...engine.family import ModelFamily
from ...engine.folders import inspect_family_folder, read_config, resolve_model_path
from ...engine.runtime import Runtime
from ...engine.sharding import MeshSpec
from ...engine.stages import (ImageConditioning, SampleSettings, SamplingRun, TextEmbeddings, VideoLatents,
                              config_signature)
from ...engine.stepcache import BlockSpec
from ...engine.validation import frame_problem, raise_problems, size_problems
from ...errors import InputError, ModelFolderError
from . import SPEC
from .programs import CogVideoXFunctionalAttnProcessor, CogVideoXPrograms
from .rules import RULES
from .schedule import cogvideox_plan

log = logging.getLogger(__name__)

COMPONENTS = ("scheduler", "text_encoder", "tokenizer", "transformer", "vae")
SCHEDULERS = {"ddim": "CogVideoXDDIMScheduler", "dpm": "CogVideoXDPMScheduler"}
I2V_15_NATIVE = (768, 1360, 81)


# --- model folder --------------------------------------------------------------------------------------------
def inspect_model_folder(path: str | Path, weights: bool = True, index: dict | None = None) -> dict:
    """Check that ``path`` is a complete diffusers CogVideoX folder; return its model_index. ``weights=False``:
    only the configs are needed (planning compiles with the weights' shapes alone)."""
    return inspect_family_folder(path, SPEC, required=COMPONENTS, index=index, weights=weights)


def generation_of(transformer_config: dict) -> str:
    """Which CogVideoX generation a transformer config describes: "2b", "5b" or "1.5"."""
    if transformer_config.get("patch_size_t"):
        return "1.5"
    if transformer_config.get("use_rotary_positional_embeddings"):
        return "5b"
    return "2b"


def frame_rule(generation: str) -> int:
    """Frames must be ``k * rule + 1``: 8 for 2b/5b (49 native), 16 for 1.5 (81 native)."""
    return 16 if generation == "1.5" else 8


# --- the family ----------------------------------------------------------------------------------------------
class CogVideoXFamily(CogVideoXPrograms, ModelFamily):
    """A loaded CogVideoX model. Components load and move to the devices on first use, once."""

    SPEC = SPEC
    RULES = RULES
    # diffusers' CogVideoXTransformer3DModel.transformer_blocks take and return the video and the text tokens;
    # MagCache's residual covers the video tokens (the text tokens pass through: nothing reads them after the
    # blocks). The pipelines call CFG's two passes as one batch ("cond_uncond"): one cache state.
    STEP_CACHE_BLOCKS = BlockSpec("transformer_blocks", streams=("hidden_states", "encoder_hidden_states"),
                                  mag_streams=("hidden_states",))
    CFG_CONTEXTS = "batch"

    def __init__(self, path: str | Path, dtype: str = "auto", runtime: Runtime | None = None,
                 mesh: "str | dict | MeshSpec | None" = None, attention: "AttentionConfig | str | None" = None,
                 fsdp: bool = False, vae_sharding: str = "auto", target_devices=None, *, index: dict | None = None,
                 layers: int | None = None):
        self.path = resolve_model_path(path)
        self.index = inspect_model_folder(self.path, weights=target_devices is None, index=index)
        self.text_config = read_config(self.path / "text_encoder")
        self.transformer_config = self._with_layers(read_config(self.path / "transformer"), layers)
        self.vae_config = read_config(self.path / "vae")
        self.generation = generation_of(self.transformer_config)
        self.signature = config_signature({"text_encoder": self.text_config, "transformer": self.transformer_config,
                                           "vae": self.vae_config})
        self.text_len = int(self.transformer_config.get("max_text_seq_length", 226))
        self.vae_scale_spatial = 2 ** (len(self.vae_config["block_out_channels"]) - 1)
        self.vae_scale_temporal = int(self.vae_config.get("temporal_compression_ratio", 4))
        c = self.transformer_config
        # Image-to-video models take the image latents concatenated on channels: twice the output's channels.
        self.image_input = "required" if int(c["in_channels"]) == 2 * int(c["out_channels"]) else "none"
        self._setup(dtype, runtime, mesh, attention, fsdp, heads=self.transformer_config["num_attention_heads"],
                    vae_sharding=vae_sharding, target_devices=target_devices)

    # --- loading ---------------------------------------------------------------------------------------------
    def _source(self, name: str) -> ComponentSource:
        if name not in ("text_encoder", "transformer", "vae"):
            raise KeyError(name)
        from ...engine.weights import safetensors_files

        config = {"text_encoder": self.text_config, "transformer": self.transformer_config,
                  "vae": self.vae_config}[name]
        cls = model_class(*self.index[name])
        finish = None
        if name == "transformer":
            def finish(part):
                part.set_attn_processor(CogVideoXFunctionalAttnProcessor())
                return part
        files = [] if self.abstract else safetensors_files(self.path / name)
        return ComponentSource(cls, builder(cls, config), files, f"CogVideoX {name} ({self.path / name})",
                               finish=finish)

    def _load_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path / "tokenizer")

    def scheduler(self, name: str | None = None):
        """A fresh diffusers scheduler from the folder's config; ``name`` ("ddim"/"dpm") overrides its class."""
        import diffusers

        config_file = self.path / "scheduler" / "scheduler_config.json"
        config = read_config(self.path / "scheduler", "scheduler_config.json")
        cls_name = config.get("_class_name", SCHEDULERS["ddim"])
        if name is not None:
            if name not in SCHEDULERS:
                raise InputError(f"scheduler {name!r} is not one CogVideoX uses: pick one of {sorted(SCHEDULERS)}")
            cls_name = SCHEDULERS[name]
        if cls_name not in SCHEDULERS.values():
            raise ModelFolderError(
                f"{config_file} names {cls_name}; supported schedulers are {sorted(SCHEDULERS.values())}: "
                "pick one with scheduler='ddim' or 'dpm'"
            )
        return getattr(diffusers, cls_name).from_config(config)

    def native_size(self) -> tuple[int, int, int]:
        c = self.transformer_config
        s = self.vae_scale_spatial
        if self.generation == "1.5" and self.image_input != "none" and c["sample_height"] * s > I2V_15_NATIVE[0]:
            # CogVideoX1.5-5B-I2V's positions are built for up to 2400x2400; its card's size is 768x1360.
            return I2V_15_NATIVE
        return c["sample_height"] * s, c["sample_width"] * s, c["sample_frames"]

    def default_fps(self) -> int:
        return 16 if self.generation == "1.5" else 8

    def reference_pipeline(self) -> tuple[str, dict]:
        return self.index["_class_name"], {"max_sequence_length": self.text_len}

    def vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return latents / float(self.vae_config.get("scaling_factor", 1.15258426))

    # --- validation ------------------------------------------------------------------------------------------
    def validate(self, height: int, width: int, num_frames: int) -> None:
        """Raise ``InputError`` for sizes this model cannot take, before anything compiles."""
        problems = size_problems(height, width, 16)
        if self.transformer_config.get("patch_size_t") and not problems:
            # 1.5's RoPE grid is sliced out of one built for the training size: larger frames have no positions.
            max_h = self.transformer_config["sample_height"] * self.vae_scale_spatial
            max_w = self.transformer_config["sample_width"] * self.vae_scale_spatial
            if height > max_h or width > max_w:
                problems.append(f"height x width = {height}x{width} exceeds the {max_h}x{max_w} this "
                                f"CogVideoX-{self.generation} model has positions for: use at most {max_h}x{max_w}")
        if self.transformer_config.get("use_learned_positional_embeddings") and not problems:
            native_h, native_w, _ = self.native_size()
            if (height, width) != (native_h, native_w):
                # diffusers refuses it too: learned positions exist for the training size only.
                problems.append(f"height x width = {height}x{width}: this model ({self.label}) has learned "
                                f"positions for {native_h}x{native_w} only: use height={native_h} width={native_w}")
        native = 81 if self.generation == "1.5" else 49
        problem = frame_problem(num_frames, frame_rule(self.generation), native, f"CogVideoX-{self.generation}")
        raise_problems(problems + ([problem] if problem else []))

    # --- stage 1: text -----------------------------------------------------------------------------------------
    def tokenize(self, texts: list[str]) -> tuple[torch.Tensor]:
        tokenizer = self.component("tokenizer")
        ids = tokenizer(
            texts, padding="max_length", max_length=self.text_len, truncation=True,
            add_special_tokens=True, return_tensors="pt",
        ).input_ids
        full = tokenizer(texts, padding="longest", return_tensors="pt").input_ids
        if full.shape[-1] > ids.shape[-1]:
            log.warning("prompt longer than %d tokens was truncated", self.text_len)
        return (ids,)

    def text_shape(self) -> tuple[int, ...]:
        return (1, self.text_len, int(self.transformer_config["text_embed_dim"]))

    # --- stage 1b: the image (image-to-video) ---------------------------------------------------------------
    def encode_image(self, image, last_image=None, *, height: int, width: int, num_frames: int) -> ImageConditioning:
        """The VAE posterior of the first frame ``image`` (a file, a PIL image or a ComfyUI IMAGE) resized to
        ``height`` x ``width``; sampling draws from it. One compiled program per size."""
        from ...engine.images import video_image

        self.check_images(image is not None, last_image is not None)
        self.validate(height, width, num_frames)
        pixels = video_image(image, height, width)[:, :, None]  # [1, 3, 1, H, W]
        (mean, std), = self.run_stage(self.image_programs(height, width, num_frames),
                                      [self.put(pixels.to(self.dtype))])
        return ImageConditioning(mean, height, width, num_frames, self.signature, latents_std=std)

    def _image_latents(self, image: ImageConditioning, shape: tuple[int, ...], generator) -> torch.Tensor:
        """The image's latents as the transformer takes them ``[1, T, C, h, w]``: a sample of the posterior (the
        generator's first draw), scaled, in front of zero frames, as diffusers' ``prepare_latents`` makes them."""
        from diffusers.utils.torch_utils import randn_tensor

        mean = image.latents.to(self.dtype)
        std = image.latents_std.to(self.dtype)
        noise = randn_tensor(tuple(mean.shape), generator=generator, device=torch.device("cpu"), dtype=self.dtype)
        first = (mean + std * noise).permute(0, 2, 1, 3, 4)  # [1, 1, C, h, w]
        scale = float(self.vae_config.get("scaling_factor", 1.15258426))
        # CogVideoX1.5's VAE config says invert_scale_latents: its I2V model was trained on unscaled-by-1/s latents.
        first = first / scale if self.vae_config.get("invert_scale_latents") else first * scale
        zeros = torch.zeros((1, shape[1] - 1, *first.shape[2:]), dtype=self.dtype)
        return torch.cat([first, zeros], dim=1)

    # --- stage 2: sampling -------------------------------------------------------------------------------------
    def latent_shape(self, height: int, width: int, num_frames: int) -> tuple[tuple[int, ...], int]:
        """Shape ``[B, T, C, h, w]`` of the latents the sampler works on, and how many padding frames lead it."""
        frames = (num_frames - 1) // self.vae_scale_temporal + 1
        pad = 0
        p_t = self.transformer_config.get("patch_size_t")
        if p_t and frames % p_t:
            pad = p_t - frames % p_t
        channels = int(self.transformer_config["out_channels"])
        s = self.vae_scale_spatial
        return (1, frames + pad, channels, height // s, width // s), pad

    def _rotary_embeddings(self, height: int, width: int, latent_frames: int):
        if not self.transformer_config.get("use_rotary_positional_embeddings"):
            return None
        from diffusers.models.embeddings import get_3d_rotary_pos_embed
        from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

        c = self.transformer_config
        p, p_t = c["patch_size"], c.get("patch_size_t")
        grid_h = height // (self.vae_scale_spatial * p)
        grid_w = width // (self.vae_scale_spatial * p)
        base_w, base_h = c["sample_width"] // p, c["sample_height"] // p
        if p_t is None:
            crops = get_resize_crop_region_for_grid((grid_h, grid_w), base_w, base_h)
            cos, sin = get_3d_rotary_pos_embed(
                embed_dim=c["attention_head_dim"], crops_coords=crops, grid_size=(grid_h, grid_w),
                temporal_size=latent_frames, device="cpu",
            )
        else:
            cos, sin = get_3d_rotary_pos_embed(
                embed_dim=c["attention_head_dim"], crops_coords=None, grid_size=(grid_h, grid_w),
                temporal_size=(latent_frames + p_t - 1) // p_t, grid_type="slice", max_size=(base_h, base_w),
                device="cpu",
            )
        return cos, sin

    def _has_ofs(self) -> bool:
        return self.transformer_config.get("ofs_embed_dim") is not None

    def sampling_run(self, embeddings: TextEmbeddings, s: SampleSettings, cfg: bool,
                     image: ImageConditioning | None = None, latents: VideoLatents | None = None) -> SamplingRun:
        """Seeded noise, denoised with the scheduler's per-step coefficients; image-to-video models take the first
        frame's ``image`` encoding. Random draws, on CPU, in diffusers' order: (image-to-video) the image's
        posterior sample, the initial noise, then (DPM) the noise of every step."""
        from diffusers.utils.torch_utils import randn_tensor

        scheduler = self.scheduler(s.scheduler)
        stochastic = type(scheduler).__name__ == SCHEDULERS["dpm"]
        shape, pad = self.latent_shape(s.height, s.width, s.num_frames)
        program = self.sample_program(s.height, s.width, s.num_frames, cfg)
        generator = torch.Generator("cpu").manual_seed(int(s.seed))
        draw = lambda: randn_tensor(shape, generator=generator, device=torch.device("cpu"), dtype=self.dtype)  # noqa: E731
        image_dev = None if image is None else self.put(self._image_latents(image, shape, generator))
        noise = draw() * scheduler.init_noise_sigma
        scheduler.set_timesteps(s.steps, device="cpu")
        timesteps = scheduler.timesteps
        plan = cogvideox_plan(scheduler, timesteps, s.guidance, self.option(s, "dynamic_cfg"), dpm=stochastic)

        put = self.put
        embeds_dev = self.cfg_batch(embeddings.prompt_embeds, embeddings.negative_prompt_embeds, cfg)
        rope = self._rotary_embeddings(s.height, s.width, shape[1])
        rope_dev = put(rope) if rope is not None else None
        noise_zero = put(torch.zeros(shape, dtype=self.dtype))  # DDIM adds no noise (its coefficient D is 0)
        old_x0 = put(torch.zeros(shape, dtype=torch.float32))  # no previous x0 before the first step (Q is 0)
        ofs_dev = put(torch.full((1,), 2.0, dtype=self.dtype)) if self._has_ofs() else None  # diffusers' ofs

        def arguments(i, carry):
            step_noise = noise_zero
            if stochastic:
                step_noise = draw()
                if plan.second_draw[i]:
                    step_noise = draw()
                step_noise = put(step_noise)
            latents_dev, previous_x0 = carry
            return (latents_dev, embeds_dev, put(torch.tensor([int(timesteps[i])], dtype=torch.int32)),
                    put(torch.from_numpy(plan.coeffs[i])), step_noise, previous_x0, rope_dev, image_dev, ofs_dev)

        def finish(carry):
            result = self.runtime.to_cpu(carry[0])[:, pad:].permute(0, 2, 1, 3, 4).float().contiguous()
            return VideoLatents(result, s.height, s.width, s.num_frames, self.signature)

        return SamplingRun(program, ["transformer"] * len(timesteps), (put(noise), old_x0), arguments, finish)

    # --- stage 3: decode ---------------------------------------------------------------------------------------
    def latent_channels(self) -> int:
        return int(self.vae_config["latent_channels"])

    def decode_inputs(self, z: torch.Tensor) -> list:
        return [self.put(z.to(self.dtype), self.vae_input_spec(z.shape))]

    def decode_chunks(self, z_shape: tuple[int, ...]) -> list[int]:
        return self._later_batches(z_shape[2])

    def _later_batches(self, latent_frames: int) -> list[int]:
        """Where each batch after the first two starts (the later-batch program's calls)."""
        return self._batch_starts(latent_frames)[2:]

    def _batch_starts(self, latent_frames: int) -> list[int]:
        """Where each latent batch starts: diffusers' ``_decode`` takes ``num_latent_frames_batch_size`` frames a
        batch, and the first batch takes the remainder as well."""
        size = int(self.component("vae").num_latent_frames_batch_size)
        batches, rest = max(latent_frames // size, 1), latent_frames % size
        return [0] + [size * i + rest for i in range(1, batches)]
