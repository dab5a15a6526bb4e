"""The family registry: every model family the pack runs, and the one place that picks a family for what a user
points at. A new family is a package beside these (``families/<name>/``) and one line in ``FAMILIES``.

Everything that depends on the family asks here: opening a model (``open_model``: a diffusers folder by its
``model_index.json``, or single files by their tensors), ``plan``'s known models, ``bench`` and the CLI's demos,
the multi-host worker (family classes by name) and its codec (settings types), the ComfyUI loaders' folder lists
and the node classes. Importing this module is cheap: the declarations import no torch and touch no device.
"""

from __future__ import annotations

from pathlib import Path

from ..engine import catalogue
from ..errors import InputError, ModelFolderError
from .cogvideox import SPEC as COGVIDEOX
from .ltx2 import SPEC as LTX2
from .spec import Demo, FamilySpec, Recipe, Setting
from .wan import SPEC as WAN

FAMILIES: list[FamilySpec] = []


def register(spec: FamilySpec) -> FamilySpec:
    """Add a family (this package's, or one declared outside it: a plugin, the tests' minimal family). Its name
    must be new. Its settings and LoRA key names become known to the engine."""
    if any(s.name == spec.name for s in FAMILIES):
        raise ValueError(f"a family named {spec.name!r} is registered already")
    FAMILIES.append(spec)
    catalogue.declare(spec.display_name, spec.settings, spec.lora_keys)
    return spec


def unregister(name: str) -> None:
    for spec in [s for s in FAMILIES if s.name == name]:
        catalogue.withdraw(spec.display_name)
    FAMILIES[:] = [s for s in FAMILIES if s.name != name]


for _spec in (COGVIDEOX, WAN, LTX2):
    register(_spec)


def spec_named(name: str) -> FamilySpec:
    for spec in FAMILIES:
        if spec.name == name:
            return spec
    raise KeyError(name)


def family_class(spec: FamilySpec) -> type:
    cls = spec.load(spec.family_class)
    if cls.SPEC is not spec:
        raise TypeError(f"{cls.__name__}.SPEC is not the declaration of family {spec.name!r}")
    if (cls.STEP_CACHE_BLOCKS is not None) != spec.step_cache:
        raise TypeError(f"{cls.__name__}.STEP_CACHE_BLOCKS is {cls.STEP_CACHE_BLOCKS!r}, its declaration says "
                        f"step_cache={spec.step_cache}")
    return cls


def family_class_named(class_name: str) -> type:
    """The family class called ``class_name`` (a multi-host message names it)."""
    for spec in FAMILIES:
        cls = family_class(spec)
        if cls.__name__ == class_name:
            return cls
    raise InputError(f"no model family is called {class_name}: every host must run the same version of the pack")


def message_types() -> tuple[type, ...]:
    return tuple(spec.load(ref) for spec in FAMILIES for ref in spec.message_types)


def pipelines() -> tuple[str, ...]:
    return tuple(p for spec in FAMILIES for p in spec.pipelines)


# --- what families declare they take --------------------------------------------------------------------------
def settings_of(stage: str) -> dict[str, tuple[Setting, list[FamilySpec]]]:
    """Every family's settings of ``stage`` ("sample", "decode", "open") by command-line option: the declaration
    (the first family's, where several declare one) and the families that declare it."""
    out: dict[str, tuple[Setting, list[FamilySpec]]] = {}
    for spec in FAMILIES:
        for setting in spec.settings_of(stage):
            out.setdefault(setting.option, (setting, []))[1].append(spec)
    return out


def setting_by_dest(dest: str) -> Setting | None:
    """The setting a keyword names as the command line does (``vae_tiling`` for ``--vae-tiling``), or None."""
    for spec in FAMILIES:
        for setting in spec.settings:
            if setting.dest == dest:
                return setting
    return None


def recipes() -> dict[str, tuple[Recipe, list[FamilySpec]]]:
    """Every family's recipes by name, with the families that have one of that name."""
    out: dict[str, tuple[Recipe, list[FamilySpec]]] = {}
    for spec in FAMILIES:
        for recipe in spec.recipes:
            out.setdefault(recipe.name, (recipe, []))[1].append(spec)
    return out


def owners(specs: list[FamilySpec]) -> str:
    return " and ".join(s.display_name for s in specs)


# --- released architectures (plan) and tiny demos ----------------------------------------------------------------
def architectures() -> dict[str, tuple[FamilySpec, dict]]:
    """Every released model ``plan`` knows by name: name -> (family, its config-only folder as files)."""
    return {name: (spec, files) for spec in FAMILIES if spec.architectures
            for name, files in spec.load(spec.architectures).items()}


def known_models() -> list[str]:
    return list(architectures())


# The keys of a known model's entry that are facts about it, not files of its folder: where it is published, and
# the sampling settings its release is run with where they differ from the family's defaults (a distilled model).
ENTRY_FACTS = ("repo", "sampling")


def architecture_sampling(name: str) -> dict:
    """The sampling settings known model ``name`` is released to run with (SampleSettings fields; empty: the
    family's defaults)."""
    entry = architectures().get(name.lower())
    return dict(entry[1].get("sampling", {})) if entry else {}


def write_architecture(name: str, folder: str | Path) -> Path:
    """Write the config-only model folder of known model ``name`` into ``folder`` and return it."""
    import json

    known = architectures()
    key = name.lower()
    if key not in known:
        raise InputError(f"{name!r} is not a known model: use a model folder, single files, or one of "
                         f"{', '.join(known)}")
    root = Path(folder) / key
    for relative, content in known[key][1].items():
        if relative in ENTRY_FACTS:
            continue
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content, indent=2))
    return root


def demos() -> dict[str, tuple[FamilySpec, Demo]]:
    """Every tiny random-weight demo model: name -> (family, how to build it)."""
    return {name: (spec, demo) for spec in FAMILIES for name, demo in spec.demos.items()}


# --- opening a model -----------------------------------------------------------------------------------------
def file_roles() -> dict:
    """Every single-file role any family loads, by name (the CLI's single-file options)."""
    import dataclasses

    roles, helps = {}, {}
    for spec in FAMILIES:
        for role in spec.file_roles:
            roles.setdefault(role.name, role)
            helps.setdefault(role.name, []).append(f"{spec.display_name}: {role.help}")
    # a role two families share (--text-encoder) says what each of them takes
    return {name: role if len(helps[name]) == 1 else dataclasses.replace(role, help="; ".join(helps[name]))
            for name, role in roles.items()}


def spec_for_folder(path: Path, index: dict) -> FamilySpec:
    """The family that runs the pipeline ``index`` names, or a message saying what the folder holds."""
    cls = index.get("_class_name", "")
    for spec in FAMILIES:
        if cls in spec.pipelines:
            return spec
    for spec in FAMILIES:
        if spec.pipeline_prefix and cls.startswith(spec.pipeline_prefix):
            raise ModelFolderError(f"{path} holds a {cls} model; {spec.unsupported}")
    names = ", ".join(s.display_name for s in FAMILIES)
    raise ModelFolderError(f"{path} holds a {cls or 'unknown'} model: this pack runs {names} models; pick one of "
                           "those folders")


def spec_for_files(files: dict[str, Path]) -> FamilySpec:
    """The family whose single files these are: the one that recognises them by their tensors, else the only one
    that loads every role given (its own checks then say what is wrong with them)."""
    for spec in FAMILIES:
        if spec.recognise_files is not None and spec.load(spec.recognise_files)(files):
            return spec
    fitting = [s for s in FAMILIES if s.file_roles and set(files) <= {r.name for r in s.file_roles}]
    if len(fitting) == 1:
        return fitting[0]
    raise InputError(f"the files given ({', '.join(f'{k}={Path(v).name}' for k, v in files.items())}) are not a "
                     f"model this pack loads from single files")


def open_model(model: str | None = None, files: dict[str, str | Path] | None = None, **options):
    """The loaded family for ``model`` (a diffusers folder, or a hub id with network) or for single ``files``
    (role name -> path). ``options`` go to the family (dtype, runtime, mesh, attention, fsdp, vae_sharding,
    target_devices, layers)."""
    from ..engine.folders import read_model_index, resolve_model_path

    files = {k: Path(v).expanduser() for k, v in (files or {}).items() if v}
    roles = file_roles()
    flags = lambda names: ", ".join(roles[n].flag if n in roles else n for n in names)  # noqa: E731
    if model and files:
        raise InputError(f"give --model or the single files ({flags(files)}), not both")
    if files:
        spec = spec_for_files(files)
        own = {r.name: r for r in spec.file_roles}
        missing = [n for n, r in own.items() if r.required and n not in files]
        if missing:
            raise InputError(f"single-file {spec.display_name} needs {flags(missing)} too ("
                             + "; ".join(own[n].help for n in missing) + ")")
        return family_class(spec)(files=files, **options)
    if not model:
        singles = "; ".join(f"{s.display_name}: {flags([r.name for r in s.file_roles if r.required])}"
                            for s in FAMILIES if s.file_roles)
        raise InputError("--model is required (a diffusers folder of "
                         f"{', '.join(s.display_name for s in FAMILIES)}), or single files ({singles})")
    path = resolve_model_path(model)
    if path.is_file() and path.suffix == ".safetensors":
        raise InputError(f"{path} is a single file: pass ComfyUI's model files with their own options ("
                         f"{flags(roles)}) instead of --model")
    index = read_model_index(path, example=FAMILIES[0].example_repo)
    spec = spec_for_folder(path, index)
    cls = family_class(spec)
    _check_options(spec, cls, options)
    return cls(path, index=index, **options)


def _check_options(spec: FamilySpec, cls: type, options: dict) -> None:
    """Refuse an option the family's models do not take (e.g. LTX-2's --upsampler for Wan), naming it."""
    import inspect

    accepted = inspect.signature(cls).parameters
    if any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        return
    foreign = [name for name in options if name not in accepted]
    if foreign:
        raise InputError(f"{', '.join('--' + n.replace('_', '-') for n in foreign)}: not an option of "
                         f"{spec.display_name} models; leave it out")
