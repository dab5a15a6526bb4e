"""A family's own settings, declared once (``Setting``), and what the engine knows of every family's.

A family declares each setting only its models take (a sampler option such as Wan's flow ``shift``, a decode option
such as CogVideoX's VAE ``tiling``, a loader option such as LTX-2's ``upsampler``) in its ``FamilySpec``: name,
type, the model's default, help and limits. The command line's options, the ComfyUI nodes' inputs, ``plan``'s
defaults and the checks below are made from those declarations; no shared module names one.

The registry tells the engine every registered family's settings (``catalogue.py``), so that the engine, which knows
no family, can say whose option a value given to another family's model is. Importing this module imports no
torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import InputError
from .catalogue import is_declared

STAGES = ("sample", "decode", "open")


@dataclass(frozen=True)
class Setting:
    """One setting of a family's models.

    ``stage``: "sample" (an option of ``SampleSettings``), "decode" (a keyword of ``decode``) or "open" (a keyword
    of the family's constructor: the loader's). ``default``: the value the model uses when the setting is left
    unset; None when the model decides (``default_help`` says how, e.g. "the model's scheduler config").
    ``minimum`` / ``above`` / ``below`` / ``choices``: what a value must be. ``flag``: the command-line option
    (default ``--`` and the name with dashes); ``cli``: whether it has one. ``node``: the section of the ComfyUI
    node's inputs it is in ("required", "optional"; None: no input), after the inputs every node of its kind has;
    ``node_name``: the input's name where ComfyUI's own nodes call the same thing otherwise (``audio_cfg`` for
    ``audio_guidance``); a number the model decides (no ``default``) is an optional input left unconnected for the
    model's value, never a widget with a magic value; ``node_unset``: the choice (or empty text) that means "the
    model's" for a setting of choices or text; ``node_max`` / ``node_step``: the widget's range where the rule has
    no upper bound."""

    name: str
    kind: type = float
    help: str = ""
    default: Any = None
    default_help: str = ""
    minimum: float | None = None
    above: float | None = None
    below: float | None = None
    choices: tuple = ()
    stage: str = "sample"
    flag: str = ""
    cli: bool = True
    node: str | None = "required"
    node_name: str = ""
    node_unset: Any = None
    node_max: float | None = None
    node_step: float | None = None

    def __post_init__(self):
        if self.stage not in STAGES:
            raise ValueError(f"setting {self.name}: stage must be one of {STAGES}, got {self.stage!r}")
        if self.model_decides and self.node == "required":
            raise ValueError(f"setting {self.name}: the model decides its value, so its node input is optional (left "
                             "unconnected for the model's), not required")
        if self.model_decides and self.node_unset is not None:
            raise ValueError(f"setting {self.name}: a number the model decides has no 'unset' widget value; its "
                             "input is left unconnected instead")

    @property
    def model_decides(self) -> bool:
        """A number with no default of its own: the loaded model's value unless one is given."""
        return self.default is None and self.kind in (int, float)

    @property
    def input_name(self) -> str:
        """The ComfyUI node input that sets it."""
        return self.node_name or self.name

    @property
    def option(self) -> str:
        """The command-line option that sets it."""
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def dest(self) -> str:
        """The option's name as a keyword (``--vae-tiling`` -> ``vae_tiling``)."""
        return self.option.lstrip("-").replace("-", "_")

    def default_text(self) -> str:
        """The default as help texts say it."""
        if self.default is None:
            return self.default_help or "the model's"
        if isinstance(self.default, float):
            return f"{self.default:g}"
        return str(self.default)

    def check(self, value, given: str | None = None) -> None:
        """Refuse ``value`` unless it is this setting's kind and within its rule (None: unset, the default).
        ``given``: how the user named it (the option, or the name), for the message."""
        from .validation import check_number

        if value is None:
            return
        name = given or self.name
        if self.kind is bool:
            if not isinstance(value, bool):
                raise InputError(f"{name}={value!r} must be true or false")
        elif self.choices:
            if value not in self.choices:
                raise InputError(f"{name}={value!r}: choose one of {', '.join(map(str, self.choices))}")
        elif self.kind in (int, float):
            check_number(name, value, minimum=self.minimum, above=self.above, below=self.below,
                         integer=self.kind is int, optional=True)


# --- settings objects that carry a family's options by name -------------------------------------------------------
def takes_options(cls):
    """A dataclass with an ``options`` field (a family's own settings by name) that also takes them as keywords:
    ``SampleSettings(64, 96, 9, shift=5.0)`` is ``SampleSettings(64, 96, 9, options={"shift": 5.0})``. Reading an
    option as an attribute gives its value, or None for a declared setting left unset (the model's default)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    init = cls.__init__

    def __init__(self, *args, options=None, **kwargs):
        extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in fields}
        init(self, *args, options={**(options or {}), **extra}, **kwargs)

    def __getattr__(self, name):
        if name.startswith("_") or name == "options":
            raise AttributeError(name)
        options = self.__dict__.get("options") or {}
        if name in options:
            return options[name]
        if is_declared(name):
            return None
        raise AttributeError(f"{type(self).__name__} has no setting {name!r}")

    __init__.__wrapped__ = init
    cls.__init__ = __init__
    cls.__getattr__ = __getattr__
    return cls
