"""ComfyUI's own video model classes at their released sizes, for ``plan --comfy-model``: built on ``meta`` (no
weights), with the call a sampler makes at a given size, so that their programs compile for a TPU slice this
machine does not have.

Each entry names ComfyUI's class and its constructor arguments as ComfyUI's detection (``model_detection.py``)
reads them from a released file, the latent layout, and what reaches the model's ``_forward`` besides the
latents (text length and width, pooled text, guidance, masks, CLIP image features). ``family`` names our own
family's release of the same weights, planned beside it for comparison.
"""

from __future__ import annotations

import importlib
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InputError


@dataclass(frozen=True)
class NativeArchitecture:
    name: str
    cls: str  # "module:Class" in ComfyUI
    config: dict
    latent_channels: int
    compression: tuple[int, int]  # frames (F - 1) // t + 1, pixels / s
    size: tuple[int, int, int]  # native height, width, frames
    text: tuple[int, int]  # tokens, width of the text states the model takes
    extra: tuple[str, ...] = ()  # other inputs: "clip_fea", "pooled", "guidance", "mask", "frame_rate", "vace"
    family: str | None = None  # our family's release of the same model
    layers_key: str = "num_layers"
    notes: str = ""
    channels_in: int | None = None  # the latents' channels as the model takes them (I2V: noise + mask + image)
    text_encoder: str | None = None  # the text encoder (``COMPONENTS``) its graphs load, planned with it
    vae: str | None = None  # the VAE (``COMPONENTS``) its graphs load, planned with it
    size_multiple: int | None = None  # what height and width must be a multiple of (default: 2 latent pixels)
    audio: tuple[int, int] | None = None  # LTX-2: the audio latent's channels and frequency bins (25 a second)
    # options a newer ComfyUI's class requires (HunyuanVideo 1.5's in 0.33, off for the original), passed when the
    # class's parameter dataclass ``params`` ("module:Class") has them
    later: tuple[tuple[str, object], ...] = ()
    params: str | None = None
    batch_one: bool = False  # the model takes one prompt a call (a CFG step is two calls)

    def build(self, layers: int | None = None, dtype=torch.bfloat16) -> torch.nn.Module:
        """ComfyUI's class at this size, on ``meta`` (``layers``: a reduced depth for a quick check)."""
        import comfy.ops

        module_name, class_name = self.cls.split(":")
        cls = getattr(importlib.import_module(module_name), class_name)
        config = dict(self.config)
        if layers is not None:
            if self.layers_key == "depth":  # HunyuanVideo: double blocks, then single blocks
                config["depth"] = min(layers, config["depth"])
                config["depth_single_blocks"] = min(layers, config["depth_single_blocks"])
            else:
                config[self.layers_key] = layers
        if self.later:
            import dataclasses

            params_module, params_class = self.params.split(":")
            fields = {f.name for f in dataclasses.fields(getattr(importlib.import_module(params_module), params_class))}
            config.update({k: v for k, v in self.later if k in fields and k not in config})
        return cls(**config, device="meta", dtype=dtype, operations=comfy.ops.disable_weight_init)

    def latent_shape(self, batch: int, height: int, width: int, frames: int) -> tuple[int, ...]:
        t, s = self.compression
        return (batch, self.channels_in or self.latent_channels, (frames - 1) // t + 1, height // s, width // s)

    def check_size(self, height: int, width: int, frames: int) -> None:
        t, s = self.compression
        multiple = self.size_multiple or 2 * s
        if height % multiple or width % multiple:
            raise InputError(f"--height/--width {height}x{width}: {self.name} takes multiples of {multiple}")
        if (frames - 1) % t:
            lower = (frames - 1) // t * t + 1
            raise InputError(f"--frames {frames}: {self.name} takes {t}N+1 frames, e.g. {lower} or {lower + t}")

    def example_call(self, batch: int, height: int, width: int, frames: int, dtype=torch.bfloat16):
        """(args, kwargs) of meta tensors: what ComfyUI's sampler passes the model's ``_forward`` at this size."""
        meta = dict(device="meta")
        x = torch.empty(self.latent_shape(batch, height, width, frames), dtype=dtype, **meta)
        t = torch.empty(batch, dtype=torch.float32, **meta)
        tokens, width_text = self.text
        context = torch.empty(batch, tokens, width_text, dtype=dtype, **meta)
        kwargs: dict = {"transformer_options": {}, "control": None}
        if "clip_fea" in self.extra:
            kwargs["clip_fea"] = torch.empty(batch, 257, 1280, dtype=dtype, **meta)
        if "pooled" in self.extra:
            kwargs["y"] = torch.empty(batch, 768, dtype=dtype, **meta)
        if "guidance" in self.extra:
            kwargs["guidance"] = torch.empty(batch, dtype=torch.float32, **meta)
        if "mask" in self.extra:
            kwargs["attention_mask"] = torch.empty(batch, tokens, dtype=torch.int64, **meta)
        if "frame_rate" in self.extra:
            kwargs["frame_rate"] = 25
        if "vace" in self.extra:
            shape = list(self.latent_shape(batch, height, width, frames))
            shape[1] = self.config["vace_in_dim"]
            kwargs["vace_context"] = torch.empty(batch, 1, *shape[1:], dtype=dtype, **meta)
            kwargs["vace_strength"] = [1.0]
        if self.audio:  # LTX-2: video and audio latents as a list, the audio's timestep beside the video's
            channels, bins = self.audio
            length = round(frames / LTXAV_FRAME_RATE * LTXAV_AUDIO_LATENTS_PER_SECOND)
            x = [x, torch.empty(batch, channels, length, bins, dtype=dtype, **meta)]
            kwargs.update(attention_mask=None, frame_rate=LTXAV_FRAME_RATE, a_timestep=t)
        return (x, t, context), kwargs

    @property
    def heads(self) -> int:
        for key in ("num_heads", "num_attention_heads"):
            if key in self.config:
                return self.config[key]
        return 1


@dataclass(frozen=True)
class PackedAVArchitecture(NativeArchitecture):
    """MiniMax H3: video (17k+5 frames to 5k+2 latent frames, 16x spatial) and stereo audio latents (40 a second, 24
    frames a second) packed with the text into one sequence; batch 1 (a CFG run calls it twice a step); the text is
    what ``preprocess_text_embeds`` made of the encoder's states (the model's own width)."""

    fps: int = 24
    audio_rate: int = 40
    batch_one: bool = True

    def latent_frames(self, frames: int) -> int:
        return 2 if frames <= 5 else ((frames - 5) // 17) * 5 + 2

    def latent_shape(self, batch: int, height: int, width: int, frames: int) -> tuple[int, ...]:
        s = self.compression[1]
        return (1, self.latent_channels, self.latent_frames(frames), height // s, width // s)

    def check_size(self, height: int, width: int, frames: int) -> None:
        multiple = self.size_multiple or 32
        if height % multiple or width % multiple:
            raise InputError(f"--height/--width {height}x{width}: {self.name} takes multiples of {multiple}")
        if frames < 5 or frames % 17 != 5:
            lower = max(5, (frames - 5) // 17 * 17 + 5)
            raise InputError(f"--frames {frames}: {self.name} takes 17N+5 frames, e.g. {lower} or {lower + 17}")

    def example_call(self, batch: int, height: int, width: int, frames: int, dtype=torch.bfloat16):
        tokens, _ = self.text
        video = torch.empty(self.latent_shape(1, height, width, frames), dtype=dtype, device="meta")
        audio_frames = round(frames / self.fps * self.audio_rate)
        audio = torch.empty(1, self.config["audio_latents_dim"], 2, audio_frames, dtype=dtype, device="meta")
        context = torch.empty(1, tokens, self.config["hidden_size"], dtype=dtype, device="meta")
        payload = {"text_token_tags": torch.ones(tokens, dtype=torch.long), "seed": 0, "audio_scale": 1.0}
        return ([video, audio], torch.full((1,), 500.0), context), {"transformer_options": {},
                                                                    "minimax_payload": payload}


@dataclass(frozen=True)
class NativeComponent:
    """A text encoder or VAE of ComfyUI's at its released size, as its loaders build it (``comfy/sd.py``)."""

    name: str
    label: str
    cls: str  # "module:Class" in ComfyUI
    config: dict  # constructor arguments; a text model's: the name of ComfyUI's config file beside its class
    kind: str  # "text" or "vae"
    tokens: int = 0  # a text encoder: the padded prompt length ComfyUI's tokenizer gives
    compression: tuple[int, int] = (1, 1)  # a VAE: frames per latent frame, pixels per latent pixel

    def build(self, layers: int | None = None, dtype=torch.bfloat16) -> torch.nn.Module:
        """The module on ``meta`` (``layers``: a text model at reduced depth); a VAE's whole ``first_stage_model``."""
        import json

        import comfy.ops

        module_name, class_name = self.cls.split(":")
        module = importlib.import_module(module_name)
        cls = getattr(module, class_name)
        if self.kind == "text" and "file" not in self.config:  # a model whose configuration is its class's own
            config = {} if layers is None else {"num_hidden_layers": layers}
            with torch.device("meta"):
                return cls(config, dtype, "meta", comfy.ops.disable_weight_init)
        if self.kind == "text":
            config = json.loads((Path(module.__file__).parent / self.config["file"]).read_text())
            if layers is not None:
                config["num_layers"] = min(layers, config["num_layers"])
            return cls(config, dtype, "meta", comfy.ops.disable_weight_init)
        with torch.device("meta"):
            return cls(**self.config).to(dtype)


_WAN_VAE = dict(dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[], temperal_downsample=[False, True, True],
                dropout=0.0)
COMPONENTS: dict[str, NativeComponent] = {c.name: c for c in (
    NativeComponent("umt5-xxl", "umT5-XXL", "comfy.text_encoders.t5:T5", {"file": "umt5_config_xxl.json"}, "text",
                    tokens=512),
    NativeComponent("wan2.1-vae", "Wan 2.1 VAE", "comfy.ldm.wan.vae:WanVAE", dict(dim=96, z_dim=16, **_WAN_VAE),
                    "vae", compression=(4, 8)),
    NativeComponent("wan2.2-vae", "Wan 2.2 VAE", "comfy.ldm.wan.vae2_2:WanVAE", dict(dim=160, z_dim=48, **_WAN_VAE),
                    "vae", compression=(4, 16)),
    NativeComponent("qwen3vl-32b-minimax-h3", "Qwen3-VL 32B (50 layers)", "comfy.text_encoders.minimax:MiniMaxQwen3VL",
                    {}, "text", tokens=512),
    NativeComponent("minimax-h3-video-vae", "MiniMax H3 video VAE (ViT decoder)",
                    "comfy.ldm.minimax.vae:MiniMaxH3VideoVAE", {}, "vae", compression=(5, 16)),
)}


def _wan(dim: int, ffn: int, layers: int, model_type: str = "t2v", in_dim: int = 16, out_dim: int = 16, **extra):
    return dict(model_type=model_type, dim=dim, ffn_dim=ffn, num_heads=dim // 128, num_layers=layers, in_dim=in_dim,
                out_dim=out_dim, text_dim=4096, freq_dim=256, **extra)


WAN = "comfy.ldm.wan.model:WanModel"
LTXAV_FRAME_RATE = 25
LTXAV_AUDIO_LATENTS_PER_SECOND = 25  # 16 kHz, hop 160, 4 spectrogram frames a latent (ComfyUI's LTX-2 audio VAE)

# LTX-2 19B (Lightricks/LTX-2, ComfyUI 0.33's LTXAVModel): its defaults are the release's; ComfyUI's detection
# (model_detection.py) reads 48 blocks and attn2.to_k (4096 x 4096: 32 heads of 128, text 4096 wide) from the file.
# The context reaching the model is its two text connectors' output: 1024 tokens (the prompt, then learnable
# registers), the video's and the audio's 3840 features side by side.
LTX2_19B = dict(in_channels=128, audio_in_channels=128, cross_attention_dim=4096, audio_cross_attention_dim=2048,
                attention_head_dim=128, audio_attention_head_dim=64, num_attention_heads=32,
                audio_num_attention_heads=32, caption_channels=3840, num_layers=48)
# LTX-2.3 22B (Lightricks/LTX-2.3): the same stream widths, with the options its file's config sets (read as ComfyUI
# maps them; diffusers' conversion script names them gated_attn, cross_attn_mod, per_modality_projections): gated
# attention, cross-attention AdaLN with a prompt AdaLN, the text projected per stream by the text encoder (4096 video,
# 2048 audio features: the connectors take them as they are), connectors of 8 gated blocks as wide as each stream.
LTX23_22B = dict(LTX2_19B, apply_gated_attention=True, cross_attention_adaln=True, caption_proj_before_connector=True,
                 caption_projection_first_linear=False, connector_num_layers=8, connector_num_attention_heads=32,
                 connector_attention_head_dim=128, audio_connector_num_attention_heads=32,
                 audio_connector_attention_head_dim=64, connector_apply_gated_attention=True)
# HunyuanVideo 1.5 (tencent/HunyuanVideo-1.5, 8.3B; ComfyUI's HunyuanVideo class with 0.33's options, detection in
# model_detection.py): img_in 65 channels in (32 noise + 32 image condition + 1 mask, for T2V too), patch 1x1x1,
# 2048 wide (16 heads of 128), 54 double blocks and no single ones, Qwen 2.5-VL-7B text (3584), ByT5 glyph text,
# SigLIP image features (vision_in 1152: what tells 1.5), the condition-type embedding; no guidance embedding (the
# CFG-distilled files add one).
# MiniMax H3 as its released files load (model_detection.py): 50 blocks 5376 wide, 56 heads of 128, Qwen3-VL 32B's
# 5120-wide states, and the pruned form its templates load: each block's adaLN reads a small shared basis of the
# time-embedding curve (``adaln_t_table`` [grid, basis]) instead of the 2688-wide embedding. ComfyUI reads the basis
# width from the file; 64 is assumed here (20.4B weights, as the templates' 19.5 GB int8 file holds, against 33B with
# the full form's 2688).
MINIMAX_H3 = dict(hidden_size=5376, num_layers=50, token_refiner_num_layers=2, num_attention_heads=56,
                  attention_head_dim=128, ffn_hidden_size=14336, latents_dim=24, audio_latents_dim=32, text_dim=5120,
                  time_embed_dim=64, rope_inv_freq_len=16, adaln_curve_grid=1001)
HUNYUAN_VIDEO_15 = dict(image_model="hunyuan_video", in_channels=65, out_channels=32, vec_in_dim=None,
                        context_in_dim=3584, hidden_size=2048, mlp_ratio=4.0, num_heads=16, depth=54,
                        depth_single_blocks=0, axes_dim=[16, 56, 56], theta=256, patch_size=[1, 1, 1], qkv_bias=True,
                        guidance_embed=False, meanflow=False, byt5=True, use_cond_type_embedding=True,
                        vision_in_dim=1152, meanflow_sum=True)
ARCHITECTURES: dict[str, NativeArchitecture] = {a.name: a for a in (
    NativeArchitecture("wan2.1-t2v-1.3b", WAN, _wan(1536, 8960, 30), 16, (4, 8), (480, 832, 81), (512, 4096),
                       family="wan2.1-t2v-1.3b", text_encoder="umt5-xxl", vae="wan2.1-vae"),
    NativeArchitecture("wan2.1-t2v-14b", WAN, _wan(5120, 13824, 40), 16, (4, 8), (720, 1280, 81), (512, 4096),
                       family="wan2.1-t2v-14b", notes="also each expert of Wan 2.2 T2V A14B", text_encoder="umt5-xxl",
                       vae="wan2.1-vae"),
    NativeArchitecture("wan2.1-i2v-14b", WAN, _wan(5120, 13824, 40, "i2v", in_dim=36), 16, (4, 8),
                       (720, 1280, 81), (512, 4096), extra=("clip_fea",), family="wan2.1-i2v-14b-720p",
                       channels_in=36, text_encoder="umt5-xxl", vae="wan2.1-vae"),
    NativeArchitecture("wan2.2-ti2v-5b", WAN, _wan(3072, 14336, 30, in_dim=48, out_dim=48), 48, (4, 16),
                       (704, 1280, 121), (512, 4096), family="wan2.2-ti2v-5b", text_encoder="umt5-xxl",
                       vae="wan2.2-vae"),
    NativeArchitecture("wan2.1-vace-14b", "comfy.ldm.wan.model:VaceWanModel",
                       {k: v for k, v in _wan(5120, 13824, 40, vace_layers=8, vace_in_dim=96).items()
                        if k != "model_type"}, 16, (4, 8), (720, 1280, 81), (512, 4096), extra=("vace",),
                       text_encoder="umt5-xxl", vae="wan2.1-vae"),
    NativeArchitecture("hunyuanvideo", "comfy.ldm.hunyuan_video.model:HunyuanVideo",
                       dict(image_model="hunyuan_video", in_channels=16, out_channels=16, vec_in_dim=768,
                            context_in_dim=4096, hidden_size=3072, mlp_ratio=4.0, num_heads=24, depth=20,
                            depth_single_blocks=40, axes_dim=[16, 56, 56], theta=256, patch_size=[1, 2, 2],
                            qkv_bias=True, guidance_embed=True, meanflow=False, byt5=False),
                       16, (4, 8), (720, 1280, 129), (256, 4096), extra=("pooled", "guidance", "mask"),
                       layers_key="depth", params="comfy.ldm.hunyuan_video.model:HunyuanVideoParams",
                       later=(("use_cond_type_embedding", False), ("vision_in_dim", None), ("meanflow_sum", False))),
    NativeArchitecture("ltxv-2b", "comfy.ldm.lightricks.model:LTXVModel",
                       dict(in_channels=128, cross_attention_dim=2048, attention_head_dim=64, num_attention_heads=32,
                            caption_channels=4096, num_layers=28), 128, (8, 32), (512, 768, 121), (128, 4096),
                       extra=("mask", "frame_rate")),
    NativeArchitecture("ltxv-13b", "comfy.ldm.lightricks.model:LTXVModel",
                       dict(in_channels=128, cross_attention_dim=4096, attention_head_dim=128, num_attention_heads=32,
                            caption_channels=4096, num_layers=48), 128, (8, 32), (512, 768, 121), (128, 4096),
                       extra=("mask", "frame_rate")),
    NativeArchitecture("ltx2-19b", "comfy.ldm.lightricks.av_model:LTXAVModel", LTX2_19B, 128, (8, 32),
                       (512, 768, 121), (1024, 2 * 3840), audio=(8, 16), size_multiple=32,
                       notes="video with sound: the audio stream's latents beside the video's"),
    NativeArchitecture("ltx2.3-22b", "comfy.ldm.lightricks.av_model:LTXAVModel", LTX23_22B, 128, (8, 32),
                       (512, 768, 121), (1024, 4096 + 2048), audio=(8, 16), size_multiple=32,
                       notes="video with sound: the audio stream's latents beside the video's"),
    PackedAVArchitecture("minimax-h3", "comfy.ldm.minimax.model:MiniMaxH3Model", MINIMAX_H3, 24, (5, 16),
                         (736, 1280, 124), (512, MINIMAX_H3["hidden_size"]), size_multiple=32,
                         text_encoder="qwen3vl-32b-minimax-h3", vae="minimax-h3-video-vae",
                         notes="video with stereo sound, one packed sequence; the pruned (curve) form its templates "
                               "load; batch 1 (a CFG step is two calls)"),
    NativeArchitecture("hunyuanvideo1.5", "comfy.ldm.hunyuan_video.model:HunyuanVideo", HUNYUAN_VIDEO_15, 32,
                       (4, 16), (720, 1280, 121), (256, 3584), extra=("guidance",), layers_key="depth",
                       channels_in=65, size_multiple=16, notes="720p T2V and I2V (one architecture)"),
)}


def architecture(name: str) -> NativeArchitecture:
    found = ARCHITECTURES.get(name.strip().lower())
    if found is None:
        raise InputError(f"--comfy-model {name!r} is not a known ComfyUI architecture: use one of "
                         f"{', '.join(ARCHITECTURES)}")
    return found


def use_comfyui(path: str | None) -> Path | None:
    """Make ComfyUI's own code importable (``--comfy``: a ComfyUI folder), as the server with ``--cpu`` has it.
    Without a path, a ComfyUI already importable (this process runs inside it) is used."""
    if path:
        root = Path(path).expanduser().resolve()
        if not (root / "comfy" / "sd.py").is_file():
            raise InputError(f"--comfy {path}: no ComfyUI there (comfy/sd.py is missing): give the folder of a "
                             "ComfyUI checkout")
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
    try:
        import comfy.cli_args
    except ImportError:
        raise InputError("plan --comfy-model compiles ComfyUI's own model classes: give a ComfyUI folder with "
                         "--comfy COMFYUI_DIR") from None
    comfy.cli_args.args.cpu = True  # never probe for CUDA: the plan compiles for a TPU slice
    import comfy.model_management  # noqa: F401
    return Path(comfy.cli_args.__file__).resolve().parents[1]


def parameter_count(module: torch.nn.Module) -> int:
    return sum(math.prod(p.shape) for p in module.parameters())

