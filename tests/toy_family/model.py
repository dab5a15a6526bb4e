"""The toy family: its modules, its family class (recognition, loading, stage programs) and its tiny builder."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tpu_runtime.engine.components import ComponentSource
from tpu_runtime.engine.family import ModelFamily
from tpu_runtime.engine.folders import inspect_folder, read_config, read_model_index
from tpu_runtime.engine.schedulers import linear_plan
from tpu_runtime.engine.stages import SampleSettings, SamplingRun, StageProgram, VideoLatents, config_signature
from tpu_runtime.engine.streaming import to_frames
from tpu_runtime.engine.validation import frame_problem, raise_problems, size_problems
from tpu_runtime.errors import InputError, ModelFolderError

from . import SPEC

TEXT_LEN, SCALE, T_SCALE = 8, 4, 4


@dataclass
class ToyOptions:
    """A setting the toy's constructor takes (a multi-host message carries it by value)."""

    noise_scale: float = 1.0


class ToyTextEncoder(torch.nn.Module):
    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)

    def forward(self, ids):
        return self.embed(ids)


class ToyDenoiser(torch.nn.Module):
    """A per-pixel MLP of the latents, the timestep and the mean of the text."""

    def __init__(self, channels: int, dim: int, text_dim: int, num_layers: int, num_attention_heads: int):
        super().__init__()
        self.proj_in = torch.nn.Linear(channels, dim)
        self.time = torch.nn.Linear(1, dim)
        self.text = torch.nn.Linear(text_dim, dim)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(num_layers))
        self.proj_out = torch.nn.Linear(dim, channels)

    def forward(self, x, t, text):
        h = self.proj_in(x.permute(0, 2, 3, 4, 1))  # [B, T, H, W, dim]
        cond = self.time(t[:, None] / 1000.0) + self.text(text.mean(dim=1))
        h = h + cond[:, None, None, None, :]
        for block in self.blocks:
            h = h + block(torch.nn.functional.silu(h))
        return self.proj_out(h).permute(0, 4, 1, 2, 3)


class ToyDecoder(torch.nn.Module):
    """Latents [1, C, T, h, w] -> pixels [1, 3, (T-1)*4+1, h*4, w*4] in -1..1."""

    def __init__(self, channels: int):
        super().__init__()
        self.out = torch.nn.Linear(channels, 3 * SCALE * SCALE)

    def forward(self, z):
        b, c, t, h, w = z.shape
        y = self.out(z.permute(0, 2, 3, 4, 1)).reshape(b, t, h, w, 3, SCALE, SCALE)
        y = y.permute(0, 4, 1, 2, 5, 3, 6).reshape(b, 3, t, h * SCALE, w * SCALE)
        return torch.tanh(y).repeat_interleave(T_SCALE, dim=2)[:, :, T_SCALE - 1:]


MODULES = {"text_encoder": ToyTextEncoder, "transformer": ToyDenoiser, "vae": ToyDecoder}


class ToyFamily(ModelFamily):
    SPEC = SPEC
    RULES = {"transformer": ((r"blocks\.\d+\.weight$", ("tp", None)), (r"blocks\.\d+\.bias$", ("tp",)))}

    def __init__(self, path, dtype="auto", runtime=None, mesh=None, attention=None, fsdp=False, vae_sharding="auto",
                 target_devices=None, *, index=None, layers=None, options: ToyOptions | None = None):
        self.path = Path(path)
        self.index = index if index is not None else read_model_index(self.path)
        if self.index.get("_class_name") != "ToyVideoPipeline":
            raise ModelFolderError(f"{self.path} is not a toy model")
        inspect_folder(self.path, self.index, required=tuple(MODULES), weights=target_devices is None)
        self.options = options or ToyOptions()
        self.configs = {name: read_config(self.path / name) for name in MODULES}
        self.configs["transformer"] = self._with_layers(self.configs["transformer"], layers)
        self.transformer_config = self.configs["transformer"]
        self.signature = config_signature(self.configs)
        self.generation = "1"
        self.vae_scale_spatial, self.vae_scale_temporal = SCALE, T_SCALE
        self._setup(dtype, runtime, mesh, attention, fsdp, heads=self.transformer_config["num_attention_heads"],
                    vae_sharding=vae_sharding, target_devices=target_devices)

    def _source(self, name):
        if name not in MODULES:
            raise KeyError(name)
        from tpu_runtime.engine.weights import safetensors_files

        cls, config = MODULES[name], self.configs[name]
        files = [] if self.abstract else safetensors_files(self.path / name)
        return ComponentSource(cls, lambda: cls(**config), files, f"toy {name}")

    def _load_tokenizer(self):
        vocab = self.configs["text_encoder"]["vocab"]
        return lambda text: [(sum(map(ord, word)) % (vocab - 1)) + 1 for word in text.split()][:TEXT_LEN]

    def native_size(self):
        return 16, 16, 5

    def default_fps(self):
        return 8

    def validate(self, height, width, num_frames):
        problem = frame_problem(num_frames, T_SCALE, 5, "the toy")
        raise_problems(size_problems(height, width, SCALE) + ([problem] if problem else []))

    def validate_settings(self, s: SampleSettings):
        if s.guidance is not None and s.guidance > 1:
            raise InputError(f"guidance={s.guidance}: the toy has no CFG: leave it at 1")

    def tokenize(self, texts):
        tokenizer = self.component("tokenizer")
        ids = torch.zeros(len(texts), TEXT_LEN, dtype=torch.int64)
        for row, text in enumerate(texts):
            found = tokenizer(text)
            ids[row, :len(found)] = torch.tensor(found, dtype=torch.int64)
        return (ids,)

    def text_shape(self):
        return (1, TEXT_LEN, self.configs["text_encoder"]["dim"])

    def latent_shape(self, height, width, num_frames):
        return (1, self.transformer_config["channels"], (num_frames - 1) // T_SCALE + 1, height // SCALE,
                width // SCALE)

    # --- the stage programs -----------------------------------------------------------------------------------
    def encode_program(self):
        self.component("text_encoder")
        fn = self.runtime.module_function(self.component("text_encoder"))
        return StageProgram("encode", fn, (self.state("text_encoder"), self.arg((2, TEXT_LEN), torch.int32)),
                            (TEXT_LEN,), "toy text encoder", self.traced, ("text_encoder",))

    def sample_program(self, height, width, num_frames, plan):
        import jax.numpy as jnp

        self.component("transformer")
        denoise = self.runtime.module_function(self.component("transformer"))
        shape = self.latent_shape(height, width, num_frames)

        def step_fn(state, x, text, timestep, matrix):
            out = denoise(state, x.astype(self.model_dtype()), timestep, text).astype(jnp.float32)
            return matrix[0, 0] * x + matrix[0, 1] * out

        example = (self.state("transformer"), self.arg(shape, torch.float32), self.arg(self.text_shape(), self.dtype),
                   self.arg((1,), torch.float32), self.arg(plan.matrices[0].shape, torch.float32))
        return StageProgram("sample", step_fn, example, (shape,), "toy sampler step", self.traced, ("transformer",))

    def sharpen_programs(self, z_shape):
        def sharpen_fn(state, z):  # a stage program takes its weights first: this one has none
            return z * 1.5

        return [StageProgram("sharpen", sharpen_fn, ({}, self.arg(z_shape, torch.float32)), (tuple(z_shape),),
                             "toy sharpen", self.traced, ())]

    def decode_programs(self, z_shape):
        fn = self.runtime.module_function(self.component("vae"))
        example = (self.state("vae"), self.arg(z_shape, torch.float32, self.vae_input_spec(z_shape)))
        return [StageProgram("decode", lambda state, z: to_frames(fn(state, z.astype(self.model_dtype()))), example,
                             (tuple(z_shape),), "toy VAE decode", self.traced, ("vae",))]

    def _plan(self, steps):
        from diffusers import FlowMatchEulerDiscreteScheduler

        return linear_plan(FlowMatchEulerDiscreteScheduler(shift=1.0), steps)

    def plan_programs(self, s: SampleSettings):
        self.check_settings(s)
        z_shape = self.latent_shape(s.height, s.width, s.num_frames)
        return [self.encode_program(), self.sample_program(s.height, s.width, s.num_frames, self._plan(s.steps)),
                *self.sharpen_programs(z_shape), *self.decode_programs(z_shape)]

    # --- the stages -------------------------------------------------------------------------------------------
    def sampling_run(self, embeddings, s, cfg, image=None, latents=None):
        plan = self._plan(s.steps)
        shape = self.latent_shape(s.height, s.width, s.num_frames)
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(int(s.seed)))
        noise = noise * self.options.noise_scale * self.option(s, "toy_noise")
        text = self.put(embeddings.prompt_embeds.to(self.dtype))

        def arguments(i, carry):
            return (carry[0], text, self.put(torch.tensor([float(plan.timesteps[i])])),
                    self.put(torch.from_numpy(plan.matrices[i])))

        def finish(carry):
            return VideoLatents(self.runtime.to_cpu(carry[0]), s.height, s.width, s.num_frames, self.signature)

        program = self.sample_program(s.height, s.width, s.num_frames, plan)
        return SamplingRun(program, ["transformer"] * plan.steps, (self.put(noise),), arguments, finish)

    def sharpen(self, latents):
        """The toy's own stage: the latents made sharper."""
        self.check_made_here(latents)
        z = latents.latents
        (out,) = self.run_stage(self.sharpen_programs(tuple(z.shape)), [self.put(z.float())])
        return VideoLatents(out, latents.height, latents.width, latents.num_frames, self.signature)

    def latent_channels(self):
        return self.transformer_config["channels"]


def sharpened_settings(family, settings):
    """The sharpened recipe samples once, with the settings asked."""
    return (settings,)


# --- the released models (plan) and the tiny builder ---------------------------------------------------------------
def _files(layers: int, dim: int) -> dict:
    return {
        "model_index.json": {"_class_name": "ToyVideoPipeline", "text_encoder": ["toy", "ToyTextEncoder"],
                             "transformer": ["toy", "ToyDenoiser"], "vae": ["toy", "ToyDecoder"]},
        "text_encoder/config.json": {"vocab": 64, "dim": 16},
        "transformer/config.json": {"channels": 4, "dim": dim, "text_dim": 16, "num_layers": layers,
                                    "num_attention_heads": 8},
        "vae/config.json": {"channels": 4},
    }


ARCHITECTURES = {"toy-1": _files(layers=12, dim=1024)}


def build_tiny_toy(folder, seed: int = 0) -> Path:
    """A tiny random-weight toy folder, in the layout the family reads."""
    from safetensors.torch import save_file

    folder = Path(folder)
    torch.manual_seed(seed)
    files = _files(layers=2, dim=32)
    for relative, content in files.items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_text(json.dumps(content))
    for name, cls in MODULES.items():
        module = cls(**files[f"{name}/config.json"])
        save_file({k: v.contiguous() for k, v in module.state_dict().items()},
                  str(folder / name / "diffusion_pytorch_model.safetensors"))
    return folder
