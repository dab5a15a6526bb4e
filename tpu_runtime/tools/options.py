"""Command-line options more than one command shares, defined once: the single-file options (one per file role any
family loads), the families' own settings and recipes (each family's declaration's, from the registry) and the step
cache's."""

from __future__ import annotations

import argparse


def add_file_args(p: argparse.ArgumentParser) -> None:
    """One option per single-file role any family loads (the registry's)."""
    from ..families import registry

    families = ", ".join(s.display_name for s in registry.FAMILIES if s.file_roles)
    files = p.add_argument_group(f"ComfyUI's single files, in place of --model ({families})")
    for role in registry.file_roles().values():
        files.add_argument(role.flag, dest=f"file_{role.name}", metavar="DIR" if role.directory else "FILE",
                           help=role.help)


def add_family_args(p: argparse.ArgumentParser, stages=("sample", "decode", "open")) -> None:
    """One option per setting of ``stages`` any family declares, and one per recipe, in a group per family; a
    setting left out is None (the model's default)."""
    from ..families import registry

    seen = set()
    for spec in registry.FAMILIES:
        settings = [s for s in spec.settings if s.cli and s.stage in stages and s.option not in seen]
        recipes = [r for r in spec.recipes if r.option not in seen] if "sample" in stages else []
        if not settings and not recipes:
            continue
        group = p.add_argument_group(f"{spec.display_name} (each left out: the model's default)")
        for setting in settings:
            seen.add(setting.option)
            whose = registry.owners(registry.settings_of(setting.stage)[setting.option][1])
            help = setting.help if setting.kind is bool else f"{setting.help} (default: {setting.default_text()})"
            if whose != spec.display_name:
                help = f"{whose}: {help}"
            if setting.kind is bool:
                group.add_argument(setting.option, dest=setting.dest, action="store_true", default=None, help=help)
            else:
                group.add_argument(setting.option, dest=setting.dest, help=help, type=setting.kind if not
                                   setting.choices else str, choices=setting.choices or None)
        for recipe in recipes:
            seen.add(recipe.option)
            group.add_argument(recipe.option, dest="recipe", action="store_const", const=recipe.name,
                               help=recipe.help)


def file_args(args: argparse.Namespace) -> dict[str, str]:
    return {k[len("file_"):]: v for k, v in vars(args).items() if k.startswith("file_") and v}


def add_cache_args(p: argparse.ArgumentParser, calibrate: bool = True) -> None:
    """Step caching: skip whole transformer passes as diffusers' MagCache / FirstBlockCache hooks do."""
    g = p.add_argument_group("step caching (skip transformer passes; frames equal diffusers' MagCache and "
                             "FirstBlockCache hooks)")
    g.add_argument("--cache", choices=["none", "magcache", "first-block"], default="none",
                   help="magcache: skips fixed in advance by calibrated ratios (published ones ship for some "
                   "released models); first-block: skip when the first block's output barely changes (one number "
                   "read back a step)")
    g.add_argument("--cache-threshold", type=float, help="skip while the error stays at or under this (default: "
                   "0.06 magcache, 0.05 first-block, as diffusers)")
    g.add_argument("--cache-max-skip", type=int, help="magcache: at most this many steps skipped in a row "
                   "(default: 3)")
    g.add_argument("--cache-retention", type=float, help="magcache: this fraction of each transformer's first "
                   "steps always runs (default: 0.2)")
    g.add_argument("--mag-ratios", metavar="RATIOS|FILE", help="magcache: ratios as comma-separated numbers, or a "
                   "JSON file (a list, or one list per transformer as --cache-calibrate writes); default: the "
                   "model's published ones")
    if calibrate:
        g.add_argument("--cache-calibrate", action="store_true", help="with --cache magcache: skip nothing, and "
                       "write this model's ratios (for these settings) to mag_ratios.json in --output-dir")


def step_cache(method: str = "none", threshold=None, max_skip=None, retention=None, mag_ratios=None,
               calibrate: bool = False, where: str = "--"):
    """The StepCache these options ask for (None: no caching), checked; options that do nothing with the method
    chosen are refused, not ignored."""
    from ..engine.stages import StepCache
    from ..engine.stepcache import parse_mag_ratios
    from ..errors import InputError

    node = {"cache": "method", "cache_threshold": "threshold", "cache_max_skip": "max_skip",
            "cache_retention": "retention", "cache_calibrate": "calibrate"}

    def flag(name: str) -> str:  # how the user named it: the option, or the node's input
        return f"--{name.replace('_', '-')}" if where == "--" else node.get(name, name)

    given = {name: v for name, v in (("cache_threshold", threshold), ("cache_max_skip", max_skip),
                                     ("cache_retention", retention), ("mag_ratios", mag_ratios),
                                     ("cache_calibrate", calibrate)) if v not in (None, False)}
    if method in (None, "none"):
        if given:
            raise InputError(f"{', '.join(flag(n) for n in given)} set the step cache: add {flag('cache')} magcache "
                             "or first-block, or drop them")
        return None
    if method == "first-block":
        magcache_only = [flag(n) for n in ("cache_max_skip", "cache_retention", "mag_ratios", "cache_calibrate")
                         if n in given]
        if magcache_only:
            raise InputError(f"{', '.join(magcache_only)}: MagCache's, use with {flag('cache')} magcache")
    if calibrate and mag_ratios is not None:
        raise InputError(f"{flag('cache_calibrate')} measures the ratios: drop {flag('mag_ratios')}")
    cache = StepCache(method, threshold=threshold, max_skip=3 if max_skip is None else max_skip,
                      retention=0.2 if retention is None else retention,
                      mag_ratios=parse_mag_ratios(mag_ratios, flag("mag_ratios")) if mag_ratios is not None else None,
                      calibrate=bool(calibrate))
    cache.check()
    return cache
