"""Wan on JAX through torchax: text to video with Wan 2.1 (1.3B, 14B), Wan 2.2 A14B (two experts) and TI2V-5B;
image to video with Wan 2.1 I2V and FLF2V (CLIP vision features), Wan 2.2 I2V-A14B and TI2V-5B with an image.

The stages match diffusers' ``WanPipeline`` number for number (same weights, prompt and seed give the same
frames); each is one compiled program per shape:

- encode: umT5 on ``[negative, positive]`` with the attention mask, every row from the prompt's real length
  (EOS included) on set to exact zeros, as diffusers does; 512 tokens.
- sample: one program for a whole denoising step: both CFG branches as one batch of two (diffusers runs them as
  two calls; the numbers are the same), the transformer, guidance, and the scheduler update. The scheduler
  (flow-matching UniPC, the default, or flow-matching Euler) is a linear plan read off diffusers' own scheduler
  (``schedulers.linear_plan``): its predictor-corrector history is carried between steps as arrays and its
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

Models come from a diffusers folder (``model_index.json``) or from ComfyUI's single files (``wan_files.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .attention import AttentionConfig
from .errors import InputError, ModelFolderError
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
from .schedulers import euler_simple_scheduler, linear_plan
from .sharding import UMT5_ENCODER_RULES, VAE_RULES, WAN_TRANSFORMER_RULES, MeshSpec

log = logging.getLogger(__name__)

FAMILY = "wan"
TEXT_LEN = 512  # diffusers' WanPipeline max_sequence_length
SCHEDULERS = ("unipc", "euler", "euler_simple")
PIPELINES = ("WanPipeline", "WanImageToVideoPipeline")
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
DEFAULT_GUIDANCE = 5.0
NATIVE = {"2.1-small": (480, 832, 81), "2.1": (720, 1280, 81), "2.2-A14B": (720, 1280, 81),
          "2.2-TI2V-5B": (704, 1280, 121)}
FPS = {"2.1": 16, "2.2-A14B": 16, "2.2-TI2V-5B": 24}
_KEEP_FP32 = ("rope", "time_embedder", "scale_shift_table", "norm1", "norm2", "norm3")  # diffusers' choice


@dataclass
class WanFiles:
    """ComfyUI single files standing in for a diffusers folder."""

    transformer: Path
    text_encoder: Path
    vae: Path
    transformer_2: Path | None = None
    clip_vision: Path | None = None  # Wan 2.1 I2V / FLF2V: models/clip_vision/clip_vision_h.safetensors


# --- recognising what the user has ---------------------------------------------------------------------------
def inspect_wan_folder(path: Path, weights: bool = True) -> dict:
    """Check that ``path`` is a complete diffusers Wan text-to-video folder; return its model_index.
    ``weights=False``: only the configs are needed (planning compiles with the weights' shapes alone)."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ModelFolderError(f"model folder {folder} does not exist: pass the folder that holds model_index.json "
                               "(e.g. a download of Wan-AI/Wan2.1-T2V-1.3B-Diffusers)")
    index_file = folder / "model_index.json"
    if not index_file.is_file():
        raise ModelFolderError(f"{folder} is not a diffusers model folder: model_index.json is missing. Download "
                               "the whole diffusers repository, or load ComfyUI's single files instead")
    index = json.loads(index_file.read_text())
    cls = index.get("_class_name", "")
    if not cls.startswith("Wan"):
        raise ModelFolderError(f"{folder} holds a {cls or 'unknown'} model, not Wan: pick a Wan folder")
    if cls not in PIPELINES:
        raise ModelFolderError(f"{folder} holds a {cls} model; this pack runs WanPipeline (text-to-video, TI2V-5B) "
                               "and WanImageToVideoPipeline (Wan2.1-I2V/FLF2V-14B, Wan2.2-I2V-A14B) models")
    missing = []
    wanted = [c for c in COMPONENTS if weights or c != "tokenizer"]
    wanted += [c for c in ("transformer_2", "image_encoder", "image_processor") if _present(index.get(c))]
    for name in wanted:
        sub = folder / name
        if not sub.is_dir():
            missing.append(f"{name}/ (folder missing)")
        elif name in ("text_encoder", "transformer", "transformer_2", "vae", "image_encoder"):
            if not (sub / "config.json").is_file():
                missing.append(f"{name}/config.json")
            if weights and not any(p.name.endswith(".safetensors") for p in sub.iterdir()):
                missing.append(f"{name}/*.safetensors (no weights)")
        elif name == "scheduler" and not (sub / "scheduler_config.json").is_file():
            missing.append("scheduler/scheduler_config.json")
        elif name == "tokenizer" and not any((sub / f).is_file() for f in ("tokenizer.json", "spiece.model")):
            missing.append("tokenizer/tokenizer.json or spiece.model")
        elif name == "image_processor" and not (sub / "preprocessor_config.json").is_file():
            missing.append("image_processor/preprocessor_config.json")
    if missing:
        raise ModelFolderError(f"model folder {folder} is incomplete, missing: {', '.join(missing)}. Re-download "
                               "those files from the model's diffusers repository")
    return index


def _present(entry) -> bool:
    return isinstance(entry, list) and len(entry) == 2 and entry[0] is not None


def is_wan_folder(path: Path) -> bool:
    try:
        return json.loads((Path(path) / "model_index.json").read_text()).get("_class_name", "").startswith("Wan")
    except (OSError, ValueError):
        return False


def generation_of(transformer_config: dict, vae_config: dict, two_experts: bool) -> str:
    """"2.1", "2.2-A14B" (two experts) or "2.2-TI2V-5B" (48-channel Wan 2.2 VAE)."""
    if two_experts:
        return "2.2-A14B"
    if int(vae_config.get("z_dim", 16)) == 48:
        return "2.2-TI2V-5B"
    return "2.1"


# --- the family ----------------------------------------------------------------------------------------------
class WanFamily(ModelFamily):
    """A loaded Wan model, from a diffusers folder or ComfyUI single files. Components load on first use, once."""

    FAMILY = FAMILY
    FAMILY_NAME = "Wan"
    DEFAULT_GUIDANCE = DEFAULT_GUIDANCE

    def __init__(self, path: str | Path | None = None, *, files: WanFiles | None = None, dtype: str = "auto",
                 runtime: Runtime | None = None, mesh: "str | dict | MeshSpec | None" = None,
                 attention: "AttentionConfig | str | None" = None, fsdp: bool = False,
                 vae_sharding: str = "auto", target_devices=None):
        if (path is None) == (files is None):
            raise InputError("give either a Wan diffusers folder or the single files (transformer, text encoder, "
                             "VAE), not both")
        self.files = files
        self.path = Path(path).expanduser() if path is not None else None
        self._names: dict[str, dict[str, str]] = {}  # single files: file key -> module name, per component
        if self.path is not None:
            self.index = inspect_wan_folder(self.path, weights=target_devices is None)
            self.transformer_config = _read_config(self.path / "transformer")
            self.vae_config = _read_config(self.path / "vae")
            self.text_config = _read_config(self.path / "text_encoder")
            self.two_experts = _present(self.index.get("transformer_2"))
            self.transformer_2_config = _read_config(self.path / "transformer_2") if self.two_experts else None
            self.scheduler_config = json.loads((self.path / "scheduler" / "scheduler_config.json").read_text())
            self.boundary_ratio = self.index.get("boundary_ratio")
            self.expand_timesteps = bool(self.index.get("expand_timesteps", False))
            has_encoder = _present(self.index.get("image_encoder"))
            self.image_encoder_config = _read_config(self.path / "image_encoder") if has_encoder else None
        else:
            self._inspect_files(files)
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
        from .wan_files import transformer_names, umt5_names, vae_names

        for what, p in (("transformer", files.transformer), ("text encoder", files.text_encoder),
                        ("VAE", files.vae), ("transformer_2", files.transformer_2)):
            if p is not None and not Path(p).is_file():
                raise ModelFolderError(f"{what} file {p} does not exist: check the path (ComfyUI keeps them in "
                                       "models/diffusion_models, models/text_encoders and models/vae)")
        self.transformer_config, self._names["transformer"] = transformer_names(files.transformer)
        self.two_experts = files.transformer_2 is not None
        self.transformer_2_config = None
        if self.two_experts:
            self.transformer_2_config, self._names["transformer_2"] = transformer_names(files.transformer_2)
        self.text_config, self._names["text_encoder"] = umt5_names(files.text_encoder)
        self.image_encoder_config = None
        if files.clip_vision is not None:
            if not Path(files.clip_vision).is_file():
                raise ModelFolderError(f"CLIP vision file {files.clip_vision} does not exist: ComfyUI keeps it in "
                                       "models/clip_vision (clip_vision_h.safetensors)")
            from .wan_files import clip_vision_names

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
    def _builder(self, name: str):
        """How component ``name`` is built (on ``meta``), its config, the modules kept float32 and the file keys
        to ignore."""
        if name in ("transformer", "transformer_2"):
            from diffusers import WanTransformer3DModel

            config = self.transformer_config if name == "transformer" else self.transformer_2_config
            return (lambda: WanTransformer3DModel(**_init_kwargs(WanTransformer3DModel, config)), config,  # noqa: E731
                    _KEEP_FP32, (r"norm_added_q",))
        if name == "vae":
            from diffusers import AutoencoderKLWan

            return (lambda: AutoencoderKLWan(**_init_kwargs(AutoencoderKLWan, self.vae_config)),  # noqa: E731
                    self.vae_config, (), ())
        if name == "text_encoder":
            from transformers import UMT5Config, UMT5EncoderModel

            return (lambda: UMT5EncoderModel(UMT5Config(**_init_kwargs(None, self.text_config))),  # noqa: E731
                    self.text_config, (), ())
        if name == "image_encoder" and self.image_encoder_config is not None:
            from transformers import CLIPVisionConfig, CLIPVisionModel

            config = self.image_encoder_config
            return (lambda: CLIPVisionModel(CLIPVisionConfig(**_init_kwargs(None, config))),  # noqa: E731
                    config, (), (r"position_ids$",))
        raise KeyError(name)

    def _component_dtype(self, name: str) -> torch.dtype:
        """The CLIP vision encoder runs in float32 whatever the model's dtype (as the Wan I2V model cards load
        it): it runs once per video, and its features steer every step."""
        return torch.float32 if name == "image_encoder" else self.dtype

    def _finish(self, name: str, part: torch.nn.Module, config: dict) -> torch.nn.Module:
        if name in ("transformer", "transformer_2"):
            from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

            # RoPE tables are buffers computed at construction, not stored: build them for real.
            part.rope = WanRotaryPosEmbed(config["attention_head_dim"], tuple(config["patch_size"]),
                                          config.get("rope_max_seq_len", 1024))
            part.set_attn_processor(WanFunctionalAttnProcessor())
        if name == "image_encoder":
            embeddings = getattr(part, "vision_model", part).embeddings  # position ids: a buffer no file stores
            embeddings.position_ids = torch.arange(embeddings.num_positions).expand((1, -1))
        return part

    def _abstract_component(self, name: str) -> torch.nn.Module:
        from .weights import cast_meta_module

        build, config, keep, _ = self._builder(name)
        return self._finish(name, cast_meta_module(build, self._component_dtype(name), keep), config)

    def _load_component(self, name: str):
        from .weights import TensorSource, load_into_meta_module, meta_tensors, safetensors_files

        if name == "tokenizer":
            if self.path is not None:
                from transformers import AutoTokenizer

                return AutoTokenizer.from_pretrained(self.path / "tokenizer")
            from .wan_files import SentencePieceTokenizer

            return SentencePieceTokenizer.from_file(self.files.text_encoder)
        build, config, keep, ignore = self._builder(name)
        if self.path is not None:
            source = TensorSource(safetensors_files(self.path / name))
            names = {k: k for k in source.keys()}
            where = self.path / name
        else:
            path = {"transformer": self.files.transformer, "transformer_2": self.files.transformer_2,
                    "text_encoder": self.files.text_encoder, "vae": self.files.vae,
                    "image_encoder": self.files.clip_vision}[name]
            source, names, where = TensorSource([path]), self._names[name], path
        if name == "image_encoder":
            names = _clip_module_names(names, build)
        ties = {"encoder.embed_tokens.weight": "shared.weight"} if name == "text_encoder" else None
        part = load_into_meta_module(build, source, names, self._component_dtype(name), f"Wan {name} ({where})",
                                     keep_fp32=keep, ties=ties, ignore=ignore)
        part = self._finish(name, part, config)
        left = meta_tensors(part)
        if left:
            raise ModelFolderError(f"Wan {name} ({where}) left {len(left)} tensor(s) unset (e.g. {left[:3]})")
        return part

    def _rules_for(self, name: str):
        return {"text_encoder": UMT5_ENCODER_RULES, "transformer": WAN_TRANSFORMER_RULES,
                "transformer_2": WAN_TRANSFORMER_RULES}.get(name, VAE_RULES)

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

    @property
    def label(self) -> str:
        return self.path.name if self.path is not None else self.files.transformer.stem

    def source_paths(self) -> list[Path]:
        return [self.path] if self.path is not None else [p for p in vars(self.files).values() if p]

    def describe(self) -> dict:
        source = str(self.path) if self.path is not None else {k: str(v) for k, v in vars(self.files).items() if v}
        return {**super().describe(), "source": source, "two_experts": self.two_experts,
                "expand_timesteps": self.expand_timesteps}

    # --- validation ------------------------------------------------------------------------------------------
    def validate(self, height: int, width: int, num_frames: int) -> None:
        """Raise ``InputError`` for sizes this model cannot take, before anything compiles."""
        m = self.size_multiple
        why = f" for Wan {self.generation} (VAE x{self.vae_scale_spatial}, 2x2 patches)" if m != 16 else ""
        problems = size_problems(height, width, m, why)
        problem = frame_problem(num_frames, self.vae_scale_temporal, self.native_size()[2], f"Wan {self.generation}")
        if problem:
            problems.append(problem)
        if problems:
            raise InputError("; ".join(problems))

    def _lora_original_name(self, name: str) -> str:
        from .wan_files import wan_transformer_to_original

        return wan_transformer_to_original(name)

    def validate_settings(self, s: SampleSettings) -> None:
        """Settings this model cannot use are refused, never silently ignored."""
        if s.dynamic_cfg:
            raise InputError("dynamic_cfg is a CogVideoX option; Wan has no dynamic guidance: turn it off")
        if s.scheduler is not None and s.scheduler not in SCHEDULERS:
            raise InputError(f"scheduler {s.scheduler!r} is not one Wan uses: pick one of {list(SCHEDULERS)}")
        if not self.two_experts:
            for name, value in (("guidance_2", s.guidance_2), ("boundary", s.boundary)):
                if value is not None:
                    raise InputError(f"{name}={value} applies only to two-expert Wan 2.2 models (A14B); this model "
                                     f"has one transformer: leave {name} unset")
        if s.boundary is not None and not 0.0 < float(s.boundary) < 1.0:
            raise InputError(f"boundary={s.boundary} must be between 0 and 1 (0.875 for Wan2.2-T2V-A14B)")
        if s.shift is not None and not float(s.shift) > 0:
            raise InputError(f"shift={s.shift} must be positive (3 to 12 for Wan; default: the model's)")
        self.lora_targets(s)

    # --- stage 1: text -----------------------------------------------------------------------------------------
    def tokenize(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        tokenizer = self._component("tokenizer")
        texts = [prompt_clean(t) for t in texts]
        if self.path is None:
            return tokenizer(texts, TEXT_LEN)
        out = tokenizer(texts, padding="max_length", max_length=TEXT_LEN, truncation=True, add_special_tokens=True,
                        return_attention_mask=True, return_tensors="pt")
        return out.input_ids, out.attention_mask

    def encode(self, prompt: str, negative_prompt: str = "") -> TextEmbeddings:
        if not isinstance(prompt, str) or not prompt.strip():
            raise InputError("prompt is empty: describe the video you want")
        negative_prompt = negative_prompt or ""
        ids, mask = self.tokenize([negative_prompt, prompt])
        program = self.encode_program()
        executable = self.compile_stage(program)
        ids_dev, mask_dev = self.put(ids.to(torch.int32)), self.put(mask.to(torch.int32))
        start = time.perf_counter()
        embeds = self.runtime.to_cpu(executable(program.example[0], ids_dev, mask_dev))
        self._record_run("encode", start)
        return TextEmbeddings(embeds[1:2], embeds[0:1], prompt, negative_prompt, self.signature)

    def encode_program(self) -> StageProgram:
        """umT5 over ``[negative, positive]`` with the attention mask; rows past each prompt set to zeros."""
        import jax.numpy as jnp

        self._component("text_encoder")
        encoder_fn = self.runtime.module_function(self._parts["text_encoder"])
        dtype = jax_dtype(self.dtype)

        def encode_fn(state, ids, mask):
            hidden = encoder_fn(state, ids, attention_mask=mask)[0]
            # Rows from the real length on become exact zeros (diffusers cuts each row at its length and pads).
            return jnp.where(mask[..., None] > 0, hidden, 0).astype(dtype)

        shape = (2, TEXT_LEN)
        example = (self._states["text_encoder"], self.arg(shape, torch.int32), self.arg(shape, torch.int32))
        return StageProgram("encode", encode_fn, example, shape, f"umT5 text encoder for {TEXT_LEN} tokens",
                            self.traced, ("text_encoder",))

    # --- stage 1b: the image (image-to-video) ---------------------------------------------------------------
    def encode_image(self, image, last_image=None, *, height: int, width: int, num_frames: int) -> ImageConditioning:
        """The first (and last) frame as sampling takes them, for a ``num_frames`` x ``height`` x ``width`` video:
        the VAE encoding of the conditioning video (normalised, with its frame mask in front for the models that
        concatenate it) and, for Wan 2.1 I2V / FLF2V, the CLIP vision features. One compiled program per size."""
        from .images import as_pil, video_image

        self.check_images(image is not None, last_image is not None)
        self.validate(height, width, num_frames)
        images = [as_pil(image, "image")] + ([as_pil(last_image, "last image")] if last_image is not None else [])
        programs = self.image_programs(height, width, num_frames, len(images))
        executables = [self.compile_stage(p) for p in programs]
        pixels = [self.put(video_image(im, height, width)[:, :, None].to(self.dtype)) for im in images]
        start = time.perf_counter()
        state = programs[0].example[0]
        run = {p.part: e for p, e in zip(programs, executables)}
        if "" in run:  # every frame in one program
            condition = self.runtime.to_cpu(run[""](state, *pixels)).float()
        else:  # the first two chunks, then one call per later chunk, the causal caches kept on the devices
            out, caches = run["start"](state, *pixels)
            parts = [self.runtime.to_cpu(out)]
            for i in range(2, self.latent_shape(height, width, num_frames)[2]):
                out, caches = run["chunk"](state, self.put(np.array(i, np.int32)), caches, *pixels[1:])
                parts.append(self.runtime.to_cpu(out))
            condition = torch.cat(parts, dim=2).float()
        embeds = None
        if self.uses_clip:
            clip_pixels = self._clip_processor()(images=images, return_tensors="pt").pixel_values
            embeds = self.runtime.to_cpu(run["clip"](programs[-1].example[0], self.put(clip_pixels.float())))
        self._record_run("image", start)
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

    def image_programs(self, height: int, width: int, num_frames: int, images: int = 1) -> list[StageProgram]:
        """The VAE encode of the conditioning video (the first frame, zeros, and the last frame if given; TI2V-5B:
        the first frame alone), normalised by the latent statistics, chunk by chunk as diffusers encodes it (the
        first frame, then 4 frames at a time, the causal caches carried between): one program for the first two
        chunks and, for longer videos, one for each later chunk, so neither holds more than one chunk's
        activations (``decode_loop = "unrolled"``: one program over every frame). Then CLIP vision over
        ``images`` pictures (its second-to-last hidden states) where the model attends to them."""
        import jax
        import jax.numpy as jnp

        vae = self._component("vae")
        mean, std_inv = (jnp.asarray(t.numpy()) for t in self._latent_statistics())
        frames = 1 if self.expand_timesteps else num_frames
        t = self.vae_scale_temporal
        chunks = 1 + (frames - 1) // t

        def normalised(latents):
            return (latents.astype(jnp.float32) - mean) * std_inv

        def later_chunk(index, last=None):
            """Pixel frames [1, 3, 4, H, W] of chunk ``index`` >= 1 (a Python int, or traced): zeros, with the last
            picture at the video's end."""
            zeros = jnp.zeros((1, 3, t, height, width), jax_dtype(self.dtype))
            if last is None:
                return zeros
            final = jnp.where(index == chunks - 1, last, jnp.zeros_like(last))
            return jnp.concatenate([zeros[:, :, :t - 1], final], axis=2)

        @contextlib.contextmanager
        def scope():
            with self.traced(), _wan_vae_for_xla(vae):
                yield

        pixel = self.arg((1, 3, 1, height, width), self.dtype)
        example = (self._states["vae"], pixel, *([pixel] if images == 2 else []))
        what = f"Wan VAE encode of the image(s) for {num_frames}x{height}x{width}"
        key = (height, width, frames, images, self._resolved_decode_loop())
        programs = []
        if self._resolved_decode_loop() == "unrolled" or chunks == 1:
            encode_fn = self.runtime.module_function(vae, lambda module, video: module.encode(video).latent_dist.mode())

            def condition_fn(state, first, *last):
                video = first
                if frames > 1:
                    gap = frames - 1 - len(last)
                    video = jnp.concatenate([first, jnp.zeros(first.shape[:2] + (gap,) + first.shape[3:],
                                                              first.dtype), *last], axis=2)
                return normalised(encode_fn(state, video))

            programs.append(StageProgram("image", condition_fn, example, key, what, scope, ("vae",)))
        else:
            step = _encode_function(self.runtime, vae)
            keep, placed = self._vae_placement()

            def start_fn(state, first, *last):
                outs, caches = [], None
                for pixels in [first, later_chunk(1, *last)][:chunks]:
                    out, caches = step(state, pixels, caches)
                    outs.append(out)
                return normalised(jnp.concatenate(outs, axis=2)), [c if c is None else keep(c) for c in caches]

            programs.append(StageProgram("image", start_fn, example, key + ("start",),
                                         f"{what}: the first {min(chunks, 2)} chunks", scope, ("vae",), part="start"))
            if chunks > 2:
                with scope(), tracing():
                    _, cache_structs = jax.eval_shape(start_fn, *example)

                def chunk_fn(state, index, caches, *last):
                    out, caches = step(state, later_chunk(index, *last), caches)
                    return normalised(out), [c if c is None else keep(c) for c in caches]

                chunk_example = (self._states["vae"], self.arg((), jnp.int32), [placed(c) for c in cache_structs],
                                 *example[2:])
                programs.append(StageProgram("image", chunk_fn, chunk_example, key + ("chunk",),
                                             f"{what}: each later chunk of {t} frames", scope, ("vae",), part="chunk"))
        if self.uses_clip:
            clip = self._component("image_encoder")
            size = int(self.image_encoder_config.get("image_size", 224))

            def features(module, pixels):
                return module(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]

            clip_fn = self.runtime.module_function(clip, features)
            example = (self._states["image_encoder"], self.arg((images, 3, size, size), torch.float32))
            programs.append(StageProgram("image", clip_fn, example, (images, size), f"CLIP vision over {images} "
                                         "image(s)", self.traced, ("image_encoder",), part="clip"))
        return programs

    # --- stage 2: sampling -------------------------------------------------------------------------------------
    def latent_shape(self, height: int, width: int, num_frames: int) -> tuple[int, ...]:
        frames = (num_frames - 1) // self.vae_scale_temporal + 1
        s = self.vae_scale_spatial
        return (1, int(self.transformer_config["out_channels"]), frames, height // s, width // s)

    def _image_mode(self, image: ImageConditioning | None) -> str:
        """How sampling uses the image: "" (none), "concat" (on channels, with the mask), "first" (TI2V-5B's first
        latent frame held at the image, timestep 0 on its tokens)."""
        if image is None:
            return ""
        return "concat" if self.concat_condition else "first"

    def sample(self, embeddings: TextEmbeddings, settings: SampleSettings,
               on_step: Callable[[int, int], None] | None = None,
               should_stop: Callable[[], bool] | None = None,
               image: ImageConditioning | None = None) -> VideoLatents:
        """Denoise from seeded noise; ``on_step(i, total)`` after each step, ``should_stop()`` before each.
        Image-to-video: ``image`` is the image encode stage's output for this size."""
        from diffusers.utils.torch_utils import randn_tensor

        s = settings
        self.validate(s.height, s.width, s.num_frames)
        self.validate_settings(s)
        self.check_conditioning(image, s)
        self.check_steps(s.steps)
        self.check_embeddings(embeddings, (1, TEXT_LEN, int(self.transformer_config["text_dim"])))
        guidance = DEFAULT_GUIDANCE if s.guidance is None else float(s.guidance)
        guidance_2 = guidance if s.guidance_2 is None else float(s.guidance_2)
        cfg = guidance > 1.0  # as diffusers: the first guidance alone turns CFG on, for both experts
        self.check_cfg_mesh(cfg)
        self.apply_loras(self.lora_targets(s))  # before compiling: a LoRA that does not fit is refused first
        scheduler = self.scheduler(s.scheduler, s.shift)
        plan = linear_plan(scheduler, s.steps)
        boundary = None
        if self.two_experts:
            ratio = self.boundary_ratio if s.boundary is None else float(s.boundary)
            boundary = ratio * scheduler.config.num_train_timesteps

        mode = self._image_mode(image)
        images = 0 if image is None or image.image_embeds is None else int(image.image_embeds.shape[0])
        program = self.sample_program(s.height, s.width, s.num_frames, cfg, plan, mode, images)
        for name in program.components:  # both experts on the devices before the first step
            self._component(name)
        executable = self.compile_stage(program)

        # The only random draw of text-to-video: the initial latents, float32, on the CPU generator.
        generator = torch.Generator("cpu").manual_seed(int(s.seed))
        shape = self.latent_shape(s.height, s.width, s.num_frames)
        latents = randn_tensor(shape, generator=generator, device=torch.device("cpu"), dtype=torch.float32)
        embeds = torch.cat([embeddings.negative_prompt_embeds, embeddings.prompt_embeds]) if cfg \
            else embeddings.prompt_embeds
        embeds_dev = self.put(embeds.to(self.dtype), ("dp",))
        x_dev = self.put(latents)
        kept_dev = tuple(self.put(torch.zeros(shape, dtype=torch.float32)) for _ in range(plan.kept))
        carry = {"x": x_dev, "kept": kept_dev}
        condition_dev = None if image is None else self.put(image.latents.float())
        image_embeds_dev = None
        if images:
            embeds_image = image.image_embeds.to(self.dtype)
            image_embeds_dev = self.put(torch.cat([embeds_image, embeds_image]) if cfg else embeds_image, ("dp",))

        def step(i):
            t = float(plan.timesteps[i])
            second = boundary is not None and t < boundary
            state = self._states["transformer_2" if second else "transformer"]
            g = guidance_2 if second else guidance
            carry["x"], carry["kept"] = executable(
                state, carry["x"], carry["kept"], embeds_dev, self.put(torch.tensor([t], dtype=torch.float32)),
                self.put(torch.from_numpy(plan.matrices[i])), self.put(torch.tensor([g], dtype=torch.float32)),
                condition_dev, image_embeds_dev)
            return carry["x"]

        self.run_steps(plan.steps, step, on_step, should_stop)
        start = time.perf_counter()
        result = self.runtime.to_cpu(carry["x"]).float().contiguous()
        if mode == "first":  # diffusers puts the image's latent frame back in front before decoding
            result[:, :, :1] = image.latents[:, :, :1].float()
        self._record_run("sample", start)
        return VideoLatents(result, s.height, s.width, s.num_frames, self.signature)

    def sample_program(self, height: int, width: int, num_frames: int, cfg: bool, plan, image: str = "",
                       images: int = 0) -> StageProgram:
        """One denoising step for the scheduler ``plan`` (a ``LinearStepPlan``): CFG batch, transformer, guidance
        and the update as a small coefficient matrix. Wan 2.2's experts share it: same architecture and shapes,
        only the weights passed differ. ``image`` (see ``_image_mode``): how the image's condition enters;
        ``images``: how many pictures' CLIP features the transformer attends to (0: none)."""
        import jax
        import jax.numpy as jnp

        shape = self.latent_shape(height, width, num_frames)
        self._component("transformer")
        transformer_fn = self.runtime.module_function(self._parts["transformer"])
        model_dtype = jax_dtype(self.dtype)
        batch_sharding = self.runtime.sharding(self.mesh, ("dp",))
        replicated = self.runtime.sharding(self.mesh)
        kept, round_result = plan.kept, plan.round_to_model_dtype
        patch = tuple(int(p) for p in self.transformer_config["patch_size"])

        frame_tokens = (shape[3] // patch[1]) * (shape[4] // patch[2])
        tokens = (shape[2] // patch[0]) * frame_tokens

        def step_fn(state, x, kept_arrays, embeds, timestep, matrix, g, condition, image_embeds):
            if image == "concat":  # diffusers: cat([latents, mask + condition], dim=1) in the model's dtype
                xin = jnp.concatenate([x, condition], axis=1).astype(model_dtype)
            elif image == "first":  # the first latent frame is the image's
                xin = jnp.concatenate([condition[:, :, :1], x[:, :, 1:]], axis=2).astype(model_dtype)
            else:
                xin = x.astype(model_dtype)
            batch = jnp.concatenate([xin, xin]) if cfg else xin
            batch = jax.lax.with_sharding_constraint(batch, batch_sharding)  # CFG's two halves on dp
            if image == "first":  # per-token timesteps, 0 on the image frame's tokens
                t = jnp.concatenate([jnp.zeros((frame_tokens,), jnp.float32),
                                     jnp.broadcast_to(timestep, (tokens - frame_tokens,))])
                t = jnp.broadcast_to(t[None], (batch.shape[0], tokens))
            else:
                t = jnp.broadcast_to(timestep, (batch.shape[0],))
            out = transformer_fn(state, batch, t, embeds, encoder_hidden_states_image=image_embeds,
                                 return_dict=False)[0]
            if cfg:
                uncond, cond = jnp.split(out.astype(jnp.float32), 2)
                out = (uncond + g[0] * (cond - uncond)).astype(model_dtype)
            inputs = [x, out.astype(jnp.float32), *kept_arrays]
            rows = [sum(matrix[r, c] * inputs[c] for c in range(len(inputs))) for r in range(1 + kept)]
            if round_result:  # the scheduler casts its result to the model output's dtype
                rows[0] = rows[0].astype(model_dtype).astype(jnp.float32)
            # Outputs come back as the next step's inputs: keep them where the inputs are (replicated).
            return (jax.lax.with_sharding_constraint(rows[0], replicated),
                    tuple(jax.lax.with_sharding_constraint(r, replicated) for r in rows[1:]))

        embeds_shape = (2 if cfg else 1, TEXT_LEN, int(self.transformer_config["text_dim"]))
        arg, f32 = self.arg, torch.float32
        condition = None
        if image == "concat":
            condition = arg((1, self.vae_scale_temporal + shape[1]) + shape[2:], f32)
        elif image == "first":
            condition = arg((1, shape[1], 1) + shape[3:], f32)
        image_embeds = None
        if images:
            c = self.image_encoder_config
            patches = (int(c.get("image_size", 224)) // int(c["patch_size"])) ** 2 + 1
            image_embeds = arg(((2 if cfg else 1) * images, patches, int(c["hidden_size"])), self.dtype, ("dp",))
        example = (self._states["transformer"], arg(shape, f32), tuple(arg(shape, f32) for _ in range(kept)),
                   arg(embeds_shape, self.dtype, ("dp",)), arg((1,), f32), arg(plan.matrices[0].shape, f32),
                   arg((1,), f32), condition, image_embeds)
        key = (shape, embeds_shape, cfg, kept, round_result, image, images, self.attention)
        return StageProgram("sample", step_fn, example, key,
                            f"Wan sampler step for {num_frames}x{height}x{width} ({'CFG batch 2' if cfg else 'no CFG'}"
                            f", mesh {self.mesh_spec}, {self.attention.impl} attention)", self.traced,
                            tuple(["transformer"] + (["transformer_2"] if self.two_experts else [])))

    def plan_programs(self, s: SampleSettings) -> list[StageProgram]:
        """Every program one generation with settings ``s`` runs, for ``plan`` to compile."""
        self.validate(s.height, s.width, s.num_frames)
        self.validate_settings(s)
        self.check_steps(s.steps)
        cfg = (DEFAULT_GUIDANCE if s.guidance is None else float(s.guidance)) > 1.0
        self.check_cfg_mesh(cfg)
        plan = linear_plan(self.scheduler(s.scheduler, s.shift), s.steps)
        images, mode, pictures = [], "", 0
        if self.image_input == "required":  # image-to-video: its image encode and the conditioned step
            pictures = 2 if self.last_image_input else 1
            images = self.image_programs(s.height, s.width, s.num_frames, pictures)
            mode, pictures = ("concat" if self.concat_condition else "first"), pictures if self.uses_clip else 0
        return [self.encode_program(), *images,
                self.sample_program(s.height, s.width, s.num_frames, cfg, plan, mode, pictures),
                *self.decode_programs(self.latent_shape(s.height, s.width, s.num_frames))]

    # --- stage 3: decode ---------------------------------------------------------------------------------------
    def decode(self, latents: VideoLatents, tiling: bool = False, group_norm: str = "stock") -> torch.Tensor:
        """Frames ``[F, H, W, 3]`` float32 in 0..1 from stage-2 latents."""
        from .errors import StageFileError

        if tiling:
            raise InputError("VAE tiling is a CogVideoX option here; the Wan VAE decodes one latent frame at a "
                             "time already: turn tiling off (or split the decode over devices: vae_sharding width)")
        if group_norm != "stock":
            raise InputError("group_norm applies to the CogVideoX VAE; the Wan VAE has no GroupNorm: leave it stock")
        self.check_made_here(latents)
        z = latents.latents
        channels = int(self.vae_config["z_dim"])
        if z.ndim != 5 or z.shape[0] != 1 or z.shape[1] != channels:
            raise StageFileError(f"latents have shape {tuple(z.shape)}; this model's VAE decodes "
                                 f"[1, {channels}, T, H/{self.vae_scale_spatial}, W/{self.vae_scale_spatial}]")
        programs = self.decode_programs(tuple(z.shape))
        executables = [self.compile_stage(p) for p in programs]
        state = programs[0].example[0]
        z_dev = self.put(z.float(), self._vae_input_spec(z.shape))
        mean, std_inv = (self.put(t) for t in self._latent_statistics())
        start = time.perf_counter()
        if len(programs) == 1 and programs[0].part == "":  # unrolled: one program for every frame
            frames = self.runtime.to_cpu(executables[0](state, z_dev, mean, std_inv))
        else:  # the first two latent frames, then one call per later frame, the causal caches kept on the devices
            x, first, caches = executables[0](state, z_dev, mean, std_inv)
            parts = [self.runtime.to_cpu(first)]
            for i in range(2, z.shape[2]):
                out, caches = executables[1](state, x, self.put(np.array(i, np.int32)), caches)
                parts.append(self.runtime.to_cpu(out))
            frames = torch.cat(parts)
        self._record_run("decode", start)
        return frames

    def _latent_statistics(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's per-channel latent mean and 1/std, shaped to broadcast over [1, C, T, H, W]."""
        channels = int(self.vae_config["z_dim"])
        mean = torch.tensor(self.vae_config["latents_mean"], dtype=torch.float32).view(1, channels, 1, 1, 1)
        std_inv = 1.0 / torch.tensor(self.vae_config["latents_std"], dtype=torch.float32).view(1, channels, 1, 1, 1)
        return mean, std_inv

    #: How diffusers' per-frame causal decode runs. "frames" (the default): two small programs, the first two
    #: latent frames (which give every causal cache its steady shape) and one later frame, called once per frame
    #: with the caches kept on the devices: memory bounded by one frame, a compile that does not grow with the
    #: frame count, each frame's pixels copied to the host as it is made. "unrolled": one program holding a copy
    #: of the decoder per latent frame; its compile grows with the frames, and the TPU compiler keeps far more
    #: than one frame's activations live (the Wan 2.1 VAE at 480x832x81 needed 32 GB a chip). The image encode of
    #: the conditioning video follows the same choice (chunks of 4 frames in place of latent frames).
    decode_loop = "frames"

    def _resolved_decode_loop(self) -> str:
        if self.decode_loop not in ("unrolled", "frames"):
            raise InputError(f"decode_loop {self.decode_loop!r} is not one of frames, unrolled")
        return self.decode_loop

    def decode_programs(self, z_shape: tuple[int, ...]) -> list[StageProgram]:
        """The programs that de-normalise latents ``[1, C, T, h, w]`` and decode them, one latent frame at a time
        as diffusers does, to frames ``[F, H, W, 3]`` in 0..1: one program (unrolled), or the first two frames'
        program and, for T > 2, the later frames' program (``decode_loop``)."""
        import jax
        import jax.numpy as jnp

        vae = self._component("vae")
        loop = self._resolved_decode_loop()
        dtype = jax_dtype(self.dtype)

        @contextlib.contextmanager
        def scope():
            with self.traced(), _wan_vae_for_xla(vae):
                yield

        def to_frames(video):  # [1, 3, F, H, W] in -1..1 -> [F, H, W, 3] in 0..1
            video = jnp.clip(video.astype(jnp.float32) * 0.5 + 0.5, 0.0, 1.0)
            return jnp.transpose(video[0], (1, 2, 3, 0))

        stats = (1, z_shape[1], 1, 1, 1)
        f32 = torch.float32
        example = (self._states["vae"], self.arg(z_shape, f32, self._vae_input_spec(z_shape)), self.arg(stats, f32),
                   self.arg(stats, f32))
        frames = (z_shape[2] - 1) * self.vae_scale_temporal + 1
        height, width = z_shape[3] * self.vae_scale_spatial, z_shape[4] * self.vae_scale_spatial
        what = f"Wan VAE decode for {frames}x{height}x{width}"
        key = (tuple(z_shape), self.vae_sharding, loop)
        if loop == "unrolled":
            decode_fn = self.runtime.module_function(vae, "decode")

            def frames_fn(state, z, mean, std_inv):
                z = (z / std_inv + mean).astype(dtype)  # diffusers: latents / (1 / std) + mean
                return to_frames(decode_fn(state, z, return_dict=False)[0])

            return [StageProgram("decode", frames_fn, example, key, what, scope, ("vae",))]

        post_quant, step = _frame_functions(self.runtime, vae)
        keep, placed = self._vae_placement()

        def start_fn(state, z, mean, std_inv):
            x = post_quant(state, (z / std_inv + mean).astype(dtype))
            outs, caches = [], None
            for i in range(min(x.shape[2], 2)):
                out, caches = step(state, x[:, :, i:i + 1], caches, i == 0)
                outs.append(out)
            if not all(c is None or isinstance(c, jax.Array) for c in caches):  # None: a cache never used
                raise RuntimeError("the Wan VAE's causal caches are not all tensors after two frames: decode it "
                                   "unrolled (decode_loop = 'unrolled')")
            return keep(x), to_frames(jnp.concatenate(outs, axis=2)), [c if c is None else keep(c) for c in caches]

        first = StageProgram("decode", start_fn, example, key + ("start",),
                             f"{what}: the first two latent frames", scope, ("vae",), part="start")
        if z_shape[2] <= 2:
            return [first]
        with scope(), tracing():
            x_struct, _, cache_structs = jax.eval_shape(start_fn, *example)

        def frame_fn(state, x, index, caches):
            x_frame = jax.lax.dynamic_slice_in_dim(x, index, 1, axis=2)
            out, caches = step(state, x_frame, caches, False)
            return to_frames(out), [c if c is None else keep(c) for c in caches]

        frame_example = (self._states["vae"], placed(x_struct), self.arg((), jnp.int32),
                         [placed(c) for c in cache_structs])
        later = StageProgram("decode", frame_fn, frame_example, key + ("frame",),
                             f"{what}: each later latent frame", scope, ("vae",), part="frame")
        return [first, later]


def _frame_functions(runtime: Runtime, vae: torch.nn.Module) -> tuple[Callable, Callable]:
    """Over jax values: ``post_quant(state, z)`` and ``step(state, x_frame, caches, first_chunk) -> (pixels,
    caches)``, one latent frame of diffusers' causal decode (``vae._decode``'s loop body) with its conv caches as
    explicit values (``None`` before the first frame)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, unpatchify

    cache_count = sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())

    def frame(module, x, caches, first_chunk):
        feat = list(caches) if caches is not None else [None] * cache_count
        out = module.decoder(x, feat_cache=feat, feat_idx=[0], first_chunk=first_chunk)
        if module.config.patch_size is not None:
            out = unpatchify(out, patch_size=module.config.patch_size)
        return torch.clamp(out, min=-1.0, max=1.0), feat

    post_quant = runtime.module_function(vae, lambda module, z: module.post_quant_conv(z))
    return post_quant, runtime.module_function(vae, frame)


def _encode_function(runtime: Runtime, vae: torch.nn.Module) -> Callable:
    """Over jax values: ``step(state, pixels, caches) -> (latents, caches)``, one chunk of diffusers' causal
    encode (``vae._encode``'s loop body: the first frame, or 4 frames) with its conv caches as explicit values
    (``None`` before the first chunk), then ``quant_conv`` (1x1x1, so per chunk is the same) and the posterior's
    mode (its mean)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, patchify

    cache_count = sum(isinstance(m, WanCausalConv3d) for m in vae.encoder.modules())

    def chunk(module, pixels, caches):
        feat = list(caches) if caches is not None else [None] * cache_count
        if module.config.patch_size is not None:
            pixels = patchify(pixels, patch_size=module.config.patch_size)
        out = module.quant_conv(module.encoder(pixels, feat_cache=feat, feat_idx=[0]))
        return out[:, :out.shape[1] // 2], feat

    return runtime.module_function(vae, chunk)


def _wan_vae_for_xla(vae: torch.nn.Module):
    """While tracing the Wan VAE: its nearest-neighbour upsampling runs in the input's dtype. diffusers upsamples
    in float32 and casts back, which is the same numbers (nearest only copies values); traced through torchax in
    bfloat16, the cast-back tensor reached the next convolution as float32 and stopped the trace."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanUpsample

    def replacement(module):
        return torch.nn.Upsample.forward.__get__(module) if isinstance(module, WanUpsample) else None

    return forwards_replaced(vae, replacement)


def _clip_module_names(names: dict[str, str], build) -> dict[str, str]:
    """File key -> module name for a CLIP vision model whose files say ``vision_model.…`` (older transformers,
    ComfyUI) while the installed transformers may name its parameters without that prefix, or the reverse."""
    with torch.device("meta"):
        prefixed = any(n.startswith("vision_model.") for n in build().state_dict())
    bare = {k: v.removeprefix("vision_model.") for k, v in names.items()}
    return {k: "vision_model." + v for k, v in bare.items()} if prefixed else bare


def _read_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _arch(config: dict) -> dict:
    return {k: v for k, v in config.items() if not k.startswith("_")}


def _init_kwargs(cls, config: dict) -> dict:
    """A saved config without its bookkeeping keys (``_class_name``, versions), as constructor arguments."""
    import inspect

    kwargs = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("torch_dtype", "dtype")}
    if cls is None:
        return kwargs
    accepted = set(inspect.signature(cls.__init__).parameters)
    return {k: v for k, v in kwargs.items() if k in accepted}


# --- transformer attention -------------------------------------------------------------------------------------
class WanFunctionalAttnProcessor:
    """Wan attention as diffusers' ``WanAttnProcessor`` computes it, with RoPE applied by interleaving (stack)
    instead of strided writes into ``empty_like`` (XLA:CPU miscompiled the in-place form of the same pattern
    in CogVideoX; this form is exact and writes no large activation in place), and attention through
    ``F.scaled_dot_product_attention``, which the runtime overrides."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        import torch.nn.functional as F

        image_states = None
        if attn.add_k_proj is not None and encoder_hidden_states is not None:
            image_len = encoder_hidden_states.shape[1] - TEXT_LEN  # diffusers hard-codes 512 text tokens too
            image_states = encoder_hidden_states[:, :image_len]
            encoder_hidden_states = encoder_hidden_states[:, image_len:]
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        q, k, v = attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))  # [B, L, H, D]
        if rotary_emb is not None:
            q, k = _rope(q, *rotary_emb), _rope(k, *rotary_emb)

        def sdpa(q, k, v):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=attention_mask, dropout_p=0.0, is_causal=False)
            return out.transpose(1, 2).flatten(2, 3).type_as(q)

        out = sdpa(q, k, v)
        if image_states is not None:
            k_img = attn.norm_added_k(attn.add_k_proj(image_states)).unflatten(2, (attn.heads, -1))
            v_img = attn.add_v_proj(image_states).unflatten(2, (attn.heads, -1))
            out = out + sdpa(q, k_img, v_img)
        return attn.to_out[1](attn.to_out[0](out))


def _rope(x, cos, sin):
    """diffusers' Wan RoPE (pairs (x[2i], x[2i+1]) rotated) written as one stack instead of strided stores."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).type_as(x)
