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
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ...engine.attention import AttentionConfig
from ...engine.family import ModelFamily
from ...engine.folders import FolderOrFiles, inspect_family_folder, read_config
from ...engine.runtime import Runtime
from ...engine.sharding import MeshSpec
from ...engine.stages import (ImageConditioning, SampleSettings, SamplingRun, TextEmbeddings, VideoLatents,
                              config_signature)
from ...engine.validation import frame_problem, raise_problems, size_problems
from ...errors import InputError, StageFileError
from . import SPEC
from .files import LTX2Files
from .loading import LTX2Components
from .programs import COEFFICIENTS, TEXT_LEN, Geometry, LTX2Programs, Passes
from .rules import CONNECTOR_INPUT_RULES, RULES, connector_rules
from .schedule import audio_latent_frames, positions, schedule_steps, timesteps

log = logging.getLogger(__name__)

COMPONENTS = ("scheduler", "text_encoder", "tokenizer", "connectors", "transformer", "vae", "audio_vae", "vocoder")
NATIVE = (512, 768, 121)  # diffusers' LTX2Pipeline.__call__ defaults (its other defaults: the declared settings')
SIZE_MULTIPLE = 32  # diffusers' LTX2Pipeline.check_inputs


def generation_of(transformer_config: dict, connectors_config: dict) -> str:
    """"2.3" (gated attention, prompt modulation, per-modality text projections) or "2.0"."""
    if transformer_config.get("cross_attn_mod") or connectors_config.get("per_modality_projections"):
        return "2.3"
    return "2.0"


class LTX2Family(LTX2Programs, LTX2Components, FolderOrFiles, ModelFamily):
    """A loaded LTX-2 model from a diffusers folder or ComfyUI's single files. Components load on first use,
    once."""

    SPEC = SPEC
    FILES = LTX2Files
    RULES = RULES
    image_input = "optional"  # text to video, or image to video with a first frame
    last_image_input = False

    def __init__(self, path: str | Path | None = None, *, files: "dict | None" = None, dtype: str = "auto", runtime: Runtime | None = None,
                 mesh: "str | dict | MeshSpec | None" = None, attention: "AttentionConfig | str | None" = None,
                 fsdp: bool = False, vae_sharding: str = "auto", target_devices=None, index: dict | None = None,
                 layers: int | None = None, upsampler: str | Path | None = None):
        self._folder_or_files(path, files)
        self._names: dict[str, dict[str, str]] = {}
        self._upscaler_config = None
        if self.files is not None:
            self._inspect_files(self.files)
        else:
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

    def scheduler(self):
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)

    # --- facts -----------------------------------------------------------------------------------------------
    def native_size(self) -> tuple[int, int, int]:
        return NATIVE

    def default_fps(self) -> int:
        return int(SPEC.setting("frame_rate").default)

    def fps_of(self, s: SampleSettings) -> int | None:
        rate = s.options.get("frame_rate")
        return None if rate is None else round(rate)

    def describe(self) -> dict:
        return {**super().describe(), "source": self.describe_source(),
                "upsampler": str(self.upsampler_path) if self.upsampler_path else None}

    def source_paths(self) -> list[Path]:
        if self.path is None:
            return self.file_paths()
        return [self.path] + ([self.upsampler_path] if self.upsampler_path else [])

    @property
    def sample_rate(self) -> int:
        """The waveform's samples per second (the vocoder's output rate)."""
        return int(self.configs["vocoder"].get("output_sampling_rate", 24000))

    # --- validation ------------------------------------------------------------------------------------------
    def rules_for(self, name: str):
        """The text connectors' rules depend on their heads: Megatron where ``tp`` divides a connector's heads
        (2.3's 32), its attention split by input where not (2.0's 30 on tp=8); see ``rules.py``."""
        if name != "connectors":
            return super().rules_for(name)
        config, rules = self.configs["connectors"], CONNECTOR_INPUT_RULES
        for modality in ("video", "audio"):
            heads = int(config[f"{modality}_connector_num_attention_heads"])
            rules += connector_rules(f"{modality}_connector", heads % self.mesh_spec.tp == 0)
        return rules

    def validate(self, height: int, width: int, num_frames: int) -> None:
        m = self.size_multiple
        why = f" for LTX-2 (diffusers' LTX-2 pipelines take multiples of {SIZE_MULTIPLE}; this VAE compresses " \
              f"{self.vae_scale_spatial}x)"
        problems = size_problems(height, width, m, why)
        problem = frame_problem(num_frames, self.vae_scale_temporal, NATIVE[2], "LTX-2")
        raise_problems(problems + ([problem] if problem else []))

    def validate_settings(self, s: SampleSettings) -> None:
        """One scheduler, a fixed schedule's own step count, STG blocks the transformer has."""
        if s.scheduler is not None:
            raise InputError(f"scheduler {s.scheduler!r}: LTX-2 samples with flow-matching Euler only (its sigma "
                             "schedule is chosen with sigmas: default, distilled, stage2); leave scheduler unset")
        sigmas = s.options.get("sigmas")
        fixed = schedule_steps(sigmas)
        if fixed is not None and s.steps != fixed:
            raise InputError(f"steps={s.steps}: the {sigmas} sigma schedule has {fixed} steps; leave steps at "
                             f"{fixed}")
        layers = int(self.transformer_config["num_layers"])
        blocks = s.options.get("stg_blocks") or ()
        for block in blocks:
            if not isinstance(block, int) or isinstance(block, bool) or not 0 <= block < layers:
                raise InputError(f"stg_blocks={list(blocks)}: this transformer has blocks 0..{layers - 1}")

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
        ag, stg, mod, r = (float(self.option(s, name)) for name in ("audio_guidance", "stg_scale", "modality_scale",
                                                                    "guidance_rescale"))
        layers = int(self.transformer_config["num_layers"])
        blocks = tuple(self.option(s, "stg_blocks"))
        perturbed = tuple(b for b in blocks if b < layers) if self.perturbed_attention else ()
        passes = Passes(cfg=g > 1 or ag > 1, stg_blocks=perturbed if stg > 0 else (), modality=mod > 1)
        values = {"cfg": g - 1, "audio_cfg": ag - 1, "stg": stg, "audio_stg": stg, "modality": mod - 1,
                  "audio_modality": mod - 1, "rescale": r, "rescale_keep": 1 - r, "audio_rescale": r,
                  "audio_rescale_keep": 1 - r}
        return passes, np.array([values[n] for n in COEFFICIENTS], dtype=np.float32)

    def uses_cfg(self, s: SampleSettings) -> bool:
        return self.guidance(s)[0].cfg  # the sound's guidance alone keeps the CFG batch

    def frame_rate(self, s: SampleSettings) -> float:
        return float(self.option(s, "frame_rate"))

    # --- stage 1: text -----------------------------------------------------------------------------------------
    def tokenize(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        tokenizer = self.component("tokenizer")
        out = tokenizer([t.strip() for t in texts], padding="max_length", max_length=TEXT_LEN, truncation=True,
                        add_special_tokens=True, return_tensors="pt")
        return out.input_ids, out.attention_mask

    def text_shape(self) -> tuple[int, ...]:
        return (1, TEXT_LEN, self.video_text_dim)

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
        latents, = self.run_stage(self.image_programs(height, width, num_frames),
                                  [self.put(pixels[:, :, None].to(self.dtype))])
        return ImageConditioning(latents.float(), height, width, num_frames, self.signature)

    # --- stage 2: sampling -------------------------------------------------------------------------------------
    def geometry(self, height: int, width: int, num_frames: int, frame_rate: float) -> Geometry:
        t, a = self.transformer_config, self.audio_vae_config
        return Geometry(frames=(num_frames - 1) // self.vae_scale_temporal + 1, height=height // self.vae_scale_spatial,
                        width=width // self.vae_scale_spatial, channels=int(t["in_channels"]),
                        audio_frames=audio_latent_frames(num_frames, frame_rate, a),
                        audio_channels=int(t["audio_in_channels"]))

    def latent_shape(self, height: int, width: int, num_frames: int) -> tuple[int, ...]:
        g = self.geometry(height, width, num_frames, float(SPEC.setting("frame_rate").default))
        return (1, g.channels, g.frames, g.height, g.width)

    def sampling_run(self, embeddings: TextEmbeddings, s: SampleSettings, cfg: bool,
                     image: ImageConditioning | None = None, latents: VideoLatents | None = None) -> SamplingRun:
        """The video and its sound denoised together from seeded noise. ``image``: image to video (the image
        encode's output for this size). ``latents``: refine these (the upsampler's output: diffusers' second
        stage) instead of starting from noise, with ``noise_scale`` of fresh noise (default: the schedule's first
        sigma). The random draws, in diffusers' order on the CPU generator: the video's noise, then the sound's."""
        passes, coefficients = self.guidance(s)
        if embeddings.audio_prompt_embeds is None:
            raise StageFileError("the text embeddings have no sound prompt stream: re-run the text encode stage with "
                                 "this LTX-2 model")
        if latents is None and s.options.get("noise_scale") is not None:
            raise InputError("noise_scale applies when sampling starts from given latents (the refine stage after "
                             "the upsampler): leave it unset")
        frame_rate = self.frame_rate(s)
        g = self.geometry(s.height, s.width, s.num_frames, frame_rate)
        if latents is not None:
            g = Geometry(g.frames, g.height, g.width, g.channels, int(latents.audio.shape[2]), g.audio_channels)
        steps_t, sigmas = timesteps(self.scheduler(), s.options.get("sigmas"), s.steps, g.frames * g.height * g.width)
        program = self.sample_program(g, passes, image=image is not None)
        generator = torch.Generator("cpu").manual_seed(int(s.seed))
        x, xa, keep = self._initial_latents(g, generator, image, latents, float(sigmas[0]), s.options.get("noise_scale"))
        spec = ("dp",) if cfg else ()
        video_text = self.cfg_batch(embeddings.prompt_embeds, embeddings.negative_prompt_embeds, cfg, spec)
        audio_text = self.cfg_batch(embeddings.audio_prompt_embeds, embeddings.negative_audio_prompt_embeds, cfg, spec)
        video_coords, audio_coords = positions(self.component("transformer"), g.frames, g.height, g.width,
                                               g.audio_frames, frame_rate)
        fixed = [self.put(t) for t in (torch.from_numpy(coefficients), video_coords, audio_coords)]
        keep_dev = self.put(keep) if keep is not None else None

        def arguments(i, carry):
            return (*carry, video_text, audio_text, self.put(torch.from_numpy(steps_t[i:i + 1].copy())),
                    self.put(torch.from_numpy(sigmas[i:i + 2].copy())), *fixed, keep_dev)

        def finish(carry):
            return self._final_latents(g, self.runtime.to_cpu(carry[0]).float(), self.runtime.to_cpu(carry[1]).float(),
                                       s)

        return SamplingRun(program, ["transformer"] * len(steps_t), (self.put(x), self.put(xa)), arguments, finish)

    def _initial_latents(self, g: Geometry, generator, image, latents, first_sigma: float, noise_scale):
        """The packed, normalised video and sound latents a sampling run starts from, and the mask of the video
        tokens held at the image (None without one)."""
        from diffusers import LTX2Pipeline
        from diffusers.utils.torch_utils import randn_tensor

        pack = LTX2Pipeline._pack_latents
        audio_mean, audio_std = self._audio_statistics()
        if latents is not None:  # the refine stage: normalised latents with fresh noise mixed in
            noise_scale = first_sigma if noise_scale is None else float(noise_scale)
            x = pack(LTX2Pipeline._normalize_latents(latents.latents.float(), *self._latent_statistics(),
                                                     float(self.vae_config.get("scaling_factor", 1.0))))
            x = LTX2Pipeline._create_noised_state(x, noise_scale, generator)
            xa = LTX2Pipeline._pack_audio_latents(latents.audio.float())
            xa = LTX2Pipeline._normalize_audio_latents(xa, audio_mean, audio_std)
            return x, LTX2Pipeline._create_noised_state(xa, noise_scale, generator), None
        shape = (1, g.channels, g.frames, g.height, g.width)
        noise = randn_tensor(shape, generator=generator, device=torch.device("cpu"), dtype=torch.float32)
        keep = None
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
        return x, xa, keep

    def _final_latents(self, g: Geometry, video: torch.Tensor, audio: torch.Tensor, s: SampleSettings) -> VideoLatents:
        """The sampled video and sound latents unpacked and de-normalised, as diffusers' ``output_type="latent"``
        returns them."""
        from diffusers import LTX2Pipeline

        audio_mean, audio_std = self._audio_statistics()
        video = LTX2Pipeline._denormalize_latents(LTX2Pipeline._unpack_latents(video, g.frames, g.height, g.width),
                                                  *self._latent_statistics(),
                                                  float(self.vae_config.get("scaling_factor", 1.0)))
        audio = LTX2Pipeline._unpack_audio_latents(LTX2Pipeline._denormalize_audio_latents(audio, audio_mean, audio_std),
                                                   g.audio_frames, num_mel_bins=int(self.audio_vae_config["mel_bins"]) // 4)
        return VideoLatents(video.contiguous(), s.height, s.width, s.num_frames, self.signature,
                            audio=audio.contiguous())

    def check_refine(self, latents: VideoLatents, s: SampleSettings, image) -> None:
        super().check_refine(latents, s, image)
        if latents.audio is None:
            raise StageFileError("the latents to refine have no sound latents: give the upsampler's output of an LTX-2 "
                                 "sampling run")

    # --- two stages: the latent upsampler ----------------------------------------------------------------------
    def upsample(self, latents: VideoLatents) -> VideoLatents:
        """The video latents at twice the width and height (the spatial latent upsampler), the sound's as they
        are: what the refine stage samples from."""
        self.check_made_here(latents)
        z = latents.latents
        if z.ndim != 5 or z.shape[1] != int(self.transformer_config["in_channels"]):
            raise StageFileError(f"latents have shape {tuple(z.shape)}; the LTX-2 upsampler takes video latents "
                                 f"[1, {self.transformer_config['in_channels']}, F, H/32, W/32]")
        out, = self.run_stage(self.upsample_programs(tuple(z.shape)), [self.put(z.float())])
        return VideoLatents(out.float().contiguous(), latents.height * 2, latents.width * 2, latents.num_frames,
                            self.signature, audio=latents.audio)

    # --- stage 3: decode ---------------------------------------------------------------------------------------
    def latent_channels(self) -> int:
        return int(self.vae_config["latent_channels"])

    def decode_audio(self, latents: VideoLatents) -> torch.Tensor:
        """The sound track ``[channels, samples]`` float32 at ``sample_rate`` from stage-2 latents."""
        self.check_made_here(latents)
        if latents.audio is None:
            raise StageFileError("the latents have no sound latents: sample them with an LTX-2 model")
        waveform, = self.run_stage(self.decode_audio_programs(tuple(latents.audio.shape)),
                                   [self.put(latents.audio.float())])
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
        self.component(component)
        value = self._states[component][name]
        if self.abstract:
            return torch.zeros(value.shape)
        return self.runtime.to_cpu(value).float()
