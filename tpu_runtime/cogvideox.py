"""CogVideoX text-to-video on JAX through torchax: load, encode text, sample, decode.

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
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .attention import AttentionConfig, attention_scope
from .errors import InputError, Interrupted, ModelFolderError, StageFileError
from .runtime import Runtime, get_runtime
from .sharding import (
    COGVIDEOX_TRANSFORMER_RULES,
    T5_ENCODER_RULES,
    VAE_RULES,
    MeshSpec,
    default_mesh,
    parse_mesh,
    validate_mesh,
)

log = logging.getLogger(__name__)

FAMILY = "cogvideox"
COMPONENTS = ("scheduler", "text_encoder", "tokenizer", "transformer", "vae")
SCHEDULERS = {"ddim": "CogVideoXDDIMScheduler", "dpm": "CogVideoXDPMScheduler"}
GROUP_NORMS = ("stock", "jnp_var")
VAE_SHARDINGS = ("replicated", "width")  # width: split the decode's frame width over all devices (seeds 000/001)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_WEIGHT_SUFFIXES = (".safetensors", ".bin")


# --- values passed between stages ----------------------------------------------------------------------------
@dataclass
class TextEmbeddings:
    """Stage 1 output: T5 embeddings for the prompt and the negative prompt, CPU tensors ``[1, L, D]``."""

    prompt_embeds: torch.Tensor
    negative_prompt_embeds: torch.Tensor
    prompt: str
    negative_prompt: str
    model_signature: str


@dataclass
class VideoLatents:
    """Stage 2 output: denoised latents ``[B, C, T, H/8, W/8]`` float32 on CPU, before VAE scaling."""

    latents: torch.Tensor
    height: int
    width: int
    num_frames: int
    model_signature: str


@dataclass
class SampleSettings:
    height: int
    width: int
    num_frames: int
    steps: int = 50
    guidance: float = 6.0
    seed: int = 0
    scheduler: str | None = None  # "ddim" | "dpm" | None: the model folder's own
    dynamic_cfg: bool = False


@dataclass
class StageTimings:
    """Seconds spent per stage, split into compile and run, and how many XLA programs each compiled."""

    load: float = 0.0
    compile: dict[str, float] = field(default_factory=dict)
    run: dict[str, float] = field(default_factory=dict)
    compiles: dict[str, int] = field(default_factory=dict)
    cache_hits: dict[str, int] = field(default_factory=dict)
    programs: dict[str, object] = field(default_factory=dict)  # each stage's latest CompiledProgram (time, memory)


# --- model folder --------------------------------------------------------------------------------------------
def _has_weights(folder: Path) -> bool:
    return any(p.name.endswith(_WEIGHT_SUFFIXES) for p in folder.iterdir())


def inspect_model_folder(path: str | Path) -> dict:
    """Check that ``path`` is a complete diffusers CogVideoX text-to-video folder; return its model_index."""
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
    if cls != "CogVideoXPipeline":
        raise ModelFolderError(
            f"{folder} holds a {cls} (image/video-to-video) model; only text-to-video CogVideoXPipeline models are "
            "supported so far: use CogVideoX-2b, CogVideoX-5b or CogVideoX1.5-5B"
        )
    missing = []
    for name in COMPONENTS:
        sub = folder / name
        if not sub.is_dir():
            missing.append(f"{name}/ (folder missing)")
        elif name in ("text_encoder", "transformer", "vae"):
            if not (sub / "config.json").is_file():
                missing.append(f"{name}/config.json")
            if not _has_weights(sub):
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
    h = hashlib.sha256()
    for name in ("text_encoder", "transformer", "vae"):
        config = json.loads((folder / name / "config.json").read_text())
        config = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("torch_dtype", "dtype")}
        h.update(name.encode() + json.dumps(config, sort_keys=True).encode())
    return h.hexdigest()[:16]


# --- the family ----------------------------------------------------------------------------------------------
class CogVideoXFamily:
    """A loaded CogVideoX model. Components load and move to the devices on first use, once."""

    def __init__(self, path: str | Path, dtype: str = "auto", runtime: Runtime | None = None,
                 mesh: "str | dict | MeshSpec | None" = None, attention: "AttentionConfig | str | None" = None,
                 fsdp: bool = False, vae_sharding: str = "replicated"):
        self.path = resolve_model_path(path)
        self.index = inspect_model_folder(self.path)
        self.runtime = runtime or get_runtime()
        if dtype == "auto":
            dtype = "float32" if self.runtime.backend == "cpu" else "bfloat16"
        if dtype not in DTYPES:
            raise InputError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
        self.dtype_name = dtype
        self.dtype = DTYPES[dtype]
        self.transformer_config = json.loads((self.path / "transformer" / "config.json").read_text())
        self.vae_config = json.loads((self.path / "vae" / "config.json").read_text())
        self.generation = generation_of(self.transformer_config)
        self.signature = model_signature(self.path)
        self.text_len = int(self.transformer_config.get("max_text_seq_length", 226))
        self.vae_scale_spatial = 2 ** (len(self.vae_config["block_out_channels"]) - 1)
        self.vae_scale_temporal = int(self.vae_config.get("temporal_compression_ratio", 4))
        self.heads = int(self.transformer_config["num_attention_heads"])
        devices = len(self.runtime.devices)
        self.mesh_spec = parse_mesh(mesh) or default_mesh(devices, self.heads)
        validate_mesh(self.mesh_spec, devices, self.heads)
        self.mesh = self.runtime.make_mesh(self.mesh_spec)
        if isinstance(attention, str) or attention is None:
            attention = AttentionConfig(impl=attention or "auto")
        self.attention = attention.resolve(self.runtime.backend)
        self.fsdp = bool(fsdp)
        if vae_sharding not in VAE_SHARDINGS:
            raise InputError(f"vae_sharding must be one of {VAE_SHARDINGS}, got {vae_sharding!r}")
        self.vae_sharding = vae_sharding
        self.timings = StageTimings()
        self._parts: dict[str, object] = {}
        self._states: dict[str, dict] = {}

    # --- loading ---------------------------------------------------------------------------------------------
    def _component(self, name: str):
        if name in self._parts:
            return self._parts[name]
        start = time.perf_counter()
        if name == "tokenizer":
            from transformers import AutoTokenizer

            part = AutoTokenizer.from_pretrained(self.path / "tokenizer")
        elif name == "text_encoder":
            from transformers import T5EncoderModel

            part = T5EncoderModel.from_pretrained(self.path / "text_encoder", dtype=self.dtype).eval()
        elif name == "transformer":
            from diffusers import CogVideoXTransformer3DModel

            part = CogVideoXTransformer3DModel.from_pretrained(self.path / "transformer", dtype=self.dtype).eval()
            part.set_attn_processor(CogVideoXFunctionalAttnProcessor())
        elif name == "vae":
            from diffusers import AutoencoderKLCogVideoX

            part = AutoencoderKLCogVideoX.from_pretrained(self.path / "vae", dtype=self.dtype).eval()
        else:
            raise KeyError(name)
        if isinstance(part, torch.nn.Module):
            part.requires_grad_(False)
            rules = {"text_encoder": T5_ENCODER_RULES, "transformer": COGVIDEOX_TRANSFORMER_RULES}.get(name, VAE_RULES)
            self._states[name] = self.runtime.module_state(part, self.mesh, rules, fsdp=self.fsdp)
            # The device copy is the one used from now on; free the host copy (real models are many GB).
            part.to("meta")
        self._parts[name] = part
        self.timings.load += time.perf_counter() - start
        log.info("loaded %s/%s in %.1f s", self.path.name, name, time.perf_counter() - start)
        return part

    def scheduler(self, name: str | None = None):
        """A fresh diffusers scheduler from the folder's config; ``name`` ("ddim"/"dpm") overrides its class."""
        import diffusers

        config_file = self.path / "scheduler" / "scheduler_config.json"
        config = json.loads(config_file.read_text())
        cls_name = config.get("_class_name", SCHEDULERS["ddim"])
        if name is not None:
            if name not in SCHEDULERS:
                raise InputError(f"scheduler must be one of {sorted(SCHEDULERS)}, got {name!r}")
            cls_name = SCHEDULERS[name]
        if cls_name not in SCHEDULERS.values():
            raise ModelFolderError(
                f"{config_file} names {cls_name}; supported schedulers are {sorted(SCHEDULERS.values())}: "
                "pick one with scheduler='ddim' or 'dpm'"
            )
        return getattr(diffusers, cls_name).from_config(config)

    def release(self) -> None:
        """Drop the device copies of the weights (ComfyUI's 'unload models')."""
        self._states.clear()
        self._parts.clear()

    # --- validation ------------------------------------------------------------------------------------------
    def validate(self, height: int, width: int, num_frames: int) -> None:
        """Raise ``InputError`` for sizes this model cannot take, before anything compiles."""
        problems = []
        for name, value in (("height", height), ("width", width)):
            if not isinstance(value, int) or value <= 0 or value % 16:
                fixed = max(16, int(round(value / 16)) * 16) if isinstance(value, (int, float)) else 16
                problems.append(f"{name}={value} must be a positive multiple of 16 (e.g. {fixed})")
        if self.transformer_config.get("patch_size_t") and not problems:
            # 1.5's RoPE grid is sliced out of one built for the training size: larger frames have no positions.
            max_h = self.transformer_config["sample_height"] * self.vae_scale_spatial
            max_w = self.transformer_config["sample_width"] * self.vae_scale_spatial
            if height > max_h or width > max_w:
                problems.append(f"height x width = {height}x{width} exceeds the {max_h}x{max_w} this "
                                f"CogVideoX-{self.generation} model has positions for: use at most {max_h}x{max_w}")
        rule = frame_rule(self.generation)
        if not isinstance(num_frames, int) or num_frames < 1 or (num_frames - 1) % rule:
            k = max(0, round((num_frames - 1) / rule)) if isinstance(num_frames, (int, float)) else 0
            native = 81 if self.generation == "1.5" else 49
            problems.append(
                f"frames={num_frames} must be {rule}*N+1 for CogVideoX-{self.generation} "
                f"(e.g. {k * rule + 1} or {native}, the native length)"
            )
        if problems:
            raise InputError("; ".join(problems))

    def check_made_here(self, value: "TextEmbeddings | VideoLatents") -> None:
        """Refuse embeddings or latents that a model of another architecture made."""
        if value.model_signature == self.signature:
            return
        if isinstance(value, TextEmbeddings):
            raise StageFileError("the text embeddings were made by a different model than the one sampling: "
                                 "re-run the text encode stage with this model")
        raise StageFileError("the latents were sampled by a different model than the one decoding: decode with "
                             "the model that sampled them, or re-run sampling")

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
        self._component("text_encoder")
        encoder_fn = self.runtime.module_function(self._parts["text_encoder"])
        state = self._states["text_encoder"]
        dtype = self.dtype

        def encode_fn(state, ids):
            return encoder_fn(state, ids)[0].astype(_jax_dtype(dtype))

        ids_dev = self.runtime.put(ids.to(torch.int32), self.runtime.sharding(self.mesh))
        program = self._compile("encode", encode_fn, (self.dtype_name, tuple(ids.shape)), state, ids_dev,
                                describe=f"T5 text encoder for {ids.shape[1]} tokens")
        start = time.perf_counter()
        embeds = self.runtime.to_cpu(program(state, ids_dev))
        self._record_run("encode", start)
        return TextEmbeddings(embeds[1:2], embeds[0:1], prompt, negative_prompt, self.signature)

    # --- stage 2: sampling -------------------------------------------------------------------------------------
    def latent_shape(self, height: int, width: int, num_frames: int) -> tuple[tuple[int, ...], int]:
        """Shape ``[B, T, C, h, w]`` of the latents the sampler works on, and how many padding frames lead it."""
        frames = (num_frames - 1) // self.vae_scale_temporal + 1
        pad = 0
        p_t = self.transformer_config.get("patch_size_t")
        if p_t and frames % p_t:
            pad = p_t - frames % p_t
        channels = int(self.transformer_config["in_channels"])
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
    ) -> VideoLatents:
        """Denoise from seeded noise; ``on_step(i, total)`` after each step, ``should_stop()`` before each."""
        import jax
        import jax.numpy as jnp

        s = settings
        self.validate(s.height, s.width, s.num_frames)
        if not isinstance(s.steps, int) or s.steps < 1:
            raise InputError(f"steps={s.steps} must be a positive whole number (50 is the usual choice)")
        self.check_made_here(embeddings)
        expected = (1, self.text_len, int(self.transformer_config["text_embed_dim"]))
        if tuple(embeddings.prompt_embeds.shape) != expected:
            raise StageFileError(
                f"text embeddings have shape {tuple(embeddings.prompt_embeds.shape)}, this model takes {expected}: "
                "re-run the text encode stage with this model"
            )
        scheduler = self.scheduler(s.scheduler)
        stochastic = type(scheduler).__name__ == SCHEDULERS["dpm"]
        cfg = s.guidance > 1.0
        validate_mesh(self.mesh_spec, len(self.runtime.devices), self.heads, batch=2 if cfg else 1)
        shape, pad = self.latent_shape(s.height, s.width, s.num_frames)

        # Random draws, on CPU, in diffusers' order: the initial noise, then (DPM) the noise of every step.
        generator = torch.Generator("cpu").manual_seed(int(s.seed))
        from diffusers.utils.torch_utils import randn_tensor

        latents = randn_tensor(shape, generator=generator, device=torch.device("cpu"), dtype=self.dtype)
        latents = latents * scheduler.init_noise_sigma
        scheduler.set_timesteps(s.steps, device="cpu")
        timesteps = scheduler.timesteps
        plan = step_coefficients(scheduler, timesteps, s.guidance, s.dynamic_cfg)

        self._component("transformer")
        transformer_fn = self.runtime.module_function(self._parts["transformer"])
        state = self._states["transformer"]
        model_dtype = _jax_dtype(self.dtype)

        batch_sharding = self.runtime.sharding(self.mesh, ("dp",))
        replicated = self.runtime.sharding(self.mesh)

        def step_fn(state, latents, embeds, timestep, coeffs, noise, old_x0, rope):
            x = jnp.concatenate([latents, latents]) if cfg else latents
            x = jax.lax.with_sharding_constraint(x, batch_sharding)  # CFG's two halves on dp
            t = jnp.broadcast_to(timestep, (x.shape[0],))
            out = transformer_fn(state, x, embeds, t, image_rotary_emb=rope, return_dict=False)[0]
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


        def put(value, sharding=replicated):
            return self.runtime.put(value, sharding)

        embeds = torch.cat([embeddings.negative_prompt_embeds, embeddings.prompt_embeds]) if cfg else embeddings.prompt_embeds
        embeds_dev = put(embeds.to(self.dtype), batch_sharding)
        rope = self._rotary_embeddings(s.height, s.width, shape[1])
        rope_dev = put(rope) if rope is not None else None
        latents_dev = put(latents)
        noise_zero = put(torch.zeros(shape, dtype=self.dtype))  # DDIM adds no noise (its coefficient D is 0)
        old_x0 = put(torch.zeros(shape, dtype=torch.float32))  # no previous x0 before the first step (Q is 0)
        example = (state, latents_dev, embeds_dev, put(torch.zeros((1,), dtype=torch.int32)),
                   put(torch.zeros((len(_COEFFS),), dtype=torch.float32)), noise_zero, old_x0, rope_dev)
        key = (self.generation, self.dtype_name, cfg, shape, tuple(embeds.shape), self.attention)
        with attention_scope(self.attention, self.mesh):
            program = self._compile("sample", step_fn, key, *example,
                                    describe=f"sampler step for {s.num_frames}x{s.height}x{s.width} "
                                    f"({'CFG batch 2' if cfg else 'no CFG'}, mesh {self.mesh_spec}, "
                                    f"{self.attention.impl} attention)")
        start = time.perf_counter()
        for i, t in enumerate(timesteps):
            if should_stop is not None and should_stop():
                raise Interrupted(f"sampling interrupted before step {i + 1} of {len(timesteps)}")
            noise = noise_zero
            if stochastic:
                noise = randn_tensor(shape, generator=generator, device=torch.device("cpu"), dtype=self.dtype)
                if plan.second_draw[i]:
                    noise = randn_tensor(shape, generator=generator, device=torch.device("cpu"), dtype=self.dtype)
                noise = put(noise)
            latents_dev, old_x0 = program(
                state, latents_dev, embeds_dev, put(torch.tensor([int(t)], dtype=torch.int32)),
                put(torch.from_numpy(plan.coeffs[i])), noise, old_x0, rope_dev,
            )
            # JAX dispatches asynchronously: without waiting, the loop would queue every step at once, the
            # progress bar would race ahead of the device and Cancel could not stop the steps already queued.
            # A step takes seconds on real models; the wait costs only the next dispatch's latency.
            latents_dev.block_until_ready()
            if on_step is not None:
                on_step(i + 1, len(timesteps))
        result = self.runtime.to_cpu(latents_dev)
        self._record_run("sample", start)
        result = result[:, pad:].permute(0, 2, 1, 3, 4).float().contiguous()
        return VideoLatents(result, s.height, s.width, s.num_frames, self.signature)

    # --- stage 3: decode ---------------------------------------------------------------------------------------
    def decode(self, latents: VideoLatents, tiling: bool = False, group_norm: str = "stock") -> torch.Tensor:
        """Frames ``[F, H, W, 3]`` float32 in 0..1 from stage-2 latents."""
        import jax.numpy as jnp

        if group_norm not in GROUP_NORMS:
            raise InputError(f"group_norm must be one of {GROUP_NORMS}, got {group_norm!r}")
        self.check_made_here(latents)
        z = latents.latents
        channels = int(self.vae_config["latent_channels"])
        if z.ndim != 5 or z.shape[0] != 1 or z.shape[1] != channels:
            raise StageFileError(
                f"latents have shape {tuple(z.shape)}; this model's VAE decodes [1, {channels}, T, H/8, W/8]"
            )
        vae = self._component("vae")
        vae.use_tiling = bool(tiling)
        scaling = float(self.vae_config.get("scaling_factor", 1.15258426))
        with _vae_for_xla(vae, group_norm):
            decode_fn = self.runtime.module_function(vae, "decode")
            state = self._states["vae"]

            def frames_fn(state, z):
                video = decode_fn(state, (1 / scaling) * z, return_dict=False)[0]
                video = jnp.clip(video * 0.5 + 0.5, 0.0, 1.0)
                return jnp.transpose(video[0], (1, 2, 3, 0)).astype(jnp.float32)

            z_sharding = self.runtime.sharding(self.mesh, self._vae_input_spec(z.shape))
            z_dev = self.runtime.put(z.to(self.dtype), z_sharding)
            key = (self.dtype_name, tuple(z.shape), bool(tiling), group_norm, self.vae_sharding)
            program = self._compile("decode", frames_fn, key, state, z_dev,
                                    describe=f"VAE decode for {latents.num_frames}x{latents.height}x{latents.width}")
        start = time.perf_counter()
        frames = self.runtime.to_cpu(program(state, z_dev))
        self._record_run("decode", start)
        return frames

    def _vae_input_spec(self, shape) -> tuple:
        """``width``: latents [B, C, T, H, W] split on W over every mesh axis that divides it (XLA adds the conv
        halos); otherwise replicated."""
        if self.vae_sharding != "width":
            return ()
        axes = tuple(a for a, n in self.mesh.shape.items() if n > 1)
        devices = self.mesh_spec.devices
        return (None, None, None, None, axes) if axes and shape[-1] % devices == 0 else ()

    # --- helpers -----------------------------------------------------------------------------------------------
    def _compile(self, stage: str, fn, key, *example, describe: str):
        from .runtime import compile_stats

        before = compile_stats()
        start = time.perf_counter()
        full_key = (FAMILY, stage, self.signature, key, self.mesh_spec.sizes, self.fsdp)
        program = self.runtime.compiled(full_key, fn, *example, describe=describe)
        self.timings.programs[stage] = self.runtime.program_info(full_key)
        self.timings.compile[stage] = self.timings.compile.get(stage, 0.0) + time.perf_counter() - start
        delta = compile_stats().since(before)
        self.timings.compiles[stage] = self.timings.compiles.get(stage, 0) + delta.xla_compiles
        self.timings.cache_hits[stage] = self.timings.cache_hits.get(stage, 0) + delta.persistent_cache_hits
        return program

    def _record_run(self, stage: str, start: float) -> None:
        self.timings.run[stage] = self.timings.run.get(stage, 0.0) + time.perf_counter() - start


# --- scheduler coefficients ----------------------------------------------------------------------------------
# One step computes, with s the latents, m the (guided) model output and o the previous step's x0:
#   x0   = (C_SAMPLE * s - C_MODEL * m) / C_DIV
#   prev = A * s - M1 * (P * x0 - Q * o) + D * noise
# which is exactly diffusers' CogVideoXDDIMScheduler.step (M1 = -b_t, P = 1, Q = D = 0) and
# CogVideoXDPMScheduler.step (the first-order and the second-order branch) for every prediction type.
_COEFFS = ("C_SAMPLE", "C_MODEL", "C_DIV", "A", "M1", "P", "Q", "D", "GUIDANCE")
_C_SAMPLE, _C_MODEL, _C_DIV, _A, _M1, _P, _Q, _D, _GUIDANCE = range(len(_COEFFS))


@dataclass
class StepPlan:
    coeffs: list[np.ndarray]  # one float32 vector per step
    second_draw: list[bool]  # DPM draws a second noise tensor on its second-order steps


def step_coefficients(scheduler, timesteps: torch.Tensor, guidance: float, dynamic_cfg: bool) -> StepPlan:
    """Per-step coefficient vectors, computed with diffusers' scheduler tensors and formulas on the host."""
    steps = scheduler.num_inference_steps
    stride = scheduler.config.num_train_timesteps // steps
    prediction = scheduler.config.prediction_type
    dpm = type(scheduler).__name__ == SCHEDULERS["dpm"]
    one = torch.tensor(1.0)
    coeffs, second = [], []
    for i, t in enumerate(timesteps):
        t = int(t)
        prev_t = t - stride
        alpha = scheduler.alphas_cumprod[t]
        alpha_prev = scheduler.alphas_cumprod[prev_t] if prev_t >= 0 else scheduler.final_alpha_cumprod
        beta = 1 - alpha
        if prediction == "v_prediction":
            c_sample, c_model, c_div = alpha**0.5, beta**0.5, one
        elif prediction == "epsilon":
            c_sample, c_model, c_div = one, beta**0.5, alpha**0.5
        elif prediction == "sample":
            c_sample, c_model, c_div = torch.tensor(0.0), -one, one
        else:
            raise ModelFolderError(f"scheduler prediction_type {prediction!r} is not supported")
        zero = torch.tensor(0.0)
        if not dpm:
            a_t = ((1 - alpha_prev) / (1 - alpha)) ** 0.5
            b_t = alpha_prev**0.5 - alpha**0.5 * a_t
            row, draw2 = (a_t, -b_t, one, zero, zero), False
        else:
            back = scheduler.alphas_cumprod[int(timesteps[i - 1])] if i > 0 else None
            h, r, _, _ = scheduler.get_variables(alpha, alpha_prev, back)
            mult = list(scheduler.get_mult(h, r, alpha, alpha_prev, back))
            mult_noise = (1 - alpha_prev) ** 0.5 * (1 - (-2 * h).exp()) ** 0.5
            draw2 = i > 0 and prev_t >= 0
            if draw2:
                row = (mult[0], mult[1], mult[2], mult[3], mult_noise)
            else:
                row = (mult[0], mult[1], one, zero, mult_noise)
        g = guidance
        if dynamic_cfg:
            g = 1 + guidance * ((1 - math.cos(math.pi * ((steps - t) / steps) ** 5.0)) / 2)
        values = [c_sample, c_model, c_div, *row, g]
        coeffs.append(np.array([float(v) for v in values], dtype=np.float32))
        second.append(draw2)
    return StepPlan(coeffs, second)


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
class _vae_for_xla:
    """While tracing the VAE: plain Conv3d instead of CogVideoXSafeConv3d's cuDNN splitting, and optionally a
    vectorised ``jnp.var`` GroupNorm instead of torchax's stock lowering."""

    def __init__(self, vae: torch.nn.Module, group_norm: str):
        self.vae, self.group_norm = vae, group_norm
        self._saved: list[tuple[torch.nn.Module, object]] = []

    def __enter__(self):
        from diffusers.models.autoencoders.autoencoder_kl_cogvideox import CogVideoXSafeConv3d

        for module in self.vae.modules():
            if isinstance(module, CogVideoXSafeConv3d):
                self._override(module, torch.nn.Conv3d.forward.__get__(module))
            elif isinstance(module, torch.nn.GroupNorm) and self.group_norm == "jnp_var":
                self._override(module, _var_group_norm_forward(module))
        return self

    def _override(self, module, forward):
        self._saved.append((module, module.__dict__.get("forward")))
        module.forward = forward

    def __exit__(self, *exc):
        for module, previous in reversed(self._saved):
            if previous is None:
                del module.forward
            else:
                module.forward = previous
        self._saved.clear()


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


def _jax_dtype(dtype: torch.dtype):
    import jax.numpy as jnp

    return {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16}[dtype]
