"""What a model checks before anything compiles (``Checks``, a part of ``ModelFamily``): the settings (every
number against its rule, the family's own options against their declarations, another family's options refused),
the images an image-to-video model takes, where stage values come from, the mesh against the CFG batch.

Zero and negative values are refused, never replaced; an option of another family's models is refused, never
ignored."""

from __future__ import annotations

from ..errors import InputError, StageFileError
from .catalogue import owners
from .sharding import validate_mesh
from .stages import ImageConditioning, SampleSettings, TextEmbeddings, VideoLatents
from .validation import check_number


class Checks:
    """The checks of a model (a part of ``ModelFamily``). A family implements ``validate`` (the sizes it takes)
    and may add its own rules in ``validate_settings``."""

    image_input = "none"  # "none": text-to-video; "required": image-to-video; "optional": either (Wan TI2V-5B)
    last_image_input = False  # a last image as well as the first (Wan FLF2V)

    def validate(self, height: int, width: int, num_frames: int) -> None:
        """Raise ``InputError`` for sizes this model cannot take, before anything compiles."""
        raise NotImplementedError

    def validate_settings(self, s: SampleSettings) -> None:
        """The family's own rules for settings ``s`` beyond each setting's declared limits (none by default)."""

    # --- settings ------------------------------------------------------------------------------------------------
    def check_settings(self, s: SampleSettings) -> None:
        """Settings a model can run, checked before anything runs: every number against its rule, the sizes, the
        family's own options against their declarations (another family's refused), the family's own rules, the
        scheduler, the LoRA slots and the step cache."""
        check_number("steps", s.steps, minimum=1, integer=True)
        check_number("seed", s.seed, minimum=0, integer=True)
        check_number("guidance", s.guidance, minimum=0.0, optional=True)
        self.validate(s.height, s.width, s.num_frames)
        self.check_options(s.options, "sample")
        self.validate_settings(s)
        schedulers = self.SPEC.sampling.schedulers
        if s.scheduler is not None and s.scheduler not in schedulers:
            pick = f"pick one of {list(schedulers)}" if schedulers else "leave scheduler unset (the model's own)"
            raise InputError(f"scheduler {s.scheduler!r} is not one {self.FAMILY_NAME} uses: {pick}")
        self.lora_targets(s)
        self.check_step_cache(s)

    def check_options(self, given: dict, stage: str) -> dict:
        """The family's own options of ``stage`` in ``given`` (name -> value; None: unset) checked against their
        declarations, and returned with every one left unset at its default. An option of another family's models
        (given a value) is refused, naming whose it is."""
        own = {setting.name: setting for setting in self.SPEC.settings_of(stage)}
        for name, value in given.items():
            if name in own:
                own[name].check(value)
            elif value is not None and value is not False:
                whose = owners(name)
                if not whose:
                    raise InputError(f"{name}={value!r} is no {'sampler' if stage == 'sample' else stage} option of "
                                     f"any model family: leave it out")
                raise InputError(f"{name}={value!r} is an option of {' and '.join(whose)} models; {self.label} is a "
                                 f"{self.FAMILY_NAME} model: leave {name} unset")
        return {name: setting.default if given.get(name) is None else given[name] for name, setting in own.items()}

    def option(self, s: SampleSettings, name: str):
        """The value of this family's sampler option ``name`` in settings ``s``: given, else its default."""
        value = s.options.get(name)
        return self.SPEC.setting(name).default if value is None else value

    # --- images --------------------------------------------------------------------------------------------------
    def check_images(self, image_given: bool, last_image_given: bool, how: tuple[str, str] = ("--image",
                     "--last-image")) -> None:
        """Refuse an image this model does not take, or a missing one it needs (``how``: what the user sets)."""
        first, last = how
        if self.image_input == "none" and (image_given or last_image_given):
            raise InputError(f"{self.label} is a text-to-video model and takes no image: drop {first}, or load an "
                             "image-to-video model")
        if self.image_input == "required" and not image_given:
            raise InputError(f"{self.label} is an image-to-video model: give the first frame with {first}")
        if last_image_given and not self.last_image_input:
            raise InputError(f"{self.label} takes only a first image: drop {last} (first-and-last-frame models take "
                             "both)")
        if self.last_image_input and image_given and not last_image_given:
            raise InputError(f"{self.label} makes a video between a first and a last frame: give {last} too")
        if last_image_given and not image_given:
            raise InputError(f"{last} needs {first} as well (the first frame)")

    def check_conditioning(self, image: "ImageConditioning | None", s: SampleSettings) -> None:
        """Refuse sampling without the image an image-to-video model needs, or with one made for another model
        or another video size."""
        if image is None:
            if self.image_input == "required":
                raise InputError(f"{self.label} is an image-to-video model: encode the first frame (image encode "
                                 "stage) and pass it to the sampler")
            return
        if self.image_input == "none":
            raise InputError(f"{self.label} is a text-to-video model and takes no image: disconnect the image")
        if image.model_signature != self.signature:
            raise StageFileError("the image was encoded by a different model than the one sampling: re-run the "
                                 "image encode stage with this model")
        self._check_size("the image was encoded", image, s, "encode it at the sampler's size, or set the sampler "
                         "to the image encode's size")

    def _check_size(self, made_what: str, value, s: SampleSettings, fix: str) -> None:
        made, asked = (value.height, value.width, value.num_frames), (s.height, s.width, s.num_frames)
        if made != asked:
            raise InputError(f"{made_what} for {made[2]} frames of {made[1]}x{made[0]} (width x height), the sampler "
                             f"asks for {asked[2]} frames of {asked[1]}x{asked[0]}: {fix}")

    # --- stage values ----------------------------------------------------------------------------------------------
    def check_made_here(self, value: "TextEmbeddings | VideoLatents") -> None:
        """Refuse embeddings or latents that a model of another architecture made."""
        if value.model_signature == self.signature:
            return
        if isinstance(value, TextEmbeddings):
            raise StageFileError("the text embeddings were made by a different model than the one sampling: "
                                 "re-run the text encode stage with this model")
        raise StageFileError("the latents were sampled by a different model than the one decoding: decode with "
                             "the model that sampled them, or re-run sampling")

    def check_embeddings(self, embeddings: TextEmbeddings, expected: tuple[int, ...]) -> None:
        self.check_made_here(embeddings)
        if tuple(embeddings.prompt_embeds.shape) != tuple(expected):
            raise StageFileError(
                f"text embeddings have shape {tuple(embeddings.prompt_embeds.shape)}, this model takes "
                f"{tuple(expected)}: re-run the text encode stage with this model"
            )

    def check_latents(self, latents: VideoLatents) -> None:
        """Refuse latents another model made, or not shaped as this model's VAE decodes them."""
        self.check_made_here(latents)
        z, channels, s = latents.latents, self.latent_channels(), self.vae_scale_spatial
        if z.ndim != 5 or z.shape[0] != 1 or z.shape[1] != channels:
            raise StageFileError(f"latents have shape {tuple(z.shape)}; this model's VAE decodes [1, {channels}, T, "
                                 f"H/{s}, W/{s}]")

    def check_refine(self, latents: VideoLatents, s: SampleSettings, image) -> None:
        """Refuse latents to refine (sampling from given latents: a recipe's later stage) that this model did not
        make, at another size, or with an image (the latents hold it already)."""
        if not self.SPEC.sampling.refine:
            raise InputError(f"{self.label} samples from noise only: it takes no latents to refine")
        self.check_made_here(latents)
        if image is not None:
            raise InputError("refining upsampled latents takes no image: the first stage's latents already hold it")
        self._check_size("the latents to refine are", latents, s, "set the sampler to the upsampled size")

    # --- the CFG batch -------------------------------------------------------------------------------------------
    def uses_cfg(self, s: SampleSettings) -> bool:
        """Whether settings ``s`` sample with the CFG batch (negative and positive prompt), as diffusers decides:
        guidance above 1."""
        return (self.DEFAULT_GUIDANCE if s.guidance is None else float(s.guidance)) > 1.0

    def check_cfg_mesh(self, cfg: bool) -> None:
        validate_mesh(self.mesh_spec, len(self.devices), self.heads, batch=2 if cfg else 1)

    def check_sample(self, embeddings: TextEmbeddings, s: SampleSettings, image: "ImageConditioning | None",
                     cfg: bool) -> None:
        """Everything a sampling run checks before it compiles: the settings, the image, where the embeddings
        come from, the mesh against the CFG batch; then the LoRAs are merged (a LoRA that does not fit is refused
        before anything compiles)."""
        self.check_settings(s)
        self.check_conditioning(image, s)
        self.check_embeddings(embeddings, self.text_shape())
        self.check_cfg_mesh(cfg)
        self.apply_loras(self.lora_targets(s))
