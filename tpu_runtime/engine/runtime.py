"""The process-wide runtime: JAX backend and devices, the mesh, torchax, compile caches, transfers.

Everything that touches a device goes through one ``Runtime``. It is created on first use (``get_runtime``), not
at import: ComfyUI imports every pack at start-up and a TPU can be held by one process only.

What leaves the runtime are CPU torch tensors and plain Python values; torchax tensors and jax arrays stay inside
the model-family code that asked for them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Hashable

import numpy as np
import torch

from . import progress
from .dtypes import host_array, jax_dtype
from .sharding import AXES as MESH_AXES
from .sharding import MeshSpec
from .program_key import compiler_options
from .program_store import ProgramStore

if TYPE_CHECKING:
    from .program_key import ProgramKey

log = logging.getLogger(__name__)

CACHE_DIR_ENV = "TPU_VIDEO_CACHE_DIR"
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def default_cache_dir() -> Path:
    """The persistent XLA compilation cache directory: ``$TPU_VIDEO_CACHE_DIR`` or a per-user cache folder."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tpu_video_nodes" / "xla_cache"


@dataclass
class CompileStats:
    """Counts of compiled programs, process-wide, from JAX's own monitoring events.

    ``backend_compiles`` counts every XLA executable JAX built or fetched from the persistent cache;
    ``persistent_cache_hits`` those fetched from disk. ``xla_compiles`` is what was really compiled. ``traces``
    counts traces of torch code through torchax (every ``tracing()`` block: a program lowered, a bridged call's
    shapes found without data); ``programs_loaded`` the saved programs loaded instead of traced and compiled
    (``program_store.py``).
    """

    backend_compiles: int = 0
    persistent_cache_hits: int = 0
    compile_seconds: float = 0.0
    traces: int = 0
    programs_loaded: int = 0

    @property
    def xla_compiles(self) -> int:
        return self.backend_compiles - self.persistent_cache_hits

    def snapshot(self) -> "CompileStats":
        return CompileStats(self.backend_compiles, self.persistent_cache_hits, self.compile_seconds, self.traces,
                            self.programs_loaded)

    def since(self, earlier: "CompileStats") -> "CompileStats":
        return CompileStats(
            self.backend_compiles - earlier.backend_compiles,
            self.persistent_cache_hits - earlier.persistent_cache_hits,
            self.compile_seconds - earlier.compile_seconds,
            self.traces - earlier.traces,
            self.programs_loaded - earlier.programs_loaded,
        )


_STATS = CompileStats()
_listeners_installed = False


def _install_compile_listeners() -> None:
    global _listeners_installed
    if _listeners_installed:
        return
    import jax.monitoring

    def on_duration(event: str, duration: float, **_: Any) -> None:
        if event == _BACKEND_COMPILE_EVENT:
            _STATS.backend_compiles += 1
            _STATS.compile_seconds += duration

    def on_event(event: str, **_: Any) -> None:
        if event == _CACHE_HIT_EVENT:
            _STATS.persistent_cache_hits += 1

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    _listeners_installed = True


def _install_damaged_entry_handler() -> None:
    """A damaged entry of the persistent XLA cache (cut short by a full disk or a killed copy, overwritten) is named in
    the log, removed and compiled again. JAX alone warns with the program's name, compiles it and leaves the file,
    so every later start warns and compiles it again; its CacheVerificationError and ``raise_persistent_cache_errors``
    are left as JAX has them."""
    from jax._src import compilation_cache

    original = getattr(compilation_cache, "get_executable_and_time", None)
    if original is None or getattr(original, "_names_damaged_entries", False):
        return

    def get_executable_and_time(cache_key, *args, **kwargs):
        import jax

        try:
            return original(cache_key, *args, **kwargs)
        except Exception as error:  # noqa: BLE001 - decompression, unpickling or the backend's loader refused it
            if isinstance(error, getattr(compilation_cache, "CacheVerificationError", ())) or getattr(
                    jax.config, "jax_raise_persistent_cache_errors", False):
                raise
            folder = Path(str(jax.config.jax_compilation_cache_dir or ""))
            path = folder / f"{cache_key}-cache"
            why = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300] if str(error).strip() else ''}"
            if path.is_file():
                path.unlink(missing_ok=True)
                (folder / f"{cache_key}-atime").unlink(missing_ok=True)
                log.warning("compilation cache entry %s is damaged (%s): removed; the program is compiled again",
                            path, why)
            else:
                log.warning("compilation cache entry %s is damaged (%s): the program is compiled again", path, why)
            return None, None

    get_executable_and_time._names_damaged_entries = True
    compilation_cache.get_executable_and_time = get_executable_and_time


def compile_stats() -> CompileStats:
    """A copy of the process-wide compile counters."""
    return _STATS.snapshot()


@dataclass
class CompiledProgram:
    """One entry of the in-memory program table."""

    executable: Any
    compile_seconds: float
    memory: dict[str, int] = field(default_factory=dict)


def tpu_chips_here() -> int:
    """TPU chips on this machine (0 elsewhere), read from PCI and /dev before any library loads."""
    from .accelerators import tpu_chips_here as chips

    return chips()


def choose_platform() -> str | None:
    """Ask JAX for the platform this machine and ``TPU_VIDEO_EXPECT`` call for, before any backend starts
    (``accelerators.choose_platform``). Returns what was asked for (None: left to JAX)."""
    from . import accelerators

    return accelerators.choose_platform(accelerators.expectation())


class _DotDataNotice(logging.Filter):
    """torchax warns "In-place to .data modifications still results a copy on TPU" whenever code merely reads a
    traced tensor's ``.data`` (diffusers' modules do while we trace them): nothing is modified, so it is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "In-place to .data" not in record.getMessage()


class Runtime:
    """Owns the backend, the device mesh, the torchax environment and the compiled-program table."""

    def __init__(self, cache_dir: str | os.PathLike | None = None, accelerator: bool = True):
        """``accelerator``: the runtime runs models, so a machine with a TPU (or ``TPU_VIDEO_EXPECT``) must give it
        one (``accelerators.start_backend``); False for a process that only compiles for a topology (``plan``)."""
        import jax

        from .._torchax_compat import fix_in_place_ops_on_views, import_torchax
        from . import accelerators

        expected = accelerators.expectation() if accelerator else accelerators.Expectation(
            None, chips=accelerators.find_chips(), root=accelerators.host_root())
        asked = accelerators.choose_platform(expected)
        logging.getLogger("torchax.tensor").addFilter(_DotDataNotice())

        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(self.cache_dir))
        # Cache every program: tiny CPU programs too, so behaviour is the same on every backend.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        _install_compile_listeners()
        _install_damaged_entry_handler()
        # torch code asks for int64/float64; JAX without x64 uses int32/float32, which is what we want.
        warnings.filterwarnings("ignore", message="Explicitly requested dtype (int64|float64)")

        # A multi-host slice is joined before anything starts a JAX backend (TPU_VIDEO_MULTIHOST, multihost/).
        from .replay import join_from_environment

        self.slice = join_from_environment()

        # Every process's devices in a slice (meshes span them all); on the expected platform, or stopped here.
        self.devices, on_cpu_anyway = accelerators.start_backend(expected, asked)
        self.torchax = import_torchax()
        self.env = self.torchax.default_env()
        fix_in_place_ops_on_views(self.env)  # an in-place op on a slice writes through it (torchax drops some)
        self.local_devices = jax.local_devices()
        self.backend = jax.default_backend()
        self._meshes: dict[tuple, Any] = {}
        self.mesh = self.make_mesh(MeshSpec(tp=len(self.devices)))  # the default for placement without a model
        self._programs: dict[Hashable, CompiledProgram] = {}
        self._lock = threading.RLock()
        # scaled_dot_product_attention without an L x L score matrix (see attention.py).
        from .attention import sdpa_override

        self.env.override_op_definition(torch.nn.functional.scaled_dot_product_attention, sdpa_override)
        log.log(
            logging.WARNING if on_cpu_anyway else logging.INFO,
            "runtime ready: backend=%s, %d device(s) [%s]%s, compilation cache %s%s",
            self.backend, len(self.devices), self.devices[0].device_kind,
            f" in {self.slice.processes} processes" if self.slice else "", self.cache_dir,
            f"; on the CPU because {accelerators.ALLOW_CPU_ENV}=1, although {on_cpu_anyway}" if on_cpu_anyway else "",
        )
        if self.slice is not None:
            import atexit

            atexit.register(self.slice.close)  # after jax.distributed's own exit handler was registered: runs first

    # --- devices and placement -------------------------------------------------------------------------------
    def make_mesh(self, spec: "MeshSpec", devices=None):
        """The ``jax.sharding.Mesh`` with axes (dp, sp, tp) of ``spec``'s sizes over ``devices`` (default: this
        process's devices; a TPU topology's abstract devices make a mesh to compile for but not run on)."""
        from jax.sharding import Mesh

        from ..errors import InputError

        devices = list(self.devices if devices is None else devices)
        if spec.devices != len(devices):
            raise InputError(
                f"mesh {spec} uses {spec.devices} devices but {len(devices)} are available: choose sizes "
                f"whose product is {len(devices)}"
            )
        key = (spec.sizes, tuple(id(d) for d in devices))
        if key not in self._meshes:
            self._meshes[key] = Mesh(np.asarray(devices).reshape(spec.sizes), MESH_AXES)
        return self._meshes[key]

    @staticmethod
    def sharding(mesh, spec: tuple = ()):
        from jax.sharding import NamedSharding, PartitionSpec

        return NamedSharding(mesh, PartitionSpec(*spec))

    def put(self, value: Any, sharding=None):
        """Move CPU torch tensors / numpy arrays (any pytree of them) onto the devices; replicated unless told.

        Host arrays go straight to ``jax.device_put``: lifting them with ``jnp.asarray`` first (as torchax's
        ``t2j`` does) compiles a small program for every distinct shape, dozens per model. On a mesh that spans
        several processes each process places only its own devices' shards (every process holds the same value).
        """
        import jax

        sharding = sharding or self.sharding(self.mesh)
        local = sharding.is_fully_addressable

        def to_device(x):
            if isinstance(x, torch.Tensor):
                x = host_array(x)
            if local:
                return jax.device_put(x, sharding)
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

        return jax.tree_util.tree_map(
            to_device, value, is_leaf=lambda x: isinstance(x, (torch.Tensor, np.ndarray))
        )

    @staticmethod
    def host_numpy(x) -> np.ndarray:
        """A jax array as a numpy array on the host. An array split over several processes' devices is gathered
        (every process of the slice makes this call)."""
        if x.is_fully_addressable or x.is_fully_replicated:
            return np.array(x)
        from jax.experimental import multihost_utils

        return np.array(multihost_utils.process_allgather(x, tiled=True))

    @classmethod
    def to_cpu(cls, value: Any) -> Any:
        """Bring jax arrays (any pytree of them) back as CPU torch tensors (copies, writable)."""
        import jax

        def to_torch(x):
            if not isinstance(x, jax.Array):
                return x
            array = cls.host_numpy(x)
            if array.dtype.name == "bfloat16":
                return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
            if array.dtype.name in ("float8_e4m3fn", "float8_e5m2"):
                return torch.from_numpy(array.view(np.uint8)).view(getattr(torch, array.dtype.name))
            return torch.from_numpy(array)

        return jax.tree_util.tree_map(to_torch, value)

    # --- torch modules as jax functions -----------------------------------------------------------------------
    @staticmethod
    def _named_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
        # Every name, tied weights included (T5's embeddings).
        named = list(module.named_parameters(remove_duplicate=False))
        return named + list(module.named_buffers(remove_duplicate=False))

    def module_state(self, module: torch.nn.Module, mesh=None, rules=(), fsdp: bool = False) -> dict[str, Any]:
        """The module's parameters and buffers on the devices, each placed by the first matching sharding rule
        (regex on the name -> PartitionSpec), replicated when none matches."""
        from .sharding import partition_specs

        mesh = mesh or self.mesh
        named = self._named_tensors(module)
        specs = partition_specs({n: tuple(t.shape) for n, t in named}, rules, dict(mesh.shape), fsdp)
        moved: dict[int, Any] = {}  # each distinct tensor moved once
        state = {}
        for name, tensor in named:
            if id(tensor) not in moved:
                moved[id(tensor)] = self.put(tensor.detach(), self.sharding(mesh, specs[name]))
            state[name] = moved[id(tensor)]
        return state

    def abstract_state(self, module: torch.nn.Module, mesh, rules=(), fsdp: bool = False) -> dict[str, Any]:
        """What ``module_state`` would place, as ``jax.ShapeDtypeStruct``s with the same shardings, for a module
        whose tensors may be on ``meta``: compiling against it needs no weights and no devices to run on."""
        import jax

        from .sharding import partition_specs

        named = self._named_tensors(module)
        specs = partition_specs({n: tuple(t.shape) for n, t in named}, rules, dict(mesh.shape), fsdp)
        structs: dict[int, Any] = {}  # tied weights share one struct, as they share one device array
        for name, t in named:
            if id(t) not in structs:
                structs[id(t)] = jax.ShapeDtypeStruct(tuple(t.shape), jax_dtype(t.dtype),
                                                      sharding=self.sharding(mesh, specs[name]))
        return {name: structs[id(t)] for name, t in named}

    def module_function(self, module: torch.nn.Module, method: "str | Callable" = "forward") -> Callable:
        """``fn(state, *args, **kwargs)`` over jax values that runs ``module.<method>`` through torchax (or
        ``method(module, *args, **kwargs)`` when ``method`` is a function).

        ``state`` is what ``module_state`` returned (or any dict of the same names); the module's own tensors are
        not used, so its CPU weights may be freed once the state is on the devices. The state names every
        parameter, tied ones too (T5's embedding under both its names, one device array), so each is given its
        value by name (``tie_weights=False``): traced, the two names are two inputs of the same array.
        """
        env = self.env
        caller = _MethodCall(module, method)

        def fn(state, *args, **kwargs):
            state, args, kwargs = env.j2t_iso((state, args, kwargs))
            state = {f"inner.{k}": v for k, v in state.items()}
            with env:
                out = torch.func.functional_call(caller, state, args, kwargs, strict=False, tie_weights=False)
            return env.t2j_iso(out)

        return fn

    # --- compiled programs ------------------------------------------------------------------------------------
    def compiled(self, key: Hashable, fn: Callable, *example_args, describe: str = "", static: dict | None = None,
                 saved: "ProgramKey | None" = None, to_save: bool = False):
        """The compiled program for ``key``, compiling ``fn`` on ``example_args`` (arrays or shape structs) once.

        The key must name everything that changes the program: family, stage, static options, shapes, dtypes,
        mesh, attention settings. Shardings come from the example arguments. ``saved``: the program's key for the
        saved programs (``program_key.py``; the arguments, devices, software and compiler settings are added here):
        a program saved by an earlier process is loaded instead of traced and compiled, and one compiled here is
        saved for later processes. ``to_save``: the caller saves the executable itself (``save_program``), so it
        must be one XLA compiled here, not one from a cache (see ``compile_afresh``).
        """
        full_key = key
        with self._lock:
            program = self._programs.get(full_key)
            if program is not None:
                return program.executable
            describe = describe or str(key)
            if saved is not None and not self.saved_programs.enabled:
                saved = None
            if saved is not None:
                saved = self.program_key(saved, example_args, static)
                loaded = self.load_program(saved, describe, args=example_args)
                if loaded is not None:
                    self._programs[full_key] = CompiledProgram(loaded.executable, loaded.seconds,
                                                               _memory_analysis(loaded.executable))
                    return loaded.executable
            log.info("preparing %s (once per shape: later calls reuse it)", describe)
            before = compile_stats()
            start = time.perf_counter()
            with progress.compiling(describe) as shown:  # on the running node's face while it lasts
                lowered = lower(fn, *example_args, static=static)
                before_compile = compile_stats()
                executable = lowered.compile(compiler_options())
                compiled_here = compile_stats().since(before_compile).xla_compiles > 0  # not from a cache
                delta = compile_stats().since(before)
                if delta.persistent_cache_hits and not delta.xla_compiles:
                    shown.source = progress.PERSISTENT_CACHE
            seconds = time.perf_counter() - start
            program = CompiledProgram(executable, seconds, _memory_analysis(executable))
            self._programs[full_key] = program
            if delta.persistent_cache_hits and not delta.xla_compiles:
                log.info("loaded %s from the persistent compilation cache in %.1f s", describe, seconds)
            else:
                log.info("compiled %s in %.1f s", describe, seconds)
            if (saved is not None or to_save) and self.saved_programs.folder is not None and not compiled_here:
                executable = program.executable = compile_afresh(lowered)  # taken from a cache: see compile_afresh
            if saved is not None and self.saved_programs.folder is not None:
                self.save_program(saved, executable, describe, export=None if static else (
                    lambda: export_stablehlo(fn, example_args)))
            return executable

    # --- saved programs (warm starts: program_store.py) ------------------------------------------------------------
    _saved_store = None

    @property
    def saved_programs(self) -> "ProgramStore":
        """The saved programs: ``<cache_dir>/programs`` and the folders ``TPU_VIDEO_PROGRAMS`` names. Off on a
        multi-host slice (every process compiles the same program; a slice's executables are loaded together)."""
        from .program_store import ProgramStore

        if self._saved_store is None:
            self._saved_store = ProgramStore(None) if self.slice is not None else ProgramStore.for_cache(
                self.cache_dir)
        return self._saved_store

    @staticmethod
    def program_key(key: "ProgramKey", args: tuple, static: dict | None = None) -> "ProgramKey":
        """``key`` completed with what every program depends on (its arguments, devices, software, compiler)."""
        from .program_key import complete

        return complete(key, args, static)

    def load_program(self, key: "ProgramKey", describe: str, accept: Callable | None = None, args=None):
        """The saved program of ``key`` (complete) that ``accept`` takes of its ``extra`` (a ``program_store.Loaded``),
        or None; a miss whose role has saved programs says in one line how the closest differs."""
        store = self.saved_programs
        if not store.enabled:
            return None
        loaded = store.find(key, accept, args)
        if loaded is None:
            why = store.explain(key)
            if why:
                log.info("no saved program fits %s (the closest differs in %s): building it", describe, why)
            return None
        _STATS.programs_loaded += 1
        how = "no tracing, no compile" if loaded.kind == "executable" else "its StableHLO compiled here, no tracing"
        if loaded.ahead:
            how += "; read ahead while the model was prepared"
        log.info("loaded %s from the saved programs in %.2f s (%s)", describe, loaded.seconds, how)
        progress.loaded(describe, loaded.seconds, progress.SAVED_PROGRAMS)
        return loaded

    def read_ahead(self, role: str) -> list:
        """Start loading, in the background, the most recently used saved programs of ``role`` made for this
        software, these devices and this compiler (``ProgramStore.read_ahead``): a wrapped model's programs load while
        its weights are placed. Returns the files started (none where saved programs are off)."""
        from .program_key import compiler_settings, software

        from .program_store import read_ahead_from_environment

        store = self.saved_programs
        limit = read_ahead_from_environment()
        if not store.enabled or not limit:
            return []
        first = self.devices[0]
        platform, kind = first.platform, first.device_kind
        expected = {"software": software(platform), "compiler": compiler_settings(platform)}

        def agrees(fields: dict) -> bool:
            devices = fields.get("devices", {})
            return (devices.get("platform") == platform and devices.get("kind") == kind
                    and all(fields.get(name) == value for name, value in expected.items()))

        return store.read_ahead(role, agrees, limit)

    def save_program(self, key: "ProgramKey", executable, describe: str, extra: Any = None, variant: str = "",
                     export: Callable[[], bytes] | None = None):
        """Save a program compiled here under ``key`` (complete) for later processes (see ``program_store.py``)."""
        store = self.saved_programs
        if store.folder is not None:
            return store.save(key, describe, executable, extra=extra, variant=variant, export=export)
        return None

    def program_info(self, key: Hashable) -> CompiledProgram | None:
        return self._programs.get(key)

    @property
    def program_count(self) -> int:
        return len(self._programs)

    def clear_programs(self) -> None:
        with self._lock:
            self._programs.clear()


def lower(fn: Callable, *example_args, static: dict | None = None):
    """``fn`` traced (through torchax where it calls torch) and lowered for the shardings of ``example_args``:
    arrays or ``jax.ShapeDtypeStruct``s, on this process's devices or a topology's it cannot run on."""
    import jax

    jitted = jax.jit(fn, static_argnames=tuple(static) if static else ())
    with tracing():
        return jitted.lower(*example_args, **(static or {}))


def compile_afresh(lowered):
    """``lowered`` compiled by XLA now, neither from the persistent compilation cache nor from JAX's in-memory one.

    An executable JAX deserialized (a persistent-cache hit, or one it holds in memory since such a hit) serializes
    into one that fails when it runs (jaxlib 0.10.2, CPU: "Function ... not found"): a program is saved for later
    processes only as XLA compiled it. Costs one more compile, the first time a program is saved after its XLA
    compile was cached (a new version of this package, saved programs cleared)."""
    import jax
    from jax._src import compilation_cache
    from jax._src.interpreters import pxla

    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        clear = getattr(pxla, "clear_in_memory_compilation_cache", None)
        clear() if clear is not None else jax.clear_caches()
        # options given (an empty dict at least): the lowering's own copy is not reused
        return lowered.compile(compiler_options=compiler_options() or {})
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()


def export_stablehlo(fn: Callable, args: tuple) -> bytes:
    """``fn`` traced on ``args`` (arrays or shape structs with shardings) and lowered, as a serialized
    ``jax.export`` (StableHLO): what a process that cannot trace it (a slice's worker, a later process) compiles."""
    import jax

    with tracing():
        exported = jax.export.export(jax.jit(fn))(*args)
    return bytes(exported.serialize())


@contextlib.contextmanager
def tracing():
    """What tracing torch code through torchax needs, around every trace (``lower``, ``jax.eval_shape``).

    ComfyUI runs nodes under torch.inference_mode(), which skips the autograd dispatch key where torch
    decomposes composite ops (aten::dropout, aten::conv3d, ...) that torchax has no lowering for. Trace in plain
    no-grad mode instead: same numbers, every op decomposed as torchax expects. Each block counts as a trace
    (``CompileStats.traces``)."""
    _STATS.traces += 1
    with torch.inference_mode(False), torch.no_grad():
        yield


class _MethodCall(torch.nn.Module):
    """Lets ``torch.func.functional_call`` run a method other than ``forward`` (e.g. ``vae.decode``)."""

    def __init__(self, module: torch.nn.Module, method: "str | Callable"):
        super().__init__()
        self.inner = module
        self.method = method

    def forward(self, *args, **kwargs):
        if callable(self.method):
            return self.method(self.inner, *args, **kwargs)
        return getattr(self.inner, self.method)(*args, **kwargs)


def _memory_analysis(executable) -> dict[str, int]:
    try:
        m = executable.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend reports it
        return {}
    if m is None:
        return {}
    names = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "generated_code_size_in_bytes")
    return {n: int(getattr(m, n, 0)) for n in names}


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()
_start_failure: Exception | None = None  # why the backend could not start: JAX starts it once a process


def get_runtime(cache_dir: str | os.PathLike | None = None, accelerator: bool = True) -> Runtime:
    """The process-wide runtime, created on first call. Later calls may not ask for another cache directory.

    Where the machine has a TPU (or ``TPU_VIDEO_EXPECT`` asks for one) and the runtime would end up on the CPU, this
    raises ``AcceleratorUnavailable`` with the cause and the fix, on this call and every later one of the process
    (JAX does not start a backend twice). ``accelerator=False``: a process that only compiles for a topology
    (``plan``) takes whatever backend JAX starts."""
    global _runtime, _start_failure
    from ..errors import AcceleratorUnavailable

    with _runtime_lock:
        if _start_failure is not None:
            raise AcceleratorUnavailable(str(_start_failure))
        if _runtime is None:
            try:
                _runtime = Runtime(cache_dir=cache_dir, accelerator=accelerator)
            except AcceleratorUnavailable as error:
                _start_failure = error
                raise
            return _runtime
        if cache_dir is not None and Path(cache_dir).expanduser() != _runtime.cache_dir:
            raise ValueError(
                f"the runtime already uses compilation cache {_runtime.cache_dir}; a process has one cache "
                f"directory, so {cache_dir} cannot be used too: restart to change it"
            )
        return _runtime


def runtime_started() -> bool:
    return _runtime is not None
