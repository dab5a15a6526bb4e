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
        return cls(**config, device="meta", dtype=dtype, operations=comfy.ops.disable_weight_init)

    def latent_shape(self, batch: int, height: int, width: int, frames: int) -> tuple[int, ...]:
        t, s = self.compression
        return (batch, self.channels_in or self.latent_channels, (frames - 1) // t + 1, height // s, width // s)

    def check_size(self, height: int, width: int, frames: int) -> None:
        t, s = self.compression
        if height % (2 * s) or width % (2 * s):
            raise InputError(f"--height/--width {height}x{width}: {self.name} takes multiples of {2 * s}")
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
        return (x, t, context), kwargs

    @property
    def heads(self) -> int:
        for key in ("num_heads", "num_attention_heads"):
            if key in self.config:
                return self.config[key]
        return 1


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
)}


def _wan(dim: int, ffn: int, layers: int, model_type: str = "t2v", in_dim: int = 16, out_dim: int = 16, **extra):
    return dict(model_type=model_type, dim=dim, ffn_dim=ffn, num_heads=dim // 128, num_layers=layers, in_dim=in_dim,
                out_dim=out_dim, text_dim=4096, freq_dim=256, **extra)


WAN = "comfy.ldm.wan.model:WanModel"
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
                       layers_key="depth"),
    NativeArchitecture("ltxv-2b", "comfy.ldm.lightricks.model:LTXVModel",
                       dict(in_channels=128, cross_attention_dim=2048, attention_head_dim=64, num_attention_heads=32,
                            caption_channels=4096, num_layers=28), 128, (8, 32), (512, 768, 121), (128, 4096),
                       extra=("mask", "frame_rate")),
    NativeArchitecture("ltxv-13b", "comfy.ldm.lightricks.model:LTXVModel",
                       dict(in_channels=128, cross_attention_dim=4096, attention_head_dim=128, num_attention_heads=32,
                            caption_channels=4096, num_layers=48), 128, (8, 32), (512, 768, 121), (128, 4096),
                       extra=("mask", "frame_rate")),
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

