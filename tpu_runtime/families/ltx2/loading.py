"""How an LTX-2 model's components are built and where their tensors are (``LTX2Components``, a part of
``LTX2Family``): a diffusers folder (Gemma 3's text model out of its checkpoint), or ComfyUI's single files
(``files.py``: configs read from the shapes, keys mapped to diffusers' names), and the spatial latent upsampler
beside either."""

from __future__ import annotations

from pathlib import Path

from ...engine.components import ComponentSource, builder, model_class
from ...engine.folders import read_config
from ...errors import InputError, ModelFolderError

UPSAMPLER = "latent_upsampler"
# The classes of ComfyUI's single files' components (a diffusers folder names its own in model_index.json).
FILE_CLASSES = {"transformer": ("diffusers", "LTX2VideoTransformer3DModel"), "connectors": ("ltx2", "LTX2TextConnectors"),
                "vae": ("diffusers", "AutoencoderKLLTX2Video"), "audio_vae": ("diffusers", "AutoencoderKLLTX2Audio"),
                "text_encoder": ("transformers", "Gemma3TextModel")}


class LTX2Components:
    """The component sources of an LTX-2 model (a part of ``LTX2Family``)."""

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
        from ...engine.tokenizers import spiece_model
        from .architectures import SCHEDULER
        from .files import checkpoint_configs, config_overrides, gemma_names, upscaler_names

        overrides = config_overrides(files.config)
        configs, self._names = checkpoint_configs(files.checkpoint, overrides)
        self._vocoder_class = configs.pop("vocoder_class")["name"]
        text, self._names["text_encoder"] = gemma_names(files.text_encoder, overrides.get("text_encoder"))
        self.configs = {"text_encoder": {"model_type": "gemma3_text", **text}, **configs}
        if int(text["hidden_size"]) != int(configs["connectors"]["caption_channels"]):
            raise ModelFolderError(f"text encoder {files.text_encoder} gives {text['hidden_size']}-wide hidden states, "
                                   f"the checkpoint's connectors take {configs['connectors']['caption_channels']}: use "
                                   "the Gemma 3 12B file made for LTX-2")
        if files.tokenizer is None and spiece_model(files.text_encoder) is None:
            raise InputError(f"{files.text_encoder} carries no tokenizer (tensor spiece_model): use ComfyUI's Gemma 3 "
                             "file, which ships it, or give a Gemma tokenizer folder (--tokenizer)")
        if files.latent_upscaler is not None:
            self._upscaler_config, self._names[UPSAMPLER] = upscaler_names(files.latent_upscaler,
                                                                           overrides.get(UPSAMPLER))
        self.index = dict(FILE_CLASSES, vocoder=("ltx2", self._vocoder_class))
        self.scheduler_config = dict(SCHEDULER)

    # --- loading ---------------------------------------------------------------------------------------------
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
            from ...engine.tokenizers import SentencePieceTokenizer

            return SentencePieceTokenizer.from_file(self.files.text_encoder, bos=True, padding_side="left")
        folder = self.files.tokenizer if self.path is None else self.path / "tokenizer"
        tokenizer = AutoTokenizer.from_pretrained(folder)
        tokenizer.padding_side = "left"  # diffusers: Gemma takes left-padded prompts
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer
