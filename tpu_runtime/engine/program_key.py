"""What a compiled program depends on, written down so that a later process can tell whether a saved program fits.

A ``ProgramKey`` names a program's *role* (what it is: "WanModel (native bridge)", "wan sample") and its *fields*,
each a plain JSON value, so that two keys compare field by field and a mismatch can be said in words:

- ``program``: what the caller compiles, in its own stable words (a family's stage key, a bridged call's structure);
- ``model``: the torch modules the program traces (``describe_module``): their classes, the code those classes come
  from, and every plain attribute of every submodule (a head count, an epsilon, a dtype): what a trace bakes in
  besides the weights;
- ``arguments``: every argument the program takes (``describe_arguments``), the weights among them: pytree path,
  shape, dtype and sharding of each, never a value (a LoRA changes values only: it keeps its key);
- ``devices``: the platform, device kind and the ids of the devices each mesh holds, in mesh order;
- ``software``: jax, jaxlib, torchax, torch and this package's code (a digest of its sources);
- ``compiler``: the XLA flags and the JAX settings that change what a trace or a compile makes.

Nothing here imports the bridge or the families: the callers say what their programs are.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

FORMAT = 1  # bumped when the meaning of a field changes: every older saved program then misses

# A module's attributes that ComfyUI and torch keep for their own bookkeeping (a weight patched in place, a load's
# counters, the hooks' tables): they say nothing of the computation, and a LoRA flips some of them.
_BOOKKEEPING = frozenset({
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_backward_pre_hooks", "_backward_hooks",
    "_is_full_backward_hook", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
    "_forward_pre_hooks_with_kwargs", "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks", "comfy_patched_weights", "seed_key", "_v", "hook_backup",
    "current_weight_patches_uuid", "model_loaded_weight_memory", "model_offload_buffer_memory", "lowvram_patch_counter",
    "current_patcher", "model_lowvram", "comfy_force_cast_weights", "prev_comfy_cast_weights",
})
_NOTHING = ("None", "[]", "{}")  # an attribute holding nothing reads as one that is absent (ComfyUI sets some on load)
# JAX settings that change what a trace makes or what the compiler builds.
_JAX_SETTINGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_threefry_partitionable",
                 "jax_default_prng_impl", "jax_numpy_dtype_promotion")


@dataclass
class ProgramKey:
    """A program's role and what it depends on (see the module's docstring); ``digest`` names it on disk."""

    role: str
    fields: dict[str, Any] = field(default_factory=dict)

    def digest(self) -> str:
        text = json.dumps([FORMAT, self.role, self.fields], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def with_fields(self, **more) -> "ProgramKey":
        return ProgramKey(self.role, {**self.fields, **more})

    def differences(self, other: dict[str, Any]) -> list[str]:
        """What ``other`` (a saved key's fields) holds that this key does not, in words: one item per differing
        value, named by its path (``software.jax``, ``model.vae.attributes``, ``arguments``)."""
        found = _differences(other, self.fields, "")
        rank = {name: i for i, name in enumerate(_ORDER)}
        return [text for _, text in sorted(found, key=lambda item: rank.get(item[0], len(rank)))]

    def distance(self, other: dict[str, Any]) -> int:
        """How far a saved key's fields are from this key's: one per differing value, a list's changed items each."""
        return _distance(other, self.fields)


def _distance(saved: Any, now: Any) -> int:
    if isinstance(saved, dict) and isinstance(now, dict):
        return sum(_distance(saved.get(k), now.get(k)) for k in set(saved) | set(now))
    if isinstance(saved, list) and isinstance(now, list):
        return len(set(map(str, saved)) ^ set(map(str, now))) or int(saved != now)
    return int(saved != now)


# The order differences are told in: the machine and the software first (a program built elsewhere), the inputs last.
_ORDER = ("devices", "software", "compiler", "model", "program", "static", "arguments")


def _differences(saved: Any, now: Any, path: str) -> list[tuple[str, str]]:
    """(the field, the difference in words) for each value that differs, depth first."""
    if isinstance(saved, dict) and isinstance(now, dict):
        out = []
        for name in sorted(set(saved) | set(now), key=str):
            out += _differences(saved.get(name, "absent"), now.get(name, "absent"), f"{path}.{name}" if path else
                                str(name))
        return out
    if saved == now:
        return []
    field = path.split(".")[0]
    if isinstance(saved, list) and isinstance(now, list):
        return [(field, f"{path}: {_list_difference(saved, now)}")]
    if isinstance(saved, str) and isinstance(now, str) and max(len(saved), len(now)) > 100:
        saved, now = _around_first_difference(saved, now)
    return [(field, f"{path}: was {_short(saved)}, now {_short(now)}")]


def _list_difference(saved: list, now: list) -> str:
    """Two lists (the arguments' lines, a mesh's axes) in words: where one item changed, that item; else what is new
    and what is gone."""
    texts = {json.dumps(x, sort_keys=True) for x in now}, {json.dumps(x, sort_keys=True) for x in saved}
    gone = [x for x in saved if json.dumps(x, sort_keys=True) not in texts[0]]
    new = [x for x in now if json.dumps(x, sort_keys=True) not in texts[1]]
    if len(gone) == len(new) == 1:
        return f"was {_short(gone[0])}, now {_short(new[0])}"
    parts = []
    if new:
        parts.append(f"now also {_short(new[0])}" + (f" (+{len(new) - 1} more)" if len(new) > 1 else ""))
    if gone:
        parts.append(f"no longer {_short(gone[0])}" + (f" (+{len(gone) - 1} more)" if len(gone) > 1 else ""))
    return ", ".join(parts) or "the same items in another order"


def _around_first_difference(a: str, b: str, before: int = 30) -> tuple[str, str]:
    """Two long texts cut to where they first differ (a call's structure: the argument that changed)."""
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    start = max(0, i - before)
    prefix = "..." if start else ""
    return prefix + a[start:], prefix + b[start:]


def _short(value: Any, width: int = 100) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= width else text[:width - 3] + "..."


# --- arguments and devices ----------------------------------------------------------------------------------------
def _sharding_text(sharding) -> str:
    from jax.sharding import NamedSharding, SingleDeviceSharding

    if sharding is None:
        return "unplaced"
    if isinstance(sharding, NamedSharding):
        text = f"{tuple(sharding.spec)}"
        memory = getattr(sharding, "memory_kind", None)
        return text if memory in (None, "device") else f"{text} in {memory}"
    if isinstance(sharding, SingleDeviceSharding):
        return f"device {next(iter(sharding.device_set)).id}"
    return repr(sharding)


def describe_arguments(args: tuple) -> list[str]:
    """One line per array argument: its pytree path, shape, dtype and sharding; then the tree's own structure (as
    a digest: a large state's key names are in the lines already)."""
    import jax

    leaves, tree = jax.tree_util.tree_flatten_with_path(args)
    lines = []
    for path, leaf in leaves:
        shape = "x".join(map(str, getattr(leaf, "shape", ()))) or "scalar"
        dtype = getattr(leaf, "dtype", type(leaf).__name__)
        weak = " weak" if getattr(leaf, "weak_type", False) else ""
        lines.append(f"{jax.tree_util.keystr(path)} {shape} {dtype}{weak} {_sharding_text(getattr(leaf, 'sharding', None))}")
    lines.append("tree " + hashlib.sha256(str(tree).encode()).hexdigest()[:16])
    return lines


def argument_devices(args: tuple) -> list:
    """Every device the arguments are placed on, in the order of the first mesh (or sharding) that holds it."""
    import jax

    seen, out = set(), []
    for leaf in jax.tree_util.tree_leaves(args):
        sharding = getattr(leaf, "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        devices = list(mesh.devices.flat) if mesh is not None else sorted(getattr(sharding, "device_set", ()),
                                                                         key=lambda d: d.id)
        for device in devices:
            if id(device) not in seen:
                seen.add(id(device))
                out.append(device)
    return out


def describe_devices(args: tuple) -> dict:
    """The platform, device kind and device ids (in mesh order) of every mesh the arguments are placed on."""
    import jax

    meshes = []
    for leaf in jax.tree_util.tree_leaves(args):
        sharding = getattr(leaf, "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None:
            text = (",".join(f"{n}={s}" for n, s in mesh.shape.items()) + " over "
                    + " ".join(str(d.id) for d in mesh.devices.flat))
        elif sharding is not None:
            text = "devices " + " ".join(str(d.id) for d in sorted(sharding.device_set, key=lambda d: d.id))
        else:
            continue
        if text not in meshes:
            meshes.append(text)
    devices = argument_devices(args)
    first = devices[0] if devices else None
    return {"platform": getattr(first, "platform", "none"), "kind": getattr(first, "device_kind", "none"),
            "processes": len({getattr(d, "process_index", 0) for d in devices}) or 1, "meshes": meshes}


# --- software and compiler ------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def source_digest(folder: str) -> str:
    """A digest of every Python source under ``folder`` (read once per process)."""
    h = hashlib.sha256()
    root = Path(folder)
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def package_code(top: str) -> str:
    """What the code of the top-level package ``top`` is: ``name==version`` for an installed distribution of that
    name, else (a checkout, such as ComfyUI's, or this package itself) a digest of its sources."""
    module = sys.modules.get(top)
    path = getattr(module, "__file__", None)
    if path and _installed(path) and top != __name__.split(".")[0]:
        try:
            from importlib.metadata import version

            return f"{top}=={version(top)}"
        except Exception:  # noqa: BLE001 - a distribution of another name: its own version, else its sources
            if getattr(module, "__version__", None):
                return f"{top}=={module.__version__}"
    if path and Path(path).name == "__init__.py":
        return f"{top} source {source_digest(str(Path(path).parent))}"
    if path:
        return f"{top} source {hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]}"
    return f"{top}=={getattr(module, '__version__', 'unknown')}"


def _installed(path: str) -> bool:
    return "site-packages" in path or "dist-packages" in path


def software(platform: str = "") -> dict:
    """The versions a program depends on, read now (a changed version string keys new programs). ``platform``
    "tpu" adds libtpu's."""
    import jax
    import jaxlib
    import torch

    out = {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "torch": torch.__version__,
           "torchax": _version_of("torchax"), "tpu_runtime": package_code("tpu_runtime")}
    if platform == "tpu":
        out["libtpu"] = _version_of("libtpu")
    return out


def _version_of(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001 - not installed
        module = sys.modules.get(name)
        return str(getattr(module, "__version__", "absent"))


def compiler_settings(platform: str = "") -> dict:
    """XLA's flags (and libtpu's, for a TPU) and the JAX settings that change what a trace or a compile makes."""
    import jax

    out = {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
    if platform == "tpu":
        out["LIBTPU_INIT_ARGS"] = os.environ.get("LIBTPU_INIT_ARGS", "")
    for name in _JAX_SETTINGS:
        value = getattr(jax.config, name, None)
        out[name] = str(value)
    options = compiler_options()
    if options:  # the options every program is compiled with (compiler_options below)
        out["compiler_options"] = json.dumps(options, sort_keys=True)
    return out


def complete(key: ProgramKey, args: tuple, static: dict | None = None) -> ProgramKey:
    """``key`` with the fields every program has: its arguments, devices, software and compiler settings."""
    devices = describe_devices(args)
    more = {"arguments": describe_arguments(args), "devices": devices,
            "software": software(devices["platform"]), "compiler": compiler_settings(devices["platform"])}
    if static:
        more["static"] = stable_text(static) or repr(sorted(static))
    return key.with_fields(**more)


# --- modules ----------------------------------------------------------------------------------------------------------
def describe_module(module: "torch.nn.Module", leave_out: tuple[str, ...] = ()) -> dict:
    """What a trace of ``module`` bakes in besides its weights: its submodules' classes, the code of the packages
    those classes come from, and a digest of every plain attribute of every submodule (``_stable``). ``leave_out``:
    attributes the caller knows its program never reads (what the model's forward records on itself for the code
    around it, which the next call overwrites: a key must not depend on the call before)."""
    skipped = _BOOKKEEPING | frozenset(leave_out)
    classes, packages = set(), set()
    h = hashlib.sha256()
    for name, sub in module.named_modules(remove_duplicate=False):
        cls = type(sub)
        classes.add(f"{cls.__module__}.{cls.__qualname__}")
        packages.add(cls.__module__.split(".")[0])
        h.update(f"{name}:{cls.__module__}.{cls.__qualname__}\n".encode())
        for attribute in sorted(vars(sub)):
            text = "" if attribute in skipped else _stable(vars(sub)[attribute])
            if text and text not in _NOTHING:
                h.update(f"{attribute}={text}\n".encode())
        for hooks in ("_forward_hooks", "_forward_pre_hooks"):
            h.update(f"{hooks}={_stable(list(getattr(sub, hooks, {}).values()))}\n".encode())
    return {"classes": sorted(classes), "code": sorted(package_code(p) for p in packages if p in sys.modules),
            "attributes": h.hexdigest()[:24]}


def _stable(value: Any, depth: int = 0) -> str:
    """A text that is the same in another process for the same value: numbers, strings, dtypes by value; tensors by
    shape, dtype and content; containers item by item; functions and classes by name; other objects by class."""
    import torch

    if depth > 4:
        return "..."
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return repr(value)
    if isinstance(value, (torch.dtype, torch.device, torch.Size)):
        return str(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, torch.Tensor):
        return _tensor_text(value)
    if isinstance(value, torch.nn.Module):
        return f"module {type(value).__qualname__}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_stable(v, depth + 1) for v in value) + "]"
    if isinstance(value, (set, frozenset)):
        return "{" + ",".join(sorted(_stable(v, depth + 1) for v in value)) + "}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{_stable(k, depth + 1)}:{_stable(v, depth + 1)}"
                              for k, v in sorted(value.items(), key=lambda kv: repr(kv[0]))) + "}"
    if isinstance(value, functools.partial):
        return f"partial({_stable(value.func, depth + 1)},{_stable(value.args, depth + 1)})"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type)):
        inner = getattr(value, "__func__", value)
        return f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', type(inner).__name__)}"
    if dataclasses.is_dataclass(value):
        return f"{type(value).__qualname__}(" + ",".join(
            f"{f.name}={_stable(getattr(value, f.name), depth + 1)}" for f in dataclasses.fields(value)) + ")"
    return f"object {type(value).__module__}.{type(value).__qualname__}"


def _tensor_text(t: "torch.Tensor") -> str:
    import torch

    head = f"tensor {tuple(t.shape)} {t.dtype}"
    if t.device.type == "meta" or t.numel() == 0:
        return head
    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return f"{head} {hashlib.blake2b(data.numpy().tobytes(), digest_size=12).hexdigest()}"


def stable_text(value: Any) -> str | None:
    """``repr(value)`` if it reads the same in another process (no object identity or address in it), else None."""
    text = repr(value)
    return None if " at 0x" in text or "object at" in text else text


def compiler_options() -> dict | None:
    """XLA options every program is compiled with. On the CPU backend:

    - No excess precision. XLA's CPU backend computes bfloat16 arithmetic in float32 and by default skips the
      rounding back to bfloat16 between fused operations; torch rounds after each one. A bfloat16 weight plus one
      (Gemma's RMSNorm scale, ``w + 1``) then differed by up to an ulp of bfloat16 (0.4%) from ComfyUI's own, and
      Gemma 3's states by 5% after six layers.
    - No YNNPACK fusions (``CPU_YNN_FUSIONS_OFF``), where this jaxlib has them. XLA's CPU backend (jaxlib 0.10.2)
      miscomputes a YNNPACK fusion of a batched dot whose operand is a broadcast that another operation also reads,
      with a reduction after it (attention's scores and their softmax, keys repeated over the query heads): the
      result was off by about 100% relative. Gemma 4 12B's sliding layers repeat their keys so when a prompt is as
      long as the window (LTX-2.5 pads its prompts to 1024 tokens); its conditioning differed from ComfyUI's own by
      0.6 relative until this was set.

    Accelerators compute bfloat16 natively and keep XLA's defaults."""
    import jax

    if jax.default_backend() != "cpu":
        return None
    options = {"xla_allow_excess_precision": False}
    for name, value in CPU_YNN_FUSIONS_OFF.items():
        if _cpu_option_known(name, value):
            options[name] = value
    return options


# XLA's CPU YNNPACK fusion kinds to use (the ``xla_cpu_experimental_ynn_fusion_type`` list): none (compiler_options).
CPU_YNN_FUSIONS_OFF = {"xla_cpu_experimental_ynn_fusion_type": ""}


@functools.lru_cache(maxsize=None)
def _cpu_option_known(name: str, value: str) -> bool:
    """Whether this jaxlib's CPU compiler takes the option (an older one has no such option and refuses every
    compile that names it): a trivial program compiled with it once, outside the runtime's compile counts and the
    persistent compilation cache."""
    import jax

    stats = sys.modules.get(f"{__package__}.runtime")
    saved = stats._STATS.snapshot() if stats is not None else None
    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((1,), "float32")).compile({name: value})
        return True
    except Exception:  # noqa: BLE001 - an unknown option or value: compile without it
        return False
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)
        if saved is not None:
            for field_name in ("backend_compiles", "persistent_cache_hits", "compile_seconds", "traces",
                               "programs_loaded"):
                setattr(stats._STATS, field_name, getattr(saved, field_name))
