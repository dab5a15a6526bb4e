"""CogVideoX text- and image-to-video on JAX through torchax: load, encode text (and the first frame), sample,
decode.

The three stages match diffusers' ``CogVideoXPipeline`` number for number (same weights, prompt and seed give
the same frames), but each stage is one compiled program per shape:

- encode: the T5 encoder on ``[negative, positive]`` token ids, padded to the transformer's text length.
- sample: one program for a whole denoising step (CFG batch, transformer, guidance, scheduler update). Timestep,
  guidance scale and scheduler coefficients enter as arrays, computed on the host from diffusers' own scheduler,
  so N steps compile once and a new seed or prompt compiles nothing. Every random tensor is drawn on the CPU
  from one ``torch.Generator`` in the order diffusers draws it.
- decode: the diffusers VAE, chunked over latent frames exactly as diffusers chunks it (GroupNorm statistics span
  a chunk), without ``CogVideoXSafeConv3d``'s 2 GB splitting, which only exists for cuDNN.

Generations: 2b (sin-cos positions), 5b (RoPE, linspace grid), 1.5 (RoPE slice grid, ``patch_size_t=2``: an odd
latent frame count gets one extra latent frame in front, dropped before decode).

Image to video (``CogVideoXImageToVideoPipeline``: 5b-I2V, 1.5-I2V): the image encode stage runs the VAE encoder
on the first frame and returns its posterior (mean, std); sampling draws the image latent from it as the seed's
first draw, scales it, puts it in front of zero frames and concatenates it on channels at every step (1.5-I2V
also passes ``ofs``), exactly as diffusers' ``prepare_latents`` and denoising loop do.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Callable

import torch

from .attention import AttentionConfig
from .errors import InputError, ModelFolderError, StageFileError
from .family import (
    ImageConditioning,
    ModelFamily,
    StageProgram,
    forwards_replaced,
    SampleSettings,
    TextEmbeddings,
    VideoLatents,
    config_signature,
    frame_problem,
    jax_dtype,
    size_problems,
)
from .runtime import Runtime, tracing
from .schedulers import COGVIDEOX_COEFFS, cogvideox_plan
from .sharding import COGVIDEOX_TRANSFORMER_RULES, T5_ENCODER_RULES, VAE_RULES, MeshSpec

log = logging.getLogger(__name__)

FAMILY = "cogvideox"
COMPONENTS = ("scheduler", "text_encoder", "tokenizer", "transformer", "vae")
PIPELINES = ("CogVideoXPipeline", "CogVideoXImageToVideoPipeline")
SCHEDULERS = {"ddim": "CogVideoXDDIMScheduler", "dpm": "CogVideoXDPMScheduler"}
GROUP_NORMS = ("stock", "jnp_var")
I2V_15_NATIVE = (768, 1360, 81)
_WEIGHT_SUFFIXES = (".safetensors", ".bin")
_C_SAMPLE, _C_MODEL, _C_DIV, _A, _M1, _P, _Q, _D, _GUIDANCE = range(len(COGVIDEOX_COEFFS))


# --- model folder --------------------------------------------------------------------------------------------
def _has_weights(folder: Path) -> bool:
    return any(p.name.endswith(_WEIGHT_SUFFIXES) for p in folder.iterdir())


def inspect_model_folder(path: str | Path, weights: bool = True) -> dict:
    """Check that ``path`` is a complete diffusers CogVideoX text-to-video folder; return its model_index.
    ``weights=False``: only the configs are needed (planning compiles with the weights' shapes alone)."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ModelFolderError(
            f"model folder {folder} does not exist: pass the folder that holds model_index.json "
            "(e.g. a download of THUDM/CogVideoX-2b)"
        )
    index_file = folder / "model_index.json"
    if not index_file.is_file():
        raise ModelFolderError(
            f"{folder} is not a diffusers model folder: model_index.json is missing. Download the whole "
            "diffusers repository (model_index.json plus text_encoder, tokenizer, transformer, vae, scheduler)"
        )
    index = json.loads(index_file.read_text())
    cls = index.get("_class_name", "")
    if not cls.startswith("CogVideoX"):
        raise ModelFolderError(f"{folder} holds a {cls or 'unknown'} model, not CogVideoX: pick a CogVideoX folder")
    if cls not in PIPELINES:
        raise ModelFolderError(
            f"{folder} holds a {cls} model; this pack runs text-to-video (CogVideoXPipeline) and image-to-video "
            "(CogVideoXImageToVideoPipeline) models: use CogVideoX-2b/5b, CogVideoX1.5-5B, CogVideoX-5b-I2V or "
            "CogVideoX1.5-5B-I2V"
        )
    missing = []
    for name in COMPONENTS if weights else ("scheduler", "text_encoder", "transformer", "vae"):
        sub = folder / name
        if not sub.is_dir():
            missing.append(f"{name}/ (folder missing)")
        elif name in ("text_encoder", "transformer", "vae"):
            if not (sub / "config.json").is_file():
                missing.append(f"{name}/config.json")
            if weights and not _has_weights(sub):
                missing.append(f"{name}/*.safetensors (no weights)")
        elif name == "scheduler" and not (sub / "scheduler_config.json").is_file():
            missing.append("scheduler/scheduler_config.json")
        elif name == "tokenizer" and not any((sub / f).is_file() for f in ("tokenizer.json", "spiece.model")):
            missing.append("tokenizer/tokenizer.json or spiece.model")
    if missing:
        raise ModelFolderError(
            f"model folder {folder} is incomplete, missing: {', '.join(missing)}. Re-download those files "
            "from the model's diffusers repository"
        )
    return index


def resolve_model_path(model: str | Path) -> Path:
    """A local folder as is; ``org/name`` hub ids are downloaded when the machine can reach the hub."""
    path = Path(model).expanduser()
    if path.exists() or not isinstance(model, str) or model.count("/") != 1 or model.startswith((".", "/", "~")):
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model))
    except Exception as exc:  # noqa: BLE001 - any failure means: not reachable from here
        raise ModelFolderError(
            f"{model!r} is not a local folder and could not be downloaded from the model hub ({exc}). "
            "Download it on a machine with network access and pass the local folder"
        ) from exc


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


def model_signature(folder: Path) -> str:
    """A short hash of the component configs: stage files record it, so files from another model are refused."""
    return config_signature({name: json.loads((folder / name / "config.json").read_text())
                             for name in ("text_encoder", "transformer", "vae")})


# --- the family ----------------------------------------------------------------------------------------------
class CogVideoXFamily(ModelFamily):
    """A loaded CogVideoX model. Components load and move to the devices on first use, once."""

    FAMILY = FAMILY
    FAMILY_NAME = "CogVideoX"

    def __init__(self, path: str | Path, dtype: str = "auto", runtime: Runtime | None = None,
                 mesh: "str | dict | MeshSpec | None" = None, attention: "AttentionConfig | str | None" = None,
                 fsdp: bool = False, vae_sharding: str = "auto", target_devices=None):
        self.path = resolve_model_path(path)
        self.index = inspect_model_folder(self.path, weights=target_devices is None)
        self.transformer_config = json.loads((self.path / "transformer" / "config.json").read_text())
        self.vae_config = json.loads((self.path / "vae" / "config.json").read_text())
        self.generation = generation_of(self.transformer_config)
        self.signature = model_signature(self.path)
        self.text_len = int(self.transformer_config.get("max_text_seq_length", 226))
        self.vae_scale_spatial = 2 ** (len(self.vae_config["block_out_channels"]) - 1)
        self.vae_scale_temporal = int(self.vae_config.get("temporal_compression_ratio", 4))
        c = self.transformer_config
        # Image-to-video models take the image latents concatenated on channels: twice the output's channels.
        self.image_input = "required" if int(c["in_channels"]) == 2 * int(c["out_channels"]) else "none"
        self._setup(dtype, runtime, mesh, attention, fsdp, heads=self.transformer_config["num_attention_heads"],
                    vae_sharding=vae_sharding, target_devices=target_devices)

    # --- loading ---------------------------------------------------------------------------------------------
    def _load_component(self, name: str):
        if name == "tokenizer":
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(self.path / "tokenizer")
        if name == "text_encoder":
            from transformers import T5EncoderModel

            return T5EncoderModel.from_pretrained(self.path / "text_encoder", dtype=self.dtype).eval()
        if name == "transformer":
            from diffusers import CogVideoXTransformer3DModel

            part = CogVideoXTransformer3DModel.from_pretrained(self.path / "transformer", dtype=self.dtype).eval()
            part.set_attn_processor(CogVideoXFunctionalAttnProcessor())
            return part
        if name == "vae":
            from diffusers import AutoencoderKLCogVideoX

            return AutoencoderKLCogVideoX.from_pretrained(self.path / "vae", dtype=self.dtype).eval()
        raise KeyError(name)

    def _abstract_component(self, name: str) -> torch.nn.Module:
        if name == "text_encoder":
            from transformers import T5Config, T5EncoderModel

            build = lambda: T5EncoderModel(T5Config.from_pretrained(self.path / "text_encoder"))  # noqa: E731
        elif name == "transformer":
            from diffusers import CogVideoXTransformer3DModel

            build = lambda: CogVideoXTransformer3DModel.from_config(self.transformer_config)  # noqa: E731
        elif name == "vae":
            from diffusers import AutoencoderKLCogVideoX

            build = lambda: AutoencoderKLCogVideoX.from_config(self.vae_config)  # noqa: E731
        else:
            raise KeyError(name)
        from .weights import cast_meta_module

        part = cast_meta_module(build, self.dtype)
        if name == "transformer":
            part.set_attn_processor(CogVideoXFunctionalAttnProcessor())
        return part

    def _rules_for(self, name: str):
        return {"text_encoder": T5_ENCODER_RULES, "transformer": COGVIDEOX_TRANSFORMER_RULES}.get(name, VAE_RULES)

    def scheduler(self, name: str | None = None):
        """A fresh diffusers scheduler from the folder's config; ``name`` ("ddim"/"dpm") overrides its class."""
        import diffusers

        config_file = self.path / "scheduler" / "scheduler_config.json"
        config = json.loads(config_file.read_text())
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
        if problem:
            problems.append(problem)
        if problems:
            raise InputError("; ".join(problems))

    def validate_settings(self, s: SampleSettings) -> None:
        """Options of another family are refused, never silently ignored."""
        for name, value, fix in (("shift", s.shift, "flow shift is a Wan option"),
                                 ("guidance_2", s.guidance_2, "only two-expert Wan 2.2 models have a second guidance"),
                                 ("boundary", s.boundary, "only two-expert Wan 2.2 models have a boundary")):
            if value is not None:
                raise InputError(f"{name}={value} does not apply to CogVideoX ({fix}): leave it unset")
        if s.scheduler is not None and s.scheduler not in SCHEDULERS:
            raise InputError(f"scheduler {s.scheduler!r} is not one CogVideoX uses: pick one of {sorted(SCHEDULERS)}")
        self.lora_targets(s)

    # --- stage 1: text -----------------------------------------------------------------------------------------
    def tokenize(self, texts: list[str]) -> torch.Tensor:
        tokenizer = self._component("tokenizer")
        ids = tokenizer(
            texts, padding="max_length", max_length=self.text_len, truncation=True,
            add_special_tokens=True, return_tensors="pt",
        ).input_ids
        full = tokenizer(texts, padding="longest", return_tensors="pt").input_ids
        if full.shape[-1] > ids.shape[-1]:
            log.warning("prompt longer than %d tokens was truncated", self.text_len)
        return ids

    def encode(self, prompt: str, negative_prompt: str = "") -> TextEmbeddings:
        if not isinstance(prompt, str) or not prompt.strip():
            raise InputError("prompt is empty: describe the video you want")
        negative_prompt = negative_prompt or ""
        ids = self.tokenize([negative_prompt, prompt])
        program = self.encode_program()
        executable = self.compile_stage(program)
        ids_dev = self.put(ids.to(torch.int32))
        start = time.perf_counter()
        embeds = self.runtime.to_cpu(executable(program.example[0], ids_dev))
        self._record_run("encode", start)
        return TextEmbeddings(embeds[1:2], embeds[0:1], prompt, negative_prompt, self.signature)

    def encode_program(self) -> StageProgram:
        """T5 over token ids ``[negative, positive]`` padded to the transformer's text length."""
        self._component("text_encoder")
        encoder_fn = self.runtime.module_function(self._parts["text_encoder"])
        dtype = jax_dtype(self.dtype)

        def encode_fn(state, ids):
            return encoder_fn(state, ids)[0].astype(dtype)

        shape = (2, self.text_len)
        return StageProgram("encode", encode_fn, (self._states["text_encoder"], self.arg(shape, torch.int32)),
                            (self.dtype_name, shape), f"T5 text encoder for {self.text_len} tokens", self.traced,
                            ("text_encoder",))

    # --- stage 1b: the image (image-to-video) ---------------------------------------------------------------
    def encode_image(self, image, last_image=None, *, height: int, width: int, num_frames: int) -> ImageConditioning:
        """The VAE posterior of the first frame ``image`` (a file, a PIL image or a ComfyUI IMAGE) resized to
        ``height`` x ``width``; sampling draws from it. One compiled program per size."""
        from .images import video_image

        self.check_images(image is not None, last_image is not None)
        self.validate(height, width, num_frames)
        pixels = video_image(image, height, width)[:, :, None]  # [1, 3, 1, H, W]
        program = self.image_program(height, width)
        executable = self.compile_stage(program)
        start = time.perf_counter()
        mean, std = self.runtime.to_cpu(executable(program.example[0], self.put(pixels.to(self.dtype))))
        self._record_run("image", start)
        return ImageConditioning(mean, height, width, num_frames, self.signature, latents_std=std)

    def image_program(self, height: int, width: int) -> StageProgram:
        """The VAE encoder over one frame ``[1, 3, 1, H, W]``: the posterior's mean and std ``[1, C, 1, h, w]``."""
        vae = self._component("vae")
        vae.use_tiling = False

        def posterior(module, pixels):
            dist = module.encode(pixels).latent_dist
            return dist.mean, dist.std

        encode_fn = self.runtime.module_function(vae, posterior)

        @contextlib.contextmanager
        def scope():
            with self.traced(), _vae_for_xla(vae, "stock"):
                yield

        example = (self._states["vae"], self.arg((1, 3, 1, height, width), self.dtype))
        return StageProgram("image", encode_fn, example, (self.dtype_name, height, width),
                            f"VAE encode of the first frame at {width}x{height}", scope, ("vae",))

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

    def sample(
        self,
        embeddings: TextEmbeddings,
        settings: SampleSettings,
        on_step: Callable[[int, int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        image: ImageConditioning | None = None,
    ) -> VideoLatents:
        """Denoise from seeded noise; ``on_step(i, total)`` after each step, ``should_stop()`` before each.
        Image-to-video models take the first frame's ``image`` encoding."""
        s = settings
        self.validate(s.height, s.width, s.num_frames)
        self.validate_settings(s)
        self.check_conditioning(image, s)
        self.check_steps(s.steps)
        self.check_embeddings(embeddings, (1, self.text_len, int(self.transformer_config["text_embed_dim"])))
        scheduler = self.scheduler(s.scheduler)
        stochastic = type(scheduler).__name__ == SCHEDULERS["dpm"]
        cfg = s.guidance > 1.0
        self.check_cfg_mesh(cfg)
        self.apply_loras(self.lora_targets(s))  # before compiling: a LoRA that does not fit is refused first
        shape, pad = self.latent_shape(s.height, s.width, s.num_frames)
        program = self.sample_program(s.height, s.width, s.num_frames, cfg)
        executable = self.compile_stage(program)
        state = program.example[0]

        # Random draws, on CPU, in diffusers' order: (image-to-video) the image's posterior sample, the initial
        # noise, then (DPM) the noise of every step.
        generator = torch.Generator("cpu").manual_seed(int(s.seed))
        from diffusers.utils.torch_utils import randn_tensor

        image_dev = None if image is None else self.put(self._image_latents(image, shape, generator))
        latents = randn_tensor(shape, generator=generator, device=torch.device("cpu"), dtype=self.dtype)
        latents = latents * scheduler.init_noise_sigma
        scheduler.set_timesteps(s.steps, device="cpu")
        timesteps = scheduler.timesteps
        plan = cogvideox_plan(scheduler, timesteps, s.guidance, s.dynamic_cfg, dpm=stochastic)

        put = self.put
        embeds = torch.cat([embeddings.negative_prompt_embeds, embeddings.prompt_embeds]) if cfg \
            else embeddings.prompt_embeds
        embeds_dev = put(embeds.to(self.dtype), ("dp",))
        rope = self._rotary_embeddings(s.height, s.width, shape[1])
        rope_dev = put(rope) if rope is not None else None
        latents_dev = put(latents)
        noise_zero = put(torch.zeros(shape, dtype=self.dtype))  # DDIM adds no noise (its coefficient D is 0)
        old_x0 = put(torch.zeros(shape, dtype=torch.float32))  # no previous x0 before the first step (Q is 0)
        carry = {"latents": latents_dev, "old_x0": old_x0}
        ofs_dev = self.put(torch.full((1,), 2.0, dtype=self.dtype)) if self._has_ofs() else None  # diffusers' ofs

        def step(i):
            noise = noise_zero
            if stochastic:
                noise = randn_tensor(shape, generator=generator, device=torch.device("cpu"), dtype=self.dtype)
                if plan.second_draw[i]:
                    noise = randn_tensor(shape, generator=generator, device=torch.device("cpu"), dtype=self.dtype)
                noise = put(noise)
            carry["latents"], carry["old_x0"] = executable(
                state, carry["latents"], embeds_dev, put(torch.tensor([int(timesteps[i])], dtype=torch.int32)),
                put(torch.from_numpy(plan.coeffs[i])), noise, carry["old_x0"], rope_dev, image_dev, ofs_dev,
            )
            return carry["latents"]

        self.run_steps(len(timesteps), step, on_step, should_stop)
        start = time.perf_counter()
        latents_dev = carry["latents"]
        result = self.runtime.to_cpu(latents_dev)
        self._record_run("sample", start)
        result = result[:, pad:].permute(0, 2, 1, 3, 4).float().contiguous()
        return VideoLatents(result, s.height, s.width, s.num_frames, self.signature)

    def _has_ofs(self) -> bool:
        return self.transformer_config.get("ofs_embed_dim") is not None

    def sample_program(self, height: int, width: int, num_frames: int, cfg: bool) -> StageProgram:
        """One denoising step: CFG batch, transformer, guidance and the scheduler update, coefficients as arrays.
        Image-to-video: the image latents concatenated on channels (and CogVideoX1.5's ``ofs``)."""
        import jax
        import jax.numpy as jnp

        shape, _ = self.latent_shape(height, width, num_frames)
        self._component("transformer")
        transformer_fn = self.runtime.module_function(self._parts["transformer"])
        model_dtype = jax_dtype(self.dtype)
        batch_sharding = self.runtime.sharding(self.mesh, ("dp",))
        replicated = self.runtime.sharding(self.mesh)

        def step_fn(state, latents, embeds, timestep, coeffs, noise, old_x0, rope, image_latents, ofs):
            x = latents if image_latents is None else jnp.concatenate([latents, image_latents], axis=2)
            x = jnp.concatenate([x, x]) if cfg else x
            x = jax.lax.with_sharding_constraint(x, batch_sharding)  # CFG's two halves on dp
            t = jnp.broadcast_to(timestep, (x.shape[0],))
            out = transformer_fn(state, x, embeds, t, ofs=ofs, image_rotary_emb=rope, return_dict=False)[0]
            out = out.astype(jnp.float32)
            if cfg:
                uncond, text = jnp.split(out, 2)
                out = uncond + coeffs[_GUIDANCE] * (text - uncond)
            x0 = (coeffs[_C_SAMPLE] * latents - coeffs[_C_MODEL] * out) / coeffs[_C_DIV]
            prev = coeffs[_A] * latents - coeffs[_M1] * (coeffs[_P] * x0 - coeffs[_Q] * old_x0)
            prev = prev + coeffs[_D] * noise
            # Outputs come back as the next step's inputs: keep them where the inputs are (replicated).
            return (jax.lax.with_sharding_constraint(prev.astype(model_dtype), replicated),
                    jax.lax.with_sharding_constraint(x0, replicated))

        embeds_shape = (2 if cfg else 1, self.text_len, int(self.transformer_config["text_embed_dim"]))
        rope = self._rotary_embeddings(height, width, shape[1])
        arg = self.arg
        example = (self._states["transformer"], arg(shape, self.dtype), arg(embeds_shape, self.dtype, ("dp",)),
                   arg((1,), torch.int32), arg((len(COGVIDEOX_COEFFS),), torch.float32), arg(shape, self.dtype),
                   arg(shape, torch.float32), tuple(arg(t.shape, t.dtype) for t in rope) if rope else None,
                   arg(shape, self.dtype) if self.image_input != "none" else None,
                   arg((1,), self.dtype) if self._has_ofs() else None)
        key = (self.generation, self.dtype_name, cfg, shape, embeds_shape, self.image_input, self.attention)
        return StageProgram("sample", step_fn, example, key,
                            f"sampler step for {num_frames}x{height}x{width} ({'CFG batch 2' if cfg else 'no CFG'},"
                            f" mesh {self.mesh_spec}, {self.attention.impl} attention)", self.traced,
                            ("transformer",))

    def plan_programs(self, s: SampleSettings) -> list[StageProgram]:
        """Every program one generation with settings ``s`` runs, for ``plan`` to compile."""
        self.validate(s.height, s.width, s.num_frames)
        self.validate_settings(s)
        cfg = s.guidance > 1.0
        self.check_cfg_mesh(cfg)
        shape, pad = self.latent_shape(s.height, s.width, s.num_frames)
        z_shape = (1, int(self.vae_config["latent_channels"]), shape[1] - pad, shape[3], shape[4])
        image = [self.image_program(s.height, s.width)] if self.image_input != "none" else []
        return [self.encode_program(), *image, self.sample_program(s.height, s.width, s.num_frames, cfg),
                *self.decode_programs(z_shape)]

    # --- stage 3: decode ---------------------------------------------------------------------------------------
    #: How diffusers' batched decode runs (``vae._decode``: two latent frames at a time, the first batch taking the
    #: odd frame too, the causal convolutions' caches carried from batch to batch). "batches" (the default): two
    #: programs, the first two batches (after them every cache has its steady shape) and one later batch, called
    #: once per batch with the caches kept on the devices: a compile that does not grow with the frame count and
    #: memory bounded by a batch. "unrolled": one program holding a copy of the decoder per batch. VAE tiling
    #: (diffusers' tiled decode, its own loop over tiles and batches) is always one program.
    decode_loop = "batches"

    def decode(self, latents: VideoLatents, tiling: bool = False, group_norm: str = "stock") -> torch.Tensor:
        """Frames ``[F, H, W, 3]`` float32 in 0..1 from stage-2 latents."""
        if group_norm not in GROUP_NORMS:
            raise InputError(f"group_norm must be one of {GROUP_NORMS}, got {group_norm!r}")
        self.check_made_here(latents)
        z = latents.latents
        channels = int(self.vae_config["latent_channels"])
        if z.ndim != 5 or z.shape[0] != 1 or z.shape[1] != channels:
            raise StageFileError(
                f"latents have shape {tuple(z.shape)}; this model's VAE decodes [1, {channels}, T, H/8, W/8]"
            )
        programs = self.decode_programs(tuple(z.shape), tiling, group_norm)
        executables = [self.compile_stage(p) for p in programs]
        state = programs[0].example[0]
        z_dev = self.put(z.to(self.dtype), self._vae_input_spec(z.shape))
        start = time.perf_counter()
        if len(programs) == 1:
            frames = self.runtime.to_cpu(executables[0](state, z_dev))
        else:  # the first two batches, then one call per later batch, the causal caches kept on the devices
            z_dev, first, caches = executables[0](state, z_dev)
            parts = [self.runtime.to_cpu(first)]
            for begin in self._later_batches(z.shape[2]):
                out, caches = executables[1](state, z_dev, self.put(torch.tensor(begin, dtype=torch.int32)), caches)
                parts.append(self.runtime.to_cpu(out))
            frames = torch.cat(parts)
        self._record_run("decode", start)
        return frames

    def _batch_starts(self, latent_frames: int) -> list[int]:
        """Where each latent batch starts: diffusers' ``_decode`` takes ``num_latent_frames_batch_size`` frames a
        batch, and the first batch takes the remainder as well."""
        size = int(self._component("vae").num_latent_frames_batch_size)
        batches, rest = max(latent_frames // size, 1), latent_frames % size
        return [0] + [size * i + rest for i in range(1, batches)]

    def _later_batches(self, latent_frames: int) -> list[int]:
        """Where each batch after the first two starts (the later-batch program's calls)."""
        return self._batch_starts(latent_frames)[2:]

    def decode_programs(self, z_shape: tuple[int, ...], tiling: bool = False,
                        group_norm: str = "stock") -> list[StageProgram]:
        """The programs that decode latents ``[1, C, T, h, w]`` to frames ``[F, H, W, 3]`` in 0..1: one program
        (tiling, ``decode_loop = "unrolled"`` or up to two batches), or the first two batches' program and the later
        batches' program (``decode_loop``)."""
        import jax
        import jax.numpy as jnp

        if self.decode_loop not in ("unrolled", "batches"):
            raise InputError(f"decode_loop {self.decode_loop!r} is not one of batches, unrolled")
        vae = self._component("vae")
        vae.use_tiling = bool(tiling)
        scaling = float(self.vae_config.get("scaling_factor", 1.15258426))
        frames = (z_shape[2] - 1) * self.vae_scale_temporal + 1
        height, width = z_shape[3] * self.vae_scale_spatial, z_shape[4] * self.vae_scale_spatial
        what = f"VAE decode for {frames}x{height}x{width}"
        example = (self._states["vae"], self.arg(z_shape, self.dtype, self._vae_input_spec(z_shape)))
        key = (self.dtype_name, tuple(z_shape), bool(tiling), group_norm, self.vae_sharding)

        @contextlib.contextmanager
        def scope():
            with self.traced(), _vae_for_xla(vae, group_norm):
                yield

        def to_frames(video):  # [1, 3, F, H, W] in -1..1 -> [F, H, W, 3] in 0..1
            video = jnp.clip(video * 0.5 + 0.5, 0.0, 1.0)
            return jnp.transpose(video[0], (1, 2, 3, 0)).astype(jnp.float32)

        starts = self._batch_starts(z_shape[2])
        if tiling or self.decode_loop == "unrolled" or len(starts) <= 2:
            decode_fn = self.runtime.module_function(vae, "decode")

            def frames_fn(state, z):
                return to_frames(decode_fn(state, (1 / scaling) * z, return_dict=False)[0])

            return [StageProgram("decode", frames_fn, example, key, what, scope, ("vae",))]

        batch = self.runtime.module_function(vae, _decode_batch)
        keep, placed = self._vae_placement()
        size = int(vae.num_latent_frames_batch_size)
        bounds = list(zip(starts[:2], (starts + [z_shape[2]])[1:3]))  # the first two batches

        def start_fn(state, z):
            z = (1 / scaling) * z
            outs, caches = [], None
            for begin, end in bounds:
                out, caches = batch(state, z[:, :, begin:end], caches)
                outs.append(out)
            return keep(z), to_frames(jnp.concatenate(outs, axis=2)), jax.tree_util.tree_map(keep, caches)

        first = StageProgram("decode", start_fn, example, key + ("start",), f"{what}: the first two latent batches",
                             scope, ("vae",), part="start")
        with scope(), tracing():
            z_struct, _, cache_structs = jax.eval_shape(start_fn, *example)

        def batch_fn(state, z, begin, caches):
            out, caches = batch(state, jax.lax.dynamic_slice_in_dim(z, begin, size, axis=2), caches)
            return to_frames(out), jax.tree_util.tree_map(keep, caches)

        batch_example = (self._states["vae"], placed(z_struct), self.arg((), torch.int32),
                         jax.tree_util.tree_map(placed, cache_structs))
        return [first, StageProgram("decode", batch_fn, batch_example, key + ("batch",),
                                    f"{what}: each later batch of {size} latent frames", scope, ("vae",),
                                    part="batch")]


def _decode_batch(module, z, conv_cache):
    """One batch of diffusers' ``AutoencoderKLCogVideoX._decode`` loop: latents (already divided by the scaling
    factor) to pixels in -1..1, with the causal convolutions' caches in and out (``None`` before the first)."""
    if module.post_quant_conv is not None:
        z = module.post_quant_conv(z)
    return module.decoder(z, conv_cache=conv_cache)


# --- transformer attention -------------------------------------------------------------------------------------
class CogVideoXFunctionalAttnProcessor:
    """CogVideoX joint text+video attention, as diffusers' CogVideoXAttnProcessor2_0 computes it, but with RoPE
    applied by concatenation instead of writing into a slice of q/k in place.

    Why: XLA:CPU (jaxlib 0.10.2) miscompiles the in-place form (a scatter or dynamic-update-slice into the
    layer-normed, head-transposed q) followed by attention at batch 1, i.e. sampling without CFG: errors of
    order 1 while the same program run op by op is exact. The concatenated form is exact and, on TPU, avoids an
    in-place update of a large activation.
    """

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
        import torch.nn.functional as F
        from diffusers.models.embeddings import apply_rotary_emb

        text_len = encoder_hidden_states.size(1)
        x = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        batch, length, _ = x.shape
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, length, batch)
            attention_mask = attention_mask.view(batch, attn.heads, -1, attention_mask.shape[-1])
        q, k, v = attn.to_q(x), attn.to_k(x), attn.to_v(x)
        head_dim = k.shape[-1] // attn.heads
        q, k, v = (t.view(batch, -1, attn.heads, head_dim).transpose(1, 2) for t in (q, k, v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if image_rotary_emb is not None:
            q = torch.cat([q[:, :, :text_len], apply_rotary_emb(q[:, :, text_len:], image_rotary_emb)], dim=2)
            if not attn.is_cross_attention:
                k = torch.cat([k[:, :, :text_len], apply_rotary_emb(k[:, :, text_len:], image_rotary_emb)], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim)
        out = attn.to_out[1](attn.to_out[0](out))
        return out[:, text_len:], out[:, :text_len]


# --- VAE adjustments for XLA -----------------------------------------------------------------------------------
def _vae_for_xla(vae: torch.nn.Module, group_norm: str):
    """While tracing the VAE: plain Conv3d instead of CogVideoXSafeConv3d's cuDNN splitting, and optionally a
    vectorised ``jnp.var`` GroupNorm instead of torchax's stock lowering."""
    from diffusers.models.autoencoders.autoencoder_kl_cogvideox import CogVideoXSafeConv3d

    def replacement(module):
        if isinstance(module, CogVideoXSafeConv3d):
            return torch.nn.Conv3d.forward.__get__(module)
        if isinstance(module, torch.nn.GroupNorm) and group_norm == "jnp_var":
            return _var_group_norm_forward(module)
        return None

    return forwards_replaced(vae, replacement)


def group_norm_jnp_var(x, weight, bias, groups: int, eps: float):
    """GroupNorm over ``[B, C, ...]`` as one vectorised ``jnp.mean``/``jnp.var`` reduction (seed 000's form)."""
    import jax.numpy as jnp

    b, c = x.shape[:2]
    grouped = x.reshape((b, groups, -1))
    mean = jnp.mean(grouped, axis=-1, keepdims=True)
    var = jnp.var(grouped, axis=-1, keepdims=True)
    out = ((grouped - mean) / jnp.sqrt(var + eps)).reshape(x.shape)
    affine = (1, c) + (1,) * (x.ndim - 2)
    if weight is not None:
        out = out * weight.reshape(affine)
    if bias is not None:
        out = out + bias.reshape(affine)
    return out


def _var_group_norm_forward(module: torch.nn.GroupNorm):
    from torchax.interop import call_jax

    def forward(x):
        return call_jax(group_norm_jnp_var, x, module.weight, module.bias, module.num_groups, module.eps)

    return forward
