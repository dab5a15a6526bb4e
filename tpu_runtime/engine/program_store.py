"""Compiled programs saved on disk and loaded by a later process without tracing or compiling them: a warm start.

The persistent XLA cache (``jax_compilation_cache_dir``) skips only XLA's compile: tracing ComfyUI's or diffusers'
torch code through torchax, lowering it and finding a bridged model's call structure run again in every process.
A saved program skips all of it: it is the compiled executable itself (``jax.experimental.serialize_executable``),
filed under its ``ProgramKey`` (``program_key.py``: what the program depends on), with what its caller needs to
use it without a trace (a bridged program's option reads and list layouts: ``extra``).

- **Where**: ``<cache_dir>/programs/`` beside the XLA cache (one folder to copy to a new machine), and read-only
  folders named by ``TPU_VIDEO_PROGRAMS`` (``plan --save`` writes one for a slice before it is rented).
- **A file**: ``MAGIC``, the length of a JSON header, the header (role, description, the key's fields, the
  payload's length and SHA-256), the payload (the pickled executable with its argument and result trees, and the
  caller's ``extra``). A file cut short, with a bad header or a payload that does not match its checksum is named
  in the log, removed and built again; so is one the backend refuses to load. Never a crash, never a wrong program:
  a file is used only when its whole key equals the program's.
- **A miss** whose role has saved programs says in one line how the closest one differs (a new jax, another input
  shape, another model), then the program is traced and compiled as usual.
- **Size**: at most ``TPU_VIDEO_PROGRAM_CACHE_GB`` (default 20) in the cache folder; past it, the least recently
  used programs go first (loading a program marks it used). 0 turns saving and loading off.

Where JAX cannot serialize an executable, the program's lowered StableHLO (``jax.export``) is saved instead: a
later process then compiles it (the XLA cache may hit) but traces nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .program_key import ProgramKey

log = logging.getLogger(__name__)

PROGRAMS_ENV = "TPU_VIDEO_PROGRAMS"  # read-only folders of saved programs (os.pathsep between several)
LIMIT_ENV = "TPU_VIDEO_PROGRAM_CACHE_GB"  # the cache folder's size limit; 0: no saved programs at all
DEFAULT_LIMIT_GB = 20.0
FOLDER = "programs"  # under the runtime's cache directory
SUFFIX = ".program"
MAGIC = b"TPU video nodes program\n"
_HEADER_LIMIT = 64 << 20  # a header longer than this is not one of ours
READ_AHEAD_ENV = "TPU_VIDEO_READ_AHEAD"  # saved programs of a module read ahead when it is wrapped; 0: none
READ_AHEAD = 2  # its default: the two most recently used
_READERS = 2  # files read ahead at once: a small program (LTX-2's connectors) needed first is not queued behind a big one
_STALE_TEMPORARY = 3600.0  # seconds after which a half-written file (a process killed while saving) is removed


class Damaged(Exception):
    """A saved program's file is not whole or not ours: the message says what is wrong with it."""


@dataclass
class Loaded:
    """A program loaded from a file: the executable (called as the compiled one would be), the caller's ``extra``,
    the seconds the load took and what the file held (``executable`` or ``stablehlo``)."""

    executable: Any
    extra: Any
    seconds: float
    path: Path
    kind: str
    ahead: bool = False  # loaded in the background before it was asked for (``ProgramStore.read_ahead``)


@dataclass
class Entry:
    """A saved program as ``cache show`` lists it (read from its header)."""

    path: Path
    role: str
    describe: str
    kind: str
    platform: str
    size: int
    used: float  # last loaded or saved (the file's modification time)
    created: float
    writable: bool


def _role_id(role: str) -> str:
    return hashlib.sha256(role.encode()).hexdigest()[:10]


def file_name(key: ProgramKey, variant: str = "") -> str:
    return f"{_role_id(key.role)}-{key.digest()[:40]}-{hashlib.sha256(variant.encode()).hexdigest()[:10]}{SUFFIX}"


# --- the file format ----------------------------------------------------------------------------------------------
def write_file(path: Path, header: dict, payload: bytes) -> None:
    """Write a program file whole or not at all (a temporary file renamed into place)."""
    header = {**header, "payload_bytes": len(payload), "payload_sha256": hashlib.sha256(payload).hexdigest()}
    text = json.dumps(header, sort_keys=True).encode()
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as f:
        f.write(MAGIC + len(text).to_bytes(8, "big") + text)
        f.write(payload)
    os.replace(temporary, path)


def read_header(path: Path) -> tuple[dict, int]:
    """The header of a program file and where its payload starts; ``Damaged`` says what is wrong with one that is
    not whole."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        start = f.read(len(MAGIC) + 8)
        if len(start) < len(MAGIC) + 8 or not start.startswith(MAGIC):
            raise Damaged("it is not a saved program (its first bytes are not this package's)")
        length = int.from_bytes(start[len(MAGIC):], "big")
        if length > _HEADER_LIMIT:
            raise Damaged(f"its header claims {length} bytes")
        text = f.read(length)
    if len(text) < length:
        raise Damaged(f"it is cut short inside its header ({size} bytes)")
    try:
        header = json.loads(text)
    except ValueError as exc:
        raise Damaged(f"its header is not readable ({exc})") from exc
    if not isinstance(header, dict) or "payload_bytes" not in header or "fields" not in header:
        raise Damaged("its header lacks the program's key")
    offset = len(MAGIC) + 8 + length
    if size != offset + int(header["payload_bytes"]):
        raise Damaged(f"it holds {size} bytes, its header says {offset + int(header['payload_bytes'])}: it was cut "
                      "short or written over")
    return header, offset


def read_file(path: Path) -> tuple[dict, bytes]:
    """Header and payload of a program file, the payload checked against its checksum."""
    header, offset = read_header(path)
    with open(path, "rb") as f:
        f.seek(offset)
        payload = f.read()
    if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
        raise Damaged("its contents do not match their checksum")
    return header, payload


# --- executables ----------------------------------------------------------------------------------------------------
def serialize_executable(executable) -> dict:
    """A compiled program as bytes and its argument and result trees (``jax.experimental.serialize_executable``).
    A program that calls back into this process (a host callback: ``jax.pure_callback``, a debug print, an effect)
    is refused: the bytes would name a callback another process does not have (it crashes there)."""
    from jax.experimental import serialize_executable as se

    unloaded = getattr(getattr(executable, "_executable", None), "_unloaded_executable", None)
    if unloaded is not None and (getattr(unloaded, "host_callbacks", ()) or getattr(unloaded, "keepalive", ())
                                 or getattr(unloaded, "ordered_effects", ())
                                 or getattr(unloaded, "unordered_effects", ())):
        raise ValueError("the program calls back into this process on the host (a host callback or an effect), "
                         "which a saved executable cannot take to another process")
    blob, in_tree, out_tree = se.serialize(executable)
    return {"executable": bytes(blob), "in_tree": in_tree, "out_tree": out_tree}


def compile_stablehlo(blob: bytes, args: tuple | None = None):
    """A serialized ``jax.export`` as a program: compiled for ``args`` (its own argument shapes when None) or, without
    arguments to compile for, the jitted function (compiled at its first call)."""
    import jax

    from .program_key import compiler_options

    exported = jax.export.deserialize(bytearray(blob))
    jitted = jax.jit(exported.call)
    return jitted if args is None else jitted.lower(*args).compile(compiler_options())


def custom_calls(executable) -> list[str]:
    """The custom-call targets a compiled program calls (from its HLO text; empty where it has none to show)."""
    import re

    try:
        text = executable.as_text() or ""
    except Exception:  # noqa: BLE001 - a backend without HLO text: nothing to prepare for
        return []
    return sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))


def prepare_custom_calls(targets) -> None:
    """Set up in this process what a loaded program's custom calls need before it runs. jaxlib fills its LAPACK
    kernels' function table (``lapack_*_ffi``, XLA:CPU's QR, SVD, eigen...) only when JAX lowers such an op: a
    process that loads a program using them without having traced one crashes when it runs (a segmentation
    fault, jaxlib 0.10.2), so the table is filled here."""
    if any(t.startswith("lapack_") for t in targets):
        from jax._src.lax import linalg

        linalg.initialize_lapack()


def _load_payload(payload: dict, args: tuple | None):
    if "executable" in payload:
        from jax.experimental import serialize_executable as se

        return se.deserialize_and_load(payload["executable"], payload["in_tree"], payload["out_tree"]), "executable"
    return compile_stablehlo(payload["exported"], args), "stablehlo"


def _load_file(path: Path) -> tuple:
    """(header, data, executable, kind, seconds) of a program file, loaded (``read_ahead``'s background work)."""
    start = time.perf_counter()
    header, payload = read_file(path)
    data = pickle.loads(payload)
    if "executable" not in data:
        raise Damaged("it holds no executable")
    prepare_custom_calls(header.get("custom_calls", ()))
    executable, kind = _load_payload(data, None)
    return header, data, executable, kind, time.perf_counter() - start


# --- the store --------------------------------------------------------------------------------------------------------
class ProgramStore:
    """Saved programs in ``folder`` (written, at most ``limit_bytes``) and ``read_only`` folders (read)."""

    def __init__(self, folder: Path | None, limit_bytes: int | None = None, read_only=(), create: bool = True):
        self.folder = Path(folder) if folder is not None else None
        self.limit_bytes = limit_bytes
        self.read_only = [Path(p) for p in read_only]
        self._unsaved_roles: set = set()
        self._ahead: dict[Path, Future] = {}  # files being loaded in the background (``read_ahead``)
        self._ahead_roles: dict[Path, str] = {}
        self._reader: ThreadPoolExecutor | None = None
        if self.folder is not None and create:
            self.folder.mkdir(parents=True, exist_ok=True)

    @classmethod
    def for_cache(cls, cache_dir: Path, create: bool = True) -> "ProgramStore":
        """The store of a runtime whose XLA cache is ``cache_dir``, as the environment configures it (``create``
        False: a view of what is there, for ``cache show``, that makes no folder)."""
        limit = limit_from_environment()
        read_ahead_from_environment()  # checked with the others, before any model runs
        return cls(Path(cache_dir) / FOLDER if limit or not create else None, limit, read_only_folders(), create)

    def add_read_only(self, folder: str | Path, name: str = PROGRAMS_ENV) -> None:
        """Load programs from ``folder`` too (``name``: the option that gave it, for the error when it is none)."""
        from ..errors import InputError

        path = Path(folder).expanduser()
        if not path.is_dir():
            raise InputError(f"{name} {folder} is not a folder: give the folder plan --save wrote")
        if path not in self.read_only:
            self.read_only.append(path)

    @property
    def enabled(self) -> bool:
        return self.folder is not None or bool(self.read_only)

    def _folders(self) -> list[tuple[Path, bool]]:
        out = [(self.folder, True)] if self.folder is not None else []
        return out + [(p, False) for p in self.read_only]

    # --- loading ------------------------------------------------------------------------------------------------
    def find(self, key: ProgramKey, accept: Callable[[Any], bool] | None = None,
             args: tuple | None = None) -> Loaded | None:
        """The saved program of ``key`` (a complete key) whose ``extra`` ``accept`` takes, loaded; None when there
        is none. Damaged files met on the way are named, removed (in the cache folder) and skipped."""
        pattern = f"{_role_id(key.role)}-{key.digest()[:40]}-*{SUFFIX}"
        for folder, writable in self._folders():
            for path in sorted(folder.glob(pattern)):
                loaded = self._try(path, writable, key, accept, args)
                if loaded is not None:
                    return loaded
        return None

    def _try(self, path: Path, writable: bool, key: ProgramKey, accept, args) -> Loaded | None:
        start = time.perf_counter()
        ahead = self._ahead.pop(path, None)
        self._ahead_roles.pop(path, None)
        try:
            if ahead is not None:  # read in the background: waited for here (a damaged file raises as below)
                header, data, executable, kind, seconds = ahead.result()
            else:
                header, payload = read_file(path)
            if header.get("role") != key.role or header.get("fields") != key.fields:
                return None  # another program whose digest begins alike
            if ahead is None:
                data = pickle.loads(payload)
            if accept is not None and not accept(data.get("extra")):
                return None
            if ahead is None:
                prepare_custom_calls(header.get("custom_calls", ()))
                executable, kind = _load_payload(data, args)
                seconds = time.perf_counter() - start
        except FileNotFoundError:
            return None  # removed meanwhile (another process evicted it)
        except Exception as exc:  # noqa: BLE001 - damaged, or refused by this backend: built again
            self._discard(path, writable, exc)
            return None
        if writable:
            _touch(path)
        return Loaded(executable, data.get("extra"), seconds, path, kind, ahead is not None)

    # --- reading ahead ------------------------------------------------------------------------------------------
    def read_ahead(self, role: str, agrees: Callable[[dict], bool], limit: int = READ_AHEAD) -> list[Path]:
        """Start loading, in background threads, the ``limit`` most recently used saved programs
        of ``role`` whose key's fields ``agrees`` takes (what is known before a call: the software, the devices, the
        compiler). A later ``find`` of one of them waits for it rather than loading it again; meanwhile the caller
        places its weights and prepares its inputs (the backend's loader does not hold Python's lock). Only files
        of this role written for this software and these devices are read: a program of another jaxlib is never
        handed to the backend. Returns the files started."""
        candidates = []
        for folder, _ in self._folders():
            if not folder.is_dir():
                continue
            for path in folder.glob(f"{_role_id(role)}-*{SUFFIX}"):
                if path in self._ahead:
                    continue
                try:
                    header, _ = read_header(path)
                    used = path.stat().st_mtime
                except Exception:  # noqa: BLE001 - a damaged file: named when it is looked up itself
                    continue
                if header.get("role") == role and header.get("kind") == "executable" and agrees(
                        header.get("fields", {})):
                    candidates.append((used, path))
        started = [path for _, path in sorted(candidates, key=lambda c: (-c[0], c[1].name))[:limit]]
        if started and self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=_READERS, thread_name_prefix="tpu-video-read-ahead")
        for path in started:
            self._ahead_roles[path] = role
            self._ahead[path] = self._reader.submit(_load_file, path)
        return started

    def drop_read_ahead(self, role: str) -> None:
        """Forget the programs of ``role`` read ahead and not used (their module was released)."""
        for path in [p for p, r in list(self._ahead_roles.items()) if r == role]:
            self._ahead_roles.pop(path, None)
            future = self._ahead.pop(path, None)
            if future is not None:
                future.cancel()

    def _discard(self, path: Path, writable: bool, error: Exception) -> None:
        reason = str(error) if isinstance(error, Damaged) else f"it could not be loaded: {type(error).__name__}: " \
            f"{str(error).strip().splitlines()[0][:300] if str(error).strip() else ''}"
        if writable:
            path.unlink(missing_ok=True)
            log.warning("saved program %s is damaged (%s): removed; the program is built again", path, reason)
        else:
            log.warning("saved program %s is damaged (%s): not used (a read-only folder: replace the file); the "
                        "program is built here", path, reason)

    def explain(self, key: ProgramKey) -> str | None:
        """How the closest saved program of ``key``'s role differs from ``key`` (None: the role has none)."""
        best = None
        for folder, _ in self._folders():
            for path in folder.glob(f"{_role_id(key.role)}-*{SUFFIX}"):
                try:
                    header, _ = read_header(path)
                except Exception:  # noqa: BLE001 - a damaged file: named when it is looked up itself
                    continue
                if header.get("role") != key.role:
                    continue
                distance = key.distance(header.get("fields", {}))
                if best is None or distance < best[0]:
                    best = (distance, header.get("fields", {}))
        if not best:
            return None
        best = key.differences(best[1])
        return "; ".join(best[:3]) + (f"; and {len(best) - 3} more" if len(best) > 3 else "")

    # --- saving -------------------------------------------------------------------------------------------------
    def save(self, key: ProgramKey, describe: str, executable=None, extra: Any = None, variant: str = "",
             export: Callable[[], bytes] | None = None, folder: Path | None = None) -> Path | None:
        """Save a compiled ``executable`` under ``key`` (a complete key) with ``extra``; where JAX cannot serialize
        it, the StableHLO ``export()`` gives. Returns the file, or None when nothing could be saved (said once per
        role in the log). ``folder``: another folder than the cache's (``plan --save``), without a size limit."""
        target = Path(folder) if folder is not None else self.folder
        if target is None:
            return None
        target.mkdir(parents=True, exist_ok=True)
        try:
            try:
                data = serialize_executable(executable)
            except Exception as exc:  # noqa: BLE001 - a backend without serialization: the lowered program
                if export is None:
                    raise
                log.info("%s: the executable cannot be serialized here (%s: %s); its StableHLO is saved instead (a "
                         "later process compiles it but traces nothing)", describe, type(exc).__name__, exc)
                data = {"exported": export()}
            data["extra"] = extra
            payload = pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - saving is an optimisation: the program still runs
            if key.role not in self._unsaved_roles:
                self._unsaved_roles.add(key.role)
                log.info("%s is not saved for later processes: %s: %s", describe, type(exc).__name__, exc)
            return None
        path = target / file_name(key, variant)
        header = {"role": key.role, "describe": describe, "fields": key.fields, "created": time.time(),
                  "kind": "executable" if "executable" in data else "stablehlo",
                  "platform": key.fields.get("devices", {}).get("platform", ""),
                  "custom_calls": custom_calls(executable) if executable is not None else []}
        write_file(path, header, payload)
        log.info("saved %s for later processes (%s, %.1f MB)", describe, path.name, len(payload) / 1e6)
        if folder is None:
            self.evict()
        return path

    def evict(self) -> int:
        """Remove the least recently used programs of the cache folder until it is under its limit; returns how
        many went."""
        if self.folder is None or self.limit_bytes is None:
            return 0
        now = time.time()
        files = []
        for path in self.folder.iterdir():
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            if path.name.endswith(".tmp") and now - stat.st_mtime > _STALE_TEMPORARY:
                path.unlink(missing_ok=True)
            elif path.name.endswith(SUFFIX):
                files.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in files)
        removed, freed = 0, 0
        for _, size, path in sorted(files, key=lambda f: (f[0], f[2].name)):
            if total - freed <= self.limit_bytes:
                break
            path.unlink(missing_ok=True)
            removed, freed = removed + 1, freed + size
        if removed:
            log.info("saved programs past their limit of %s: the %d least recently used removed (%.1f MB)",
                     _gigabytes(self.limit_bytes), removed, freed / 1e6)
        return removed

    # --- listing ------------------------------------------------------------------------------------------------
    def entries(self) -> tuple[list[Entry], list[tuple[Path, str]]]:
        """Every saved program (the most recently used first), and the files that are not readable ones (with why)."""
        entries, damaged = [], []
        for folder, writable in self._folders():
            if not folder.is_dir():
                continue
            for path in folder.glob(f"*{SUFFIX}"):
                try:
                    header, _ = read_header(path)
                    stat = path.stat()
                except (Damaged, OSError) as exc:
                    damaged.append((path, str(exc)))
                    continue
                entries.append(Entry(path, header.get("role", "?"), header.get("describe", "?"),
                                     header.get("kind", "?"), header.get("platform", "?"), stat.st_size,
                                     stat.st_mtime, float(header.get("created", 0.0)), writable))
        entries.sort(key=lambda e: e.used, reverse=True)
        return entries, damaged

    def clear(self) -> tuple[int, int]:
        """Remove every program of the cache folder (never of a read-only one); returns (files, bytes)."""
        if self.folder is None or not self.folder.is_dir():
            return 0, 0
        count = size = 0
        for path in self.folder.iterdir():
            if path.name.endswith(SUFFIX) or path.name.endswith(".tmp"):
                size += path.stat().st_size
                path.unlink(missing_ok=True)
                count += 1
        return count, size


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def _gigabytes(n: int) -> str:
    return f"{n / 1e9:g} GB"


def limit_from_environment() -> int:
    """The cache folder's size limit in bytes, from ``TPU_VIDEO_PROGRAM_CACHE_GB`` (0: no saved programs)."""
    from ..errors import InputError

    text = os.environ.get(LIMIT_ENV, "").strip()
    if not text:
        return int(DEFAULT_LIMIT_GB * 1e9)
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise InputError(f"{LIMIT_ENV}={text!r} is not a size in gigabytes: give a number such as 20 (0 turns saved "
                         "programs off)")
    return int(value * 1e9)


def read_ahead_from_environment() -> int:
    """How many saved programs of a wrapped model are read ahead, from ``TPU_VIDEO_READ_AHEAD`` (0: none)."""
    from ..errors import InputError

    text = os.environ.get(READ_AHEAD_ENV, "").strip()
    if not text:
        return READ_AHEAD
    if not text.isdigit():
        raise InputError(f"{READ_AHEAD_ENV}={text!r} is not a count: give how many saved programs of a model to load "
                         f"ahead (default {READ_AHEAD}; 0 loads each when its call comes)")
    return int(text)


def read_only_folders() -> list[Path]:
    """The folders ``TPU_VIDEO_PROGRAMS`` names (``plan --save``'s), each checked to exist."""
    from ..errors import InputError

    folders = [Path(p).expanduser() for p in os.environ.get(PROGRAMS_ENV, "").split(os.pathsep) if p.strip()]
    for folder in folders:
        if not folder.is_dir():
            raise InputError(f"{PROGRAMS_ENV} names {folder}, which is not a folder: give the folder plan --save "
                             "wrote (or unset it)")
    return folders
