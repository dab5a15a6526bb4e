"""``python -m tpu_runtime cache show|clear``: what the runtime keeps on disk between processes, and removing it.

Two things live in the cache folder (``--cache-dir``, else ``$TPU_VIDEO_CACHE_DIR``, else
``~/.cache/tpu_video_nodes/xla_cache``): JAX's persistent XLA compilation cache (its files directly in the folder)
and the programs saved for later processes (``programs/``, see ``engine/program_store.py``). ``show`` lists both,
and the read-only folders ``$TPU_VIDEO_PROGRAMS`` names; ``clear`` empties the cache folder (``--programs-only``:
the saved programs alone). Neither starts JAX or touches a device: a server may hold the TPU meanwhile.
"""

from __future__ import annotations

import time
from pathlib import Path

_XLA_SUFFIXES = ("-cache", "-atime")  # JAX's compilation cache files


def add_args(p) -> None:
    p.add_argument("action", choices=["show", "clear"], help="show: list what is cached and its size; clear: remove "
                   "it")
    p.add_argument("--cache-dir", help="the cache folder (default: $TPU_VIDEO_CACHE_DIR or "
                   "~/.cache/tpu_video_nodes/xla_cache)")
    p.add_argument("--programs-only", action="store_true", help="clear: remove the saved programs only, keep the XLA "
                   "compilation cache")
    p.add_argument("--limit", type=int, default=30, help="show: list at most this many saved programs (the most "
                   "recently used first)")


def _folder(args) -> Path:
    from ..engine.runtime import default_cache_dir

    return Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir()


def _xla_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return [p for p in folder.iterdir() if p.is_file() and p.name.endswith(_XLA_SUFFIXES)]


def _store(folder: Path):
    from ..engine.program_store import ProgramStore

    return ProgramStore.for_cache(folder, create=False)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def show(args) -> int:
    folder = _folder(args)
    store = _store(folder)
    xla = _xla_files(folder)
    entries, damaged = store.entries()
    own = [e for e in entries if e.writable]
    print(f"cache folder {folder}{'' if folder.is_dir() else ' (not made yet)'}")
    print(f"  XLA compilation cache: {len([p for p in xla if p.name.endswith('-cache')])} program(s), "
          f"{_mb(sum(p.stat().st_size for p in xla))} (skips XLA's compile; tracing still runs)")
    limit = "saved programs off ($TPU_VIDEO_PROGRAM_CACHE_GB=0)" if not store.limit_bytes else \
        f"limit {store.limit_bytes / 1e9:g} GB ($TPU_VIDEO_PROGRAM_CACHE_GB)"
    print(f"  saved programs ({store.folder}): {len(own)}, {_mb(sum(e.size for e in own))}; {limit}")
    for path in store.read_only:
        mine = [e for e in entries if not e.writable and e.path.parent == path]
        print(f"  read-only saved programs ($TPU_VIDEO_PROGRAMS) {path}: {len(mine)}, {_mb(sum(e.size for e in mine))}")
    if entries:
        print(f"  {'last used':<17} {'MB':>7}  {'platform':<8} {'kind':<10} program")
        for e in entries[:args.limit]:
            used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.used))
            where = "" if e.writable else f"  [{e.path.parent}]"
            print(f"  {used:<17} {e.size / 1e6:>7.1f}  {e.platform:<8} {e.kind:<10} {e.describe}{where}")
        if len(entries) > args.limit:
            print(f"  ... and {len(entries) - args.limit} more (--limit)")
    for path, why in damaged:
        print(f"  damaged: {path}: {why} (the next process that needs it removes it and builds it again)")
    return 0


def clear(args) -> int:
    folder = _folder(args)
    count, size = _store(folder).clear()
    print(f"removed {count} saved program(s) ({_mb(size)}) from {folder / 'programs'}")
    if not args.programs_only:
        files = _xla_files(folder)
        total = sum(p.stat().st_size for p in files)
        for path in files:
            path.unlink(missing_ok=True)
        print(f"removed {len(files)} XLA compilation cache file(s) ({_mb(total)}) from {folder}")
    return 0


def main(args) -> int:
    return show(args) if args.action == "show" else clear(args)
