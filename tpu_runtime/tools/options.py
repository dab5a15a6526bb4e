"""Command-line options more than one command shares, defined once: the single-file options (one per file role any
family loads, from the registry)."""

from __future__ import annotations

import argparse


def add_file_args(p: argparse.ArgumentParser) -> None:
    """One option per single-file role any family loads (the registry's)."""
    from ..families import registry

    families = ", ".join(s.display_name for s in registry.FAMILIES if s.file_roles)
    files = p.add_argument_group(f"ComfyUI's single files, in place of --model ({families})")
    for role in registry.file_roles().values():
        files.add_argument(role.flag, dest=f"file_{role.name}", metavar="FILE", help=role.help)


def file_args(args: argparse.Namespace) -> dict[str, str]:
    return {k[len("file_"):]: v for k, v in vars(args).items() if k.startswith("file_") and v}
