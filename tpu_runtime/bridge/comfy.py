"""ComfyUI's own models on the runtime: the ModelPatcher side of the native bridge (diffusion models here; VAEs in
``vae.py`` and text encoders in ``text.py`` use the same forward, registry and attention).

``diffusion_model_on_runtime(patcher, settings)`` (in ``diffusion.py``) returns a clone of ComfyUI's ModelPatcher whose diffusion model
runs its forward as compiled programs (``BridgedModule``); everything around the forward stays ComfyUI's: samplers,
schedulers, CFG and its batching, model sampling, wrappers (EasyCache, context windows, guidance patches), progress,
previews. How it hooks in:

- An object patch on the clone replaces the diffusion model's ``_forward`` (the function ComfyUI's
  ``DIFFUSION_MODEL`` wrappers call last), or ``forward`` for a model class without wrappers. Object patches apply
  while the clone (or a clone of it: a LoRA loader after this node) is the loaded patcher, and ComfyUI restores the
  original when another patcher loads the same model: the model without the node is unchanged.
- Attention comes through ``transformer_options["optimized_attention_override"]`` and runs the runtime's
  attention (splash on TPU) inside the program.
- Weight patches (LoRA): ComfyUI patches the host weights in place when it loads the model for sampling; the
  device copy follows by the patch identity ComfyUI records (``current_weight_patches_uuid``): a changed identity
  re-places the weights patched before and now, nothing else and nothing recompiles.
- The device copy lives as long as ComfyUI holds the model: ComfyUI's "Unload Models" and ``/free``
  (``unload_all_models``) release it, and so does ComfyUI dropping the model (another file loaded in its place).
  ComfyUI also detaches a model whenever another patcher of it loads (a LoRA strength changed): that only
  restores its host weights, which the patch identity already tells, so the device copy stays.

Nothing here is imported unless ComfyUI runs (or a test imports ComfyUI).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..engine.attention import AttentionConfig
from ..engine.sharding import MeshSpec
from ..errors import InputError
from .program import BridgedModule
from .rules import rules_for

log = logging.getLogger(__name__)

COMPUTE_DTYPES = ("auto", "as loaded")
_HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class BridgeSettings:
    """What the TPU nodes take: the mesh (None: chosen from the model's heads), attention, compute dtype."""

    mesh: MeshSpec | None = None
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    compute_dtype: str = "auto"

    def __post_init__(self):
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise InputError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {self.compute_dtype!r}")


# --- attention ------------------------------------------------------------------------------------------------------
def comfy_attention(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                    skip_output_reshape=False, **kwargs):
    """ComfyUI's ``optimized_attention`` signature, computed by torch's ``scaled_dot_product_attention`` (which the
    runtime overrides inside programs: splash on TPU, cuDNN on GPU, blockwise on CPU, a masked path with a mask).
    ``func`` is the attention ComfyUI would have used; it is not called (its CPU variants ask torch for device
    memory, which a traced program has not).

    What newer ComfyUI passes is honoured: ``scale`` (the score scale, default 1/sqrt(head width)), ``enable_gqa``
    (keys and values with fewer heads than the queries, their width telling how many: the runtime's attention takes
    them without repeating them), attention-tensor containers in place of q, k, v (their tensors are taken), and
    ``low_precision_attention`` (whether a low-precision kernel such as int8 attention may be used: the runtime's
    attention never quantizes q, k or v, so either value is met)."""
    q, k, v = (_taken(t) for t in (q, k, v))
    grouped = bool(kwargs.get("enable_gqa", False))
    if skip_reshape:
        batch, _, _, head_dim = q.shape
    else:
        batch, _, width = q.shape
        head_dim = width // heads
        q = q.view(batch, -1, heads, head_dim).transpose(1, 2)
        k, v = (t.view(batch, -1, t.shape[-1] // head_dim if grouped else heads, head_dim).transpose(1, 2)
                for t in (k, v))
    if mask is not None:
        if mask.ndim == 2:
            mask = mask.unsqueeze(0)
        if mask.ndim == 3:
            mask = mask.unsqueeze(1)
    extra = {"scale": kwargs["scale"]} if kwargs.get("scale") is not None else {}
    if grouped and k.shape[1] != q.shape[1]:
        extra["enable_gqa"] = True
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extra)
    if not skip_output_reshape:
        out = out.transpose(1, 2).reshape(batch, -1, heads * head_dim)
    return out


def _taken(value):
    """The tensor an attention-tensor container holds (ComfyUI's ``AttentionTensorContainer``: ``take()`` hands it
    over once), or the value itself."""
    if not isinstance(value, torch.Tensor) and callable(getattr(value, "take", None)):
        return value.take()
    return value


def _with_attention(options: dict) -> dict:
    options["optimized_attention_override"] = comfy_attention
    return options


def runtime_attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                      **kwargs):
    """ComfyUI's attention functions' own signature (``attention_basic``, ``attention_pytorch``...), on the
    runtime's attention."""
    kwargs.pop("transformer_options", None)
    kwargs.pop("_inside_attn_wrapper", None)
    return comfy_attention(None, q, k, v, heads, mask=mask, skip_reshape=skip_reshape,
                           skip_output_reshape=skip_output_reshape, **kwargs)


def runtime_vae_attention(q, k, v):
    """ComfyUI's VAE attention (``vae_attention()``: split, pytorch or xformers): one head over the positions of
    ``[B, C, *positions]`` tensors, on the runtime's attention."""
    shape = q.shape
    batch, channels = shape[0], shape[1]
    q, k, v = (t.reshape(batch, 1, channels, -1).transpose(2, 3) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return out.transpose(2, 3).reshape(shape)


def _runtime_attention_for_device(*args, **kwargs):
    return runtime_attention


def _vae_attention_factory():
    return runtime_vae_attention


def _comfy_attention_replacements() -> dict[int, Callable]:
    """id of each of ComfyUI's attention functions -> what stands in for it while a program is traced. ComfyUI
    picks them when a model is built (a VAE's ``optimized_attention`` attribute) or when it runs
    (``optimized_attention_for_device`` in the text encoders); its CPU choices ask torch for free device memory,
    which a traced program has not."""
    import comfy.ldm.modules.attention as attention
    import comfy.ldm.modules.diffusionmodules.model as vae_model

    out: dict[int, Callable] = {}
    for name, value in vars(attention).items():
        if callable(value) and (name.startswith("attention_") or name.startswith("optimized_attention")):
            out[id(value)] = runtime_attention
    out[id(attention.optimized_attention_for_device)] = _runtime_attention_for_device
    for name in ("normal_attention", "pytorch_attention", "xformers_attention"):
        if hasattr(vae_model, name):
            out[id(getattr(vae_model, name))] = runtime_vae_attention
    out[id(vae_model.vae_attention)] = _vae_attention_factory
    return out


@contextlib.contextmanager
def comfy_attention_on_runtime(module: torch.nn.Module):
    """While tracing ``module``'s code: every ComfyUI attention function it holds (a submodule's attribute) or its
    code's Python modules name (a module-level import, or ComfyUI's attention module imported whole) is the runtime's;
    everything is put back afterwards. Only
    a trace runs inside this block (the model is not running natively at the same time: ComfyUI runs one prompt at
    a time)."""
    replace = _comfy_attention_replacements()
    swapped: list[tuple[object, str, object]] = []
    modules = set()
    try:
        for sub in module.modules():
            for cls in type(sub).__mro__:
                modules.add(cls.__module__)
            for name, value in list(vars(sub).items()):
                if callable(value) and id(value) in replace:
                    swapped.append((sub, name, value))
                    object.__setattr__(sub, name, replace[id(value)])
        import comfy.ldm.modules.attention as attention

        # ComfyUI's attention module imported whole, by the code's modules or those of the functions they import
        # (SeedVR2's variable-length attention calls ``_attention.optimized_attention``): its functions too
        helpers = {getattr(value, "__module__", None) for name in modules
                   for value in vars(sys.modules.get(name) or attention).values() if inspect.isfunction(value)}
        for name in sorted(modules | {h for h in helpers if h and h.startswith("comfy.")}):
            namespace = sys.modules.get(name)
            if namespace is not None and any(value is attention for value in vars(namespace).values()):
                modules.add(attention.__name__)
        for name in sorted(modules):
            namespace = sys.modules.get(name)
            if namespace is None or name.startswith(("torch", "builtins")):
                continue
            for attr, value in list(vars(namespace).items()):
                if callable(value) and id(value) in replace and replace[id(value)] is not value:
                    swapped.append((namespace, attr, value))
                    setattr(namespace, attr, replace[id(value)])
        yield
    finally:
        for owner, name, value in reversed(swapped):
            if isinstance(owner, torch.nn.Module):
                object.__setattr__(owner, name, value)
            else:
                setattr(owner, name, value)


# --- the forward --------------------------------------------------------------------------------------------------
class BridgedForward:
    """What the object patch puts in place of the diffusion model's ``_forward`` (or ``forward``): checks for
    Cancel, brings the device weights in step with ComfyUI's patches, runs the program."""

    def __init__(self, bridged: BridgedModule, base_model, prefix: str = "diffusion_model.",
                 prepare: Callable | None = None):
        self.bridged = bridged
        self._base = weakref.ref(base_model)
        self.prefix = prefix  # the bridged module's name in the patcher's model (ComfyUI's patch keys)
        # For a model whose forward computes on host values at every call (``minimax.py``): the host's part, which
        # turns the call's arguments into the keyword arguments of the bridged method.
        self.prepare = prepare
        self._synced = _NOT_SYNCED
        self._patched: set[str] = set()
        self._lock = threading.Lock()

    def sync_weights(self) -> None:
        """Re-place the weights ComfyUI patched (or un-patched) since the device copy was made."""
        base = self._base()
        if base is None:
            return
        if getattr(base, "model_lowvram", False):
            raise InputError(
                f"ComfyUI loaded {self.bridged.label} only partly into memory (low-memory mode): "
                f"the TPU node needs the whole model on the host. Start ComfyUI with --cpu (and --highvram), or "
                f"free host memory")
        identity = getattr(base, "current_weight_patches_uuid", None)
        with self._lock:
            if identity == self._synced and self.bridged.state is not None:
                return
            patcher = getattr(base, "current_patcher", None) or _loaded_patcher(base)
            keys = set(getattr(patcher, "patches", {}) or {}) if identity is not None else set()
            keys = {k for k in keys if k.startswith(self.prefix)}
            names = {k[len(self.prefix):] for k in keys | self._patched}
            if self.bridged.state is not None and names:
                count = self.bridged.refresh(names)
                log.info("%s: %d patched weights re-placed on the devices", self.bridged.label, count)
            self._patched = keys
            self._synced = identity

    def release(self) -> None:
        with self._lock:
            self.bridged.release()
            self._synced = _NOT_SYNCED

    def __call__(self, *args, **kwargs):
        import comfy.model_management

        comfy.model_management.throw_exception_if_processing_interrupted()  # Cancel: between model calls
        self.sync_weights()
        if self.prepare is not None:
            return self.bridged(**self.prepare(self.bridged.module, *args, **kwargs))
        return self.bridged(*args, **kwargs)


_NOT_SYNCED = object()


def _loaded_patcher(model):
    """The ModelPatcher ComfyUI has loaded ``model`` with (VAEs and text encoders do not record it on the model)."""
    import comfy.model_management

    for loaded in list(comfy.model_management.current_loaded_models):
        patcher = loaded.model
        if patcher is not None and patcher.model is model:
            return patcher
    return None


# One bridged forward (one device copy of the weights) per loaded model and part: (id(model), part) -> (settings,
# forward). The diffusion model's part is "diffusion_model"; a VAE's are its encoder and decoder, a text encoder's
# each text model it holds.
_forwards: dict[tuple[int, str], tuple[object, BridgedForward]] = {}
_forwards_lock = threading.Lock()


def held_forward(owner, part: str, settings, build: Callable[[], BridgedForward]) -> BridgedForward:
    """The bridged forward of ``owner``'s ``part`` for ``settings``, built once; new settings replace (and release)
    the old device copy. It is released when ComfyUI drops ``owner``."""
    key = (id(owner), part)
    with _forwards_lock:
        held = _forwards.get(key)
        if held is not None and held[0] == settings:
            return held[1]
        if held is not None:
            held[1].release()
        forward = build()
        _forwards[key] = (settings, forward)
        weakref.finalize(owner, _forget, key, forward)
    forward.bridged.read_ahead()  # a warm start: its saved programs load while ComfyUI prepares the model
    return forward


# Per model class (any class in its MRO): the arguments of its forward whose tensors its code uses as Python values
# and that stay the same through a sampling run, compiled as constants of the program (``calls.split_call``). LTX
# (LTX-Video, LTX-2): the denoise mask, whose values decide which frames share a timestep and which keyframe tokens
# take part.
CONSTANT_ARGUMENTS = {"LTXVModel": ("denoise_mask",)}


def constant_arguments(module: torch.nn.Module) -> tuple[str, ...]:
    names = {cls.__name__ for cls in type(module).__mro__}
    return tuple(arg for cls, args in CONSTANT_ARGUMENTS.items() if cls in names for arg in args)


# Model classes (any class in the MRO) whose forward keeps sizes as tensors made from its inputs' shapes and reads
# them back as Python numbers (``.tolist()``): SeedVR2's NaDiT flattens each video of a batch into one sequence and
# carries their (frames, height, width) and text lengths as tensors, from which it splits, windows and unflattens.
# Those values come from constants alone; computed while traced (``jax.ensure_compile_time_eval``), they stay
# concrete and the code reads them as on the host. Everything computed from the inputs' values is traced as ever.
SIZES_AS_TENSORS = ("NaDiT",)


def sizes_as_tensors(module: torch.nn.Module) -> bool:
    return any(cls.__name__ in SIZES_AS_TENSORS for cls in type(module).__mro__)


@contextlib.contextmanager
def constants_evaluated(context):
    """``context`` entered, and what the traced code computes from constants alone evaluated while it is traced."""
    import jax

    with context, jax.ensure_compile_time_eval():
        yield


def _sizes(data):
    """``torch.Size`` values in (nested) lists and tuples as tuples of ints."""
    if isinstance(data, (list, tuple)):
        return type(data)(_sizes(d) for d in data) if not isinstance(data, torch.Size) else tuple(data)
    return data


@contextlib.contextmanager
def sizes_as_integers(env):
    """While traced: ``torch.tensor`` / ``torch.as_tensor`` of shapes (``torch.Size``) give integer tensors, as
    torch's do, and a slice of such a tensor reads back as Python numbers (``.tolist()``). torchax (0.0.13) infers the
    dtype from the first leaf of the data, and a ``torch.Size`` is a leaf to JAX, so a tensor of shapes came out
    float32 (SeedVR2's ``flatten``); its views (a slice) have no ``tolist``. Kept here, in one place, until torchax
    does the same."""
    import dataclasses

    keys = (torch.tensor, torch.as_tensor)
    saved = {key: env._ops.get(key) for key in keys}

    def factory(original):
        def make(data, *args, **kwargs):
            return original.func(_sizes(data), *args, **kwargs)

        return dataclasses.replace(original, func=make)

    from torchax.view import View

    had_tolist = "tolist" in vars(View)
    try:
        for key, op in saved.items():
            if op is not None:
                env._ops[key] = factory(op)
        View.tolist = lambda self: self.torch().tolist()  # a slice of such sizes (torchax's views have no tolist)
        yield
    finally:
        if not had_tolist:
            del View.tolist
        for key, op in saved.items():
            if op is not None:
                env._ops[key] = op


# Per model class (any class in its MRO): functions of ComfyUI's code (module, attribute path) that compute token
# positions from sizes alone and divide them by a number. XLA turns a division by a number into a multiplication by
# its reciprocal, which is not the same float (1 ulp apart); RoPE multiplies positions by frequencies up to theta x
# pi/2 (15708 for LTX), so an ulp of a position becomes a visible angle: LTX-2's audio stream (latent times in
# seconds, hop / sample rate, then fractions of the longest duration) moved by 4e-5 a step, more the longer the
# sound. While these functions are traced, their divisions divide (``exact_division``), as torch does.
EXACT_DIVISION = {"LTXVModel": (("comfy.ldm.lightricks.model", "get_fractional_positions"),
                                ("comfy.ldm.lightricks.symmetric_patchifier",
                                 "AudioPatchifier._get_audio_latent_time_in_sec"))}


def exact_division_functions(module: torch.nn.Module) -> tuple[tuple[str, str], ...]:
    names = {cls.__name__ for cls in type(module).__mro__}
    return tuple(f for cls, found in EXACT_DIVISION.items() if cls in names for f in found)


@contextlib.contextmanager
def exact_division(env):
    """While entered: torch's division of a tensor by a number (or a tensor it broadcasts) divides by the number
    spread to the result's shape behind an optimization barrier, so that XLA keeps the division instead of
    multiplying by the reciprocal (meant for small tensors: positions)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    key = torch.ops.aten.div
    original = env._ops.get(key)
    if original is None:
        yield
        return

    def divide(x, y, rounding_mode=None, **kwargs):
        if rounding_mode is None and hasattr(x, "shape") and jnp.issubdtype(x.dtype, jnp.floating) and (
                isinstance(y, (int, float)) or (hasattr(y, "shape") and y.shape != x.shape)):
            shape = jnp.broadcast_shapes(x.shape, jnp.shape(y))
            y = jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(y, dtype=x.dtype), shape))
        return original.func(x, y, **({"rounding_mode": rounding_mode} if rounding_mode is not None else {}), **kwargs)

    env._ops[key] = dataclasses.replace(original, func=divide)
    try:
        yield
    finally:
        env._ops[key] = original


@contextlib.contextmanager
def _exact_division_in(functions, env):
    """While entered, each of ``functions`` (module, attribute path) runs inside ``exact_division``."""
    import functools
    import importlib

    replaced = []
    for module_name, path in functions:
        owner = importlib.import_module(module_name)
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent, None)
        if owner is None or not hasattr(owner, name):  # a ComfyUI tree without it (0.3.64 has no audio stream)
            continue
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)

        def wrapped(*args, __original=original, **kwargs):
            with exact_division(env):
                return __original(*args, **kwargs)

        functools.update_wrapper(wrapped, original)
        setattr(owner, name, wrapped)
        replaced.append((owner, name, original))
    try:
        yield
    finally:
        for owner, name, original in reversed(replaced):
            setattr(owner, name, original)


# Per model class (any class in its MRO): attributes of the model holding functions of Python numbers alone that its
# forward calls while traced, computed on the host by torch instead (their result a constant of the program). LTX's
# RoPE frequency grid (``theta ** linspace(...) * pi / 2``): XLA's power and linspace land a few ulps off torch's, and
# each frequency multiplies a position (the same effect as EXACT_DIVISION's).
HOST_FUNCTIONS = {"LTXVModel": ("freq_grid_generator",)}


def host_function_attributes(module: torch.nn.Module) -> tuple[str, ...]:
    names = {cls.__name__ for cls in type(module).__mro__}
    return tuple(a for cls, found in HOST_FUNCTIONS.items() if cls in names for a in found
                 if callable(getattr(module, a, None)))


def on_host(function, env):
    """``function`` (of Python numbers, and devices taken as the host's) run by torch on the host while a program is
    traced, its tensor result placed as a constant of the program."""
    import torch.utils._python_dispatch as dispatch

    def call(*args, **kwargs):
        host = torch.device("cpu")
        args = [host if isinstance(a, torch.device) else a for a in args]
        kwargs = {k: host if isinstance(v, torch.device) else v for k, v in kwargs.items()}
        with torch._C.DisableTorchFunction(), dispatch._disable_current_modes():
            out = function(*args, **kwargs)
        return env.to_xla(out) if isinstance(out, torch.Tensor) else out

    return call


@contextlib.contextmanager
def _host_functions_of(module: torch.nn.Module, attributes, env):
    saved = {a: module.__dict__.get(a) for a in attributes}
    try:
        for attribute in attributes:
            setattr(module, attribute, on_host(getattr(module, attribute), env))
        yield
    finally:
        for attribute, value in saved.items():
            if value is None:
                module.__dict__.pop(attribute, None)
            else:
                setattr(module, attribute, value)


@contextlib.contextmanager
def _trace_context(module: torch.nn.Module):
    context = comfy_attention_on_runtime(module)  # attention called without the override
    functions, attributes = exact_division_functions(module), host_function_attributes(module)
    if functions or attributes:
        from ..engine.runtime import get_runtime

        env = get_runtime().env
        context = _stacked(context, _exact_division_in(functions, env), _host_functions_of(module, attributes, env))
    if not sizes_as_tensors(module):
        with context:
            yield
        return
    from ..engine.runtime import get_runtime

    with constants_evaluated(context), sizes_as_integers(get_runtime().env):
        yield


@contextlib.contextmanager
def _stacked(*contexts):
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def forward_for(base_model, settings: BridgeSettings) -> BridgedForward:
    """One bridged forward (one device copy) per loaded model; new settings replace the old copy."""

    def build() -> BridgedForward:
        module = base_model.diffusion_model
        method_name = "_forward" if callable(getattr(type(module), "_forward", None)) else "forward"
        prepare, method = host_prepared(module) or (None, getattr(type(module), method_name))
        bridged = BridgedModule(
            module=module, method=method, rules=rules_for(module),
            mesh_spec=settings.mesh, attention=settings.attention, prepare_options=_with_attention,
            label=type(module).__name__, constant_args=constant_arguments(module),
            trace_context=lambda: _trace_context(module),
        )
        bridged.method_name = method_name
        return BridgedForward(bridged, base_model, prepare=prepare)

    return held_forward(base_model, "diffusion_model", settings, build)


def host_prepared(module: torch.nn.Module) -> tuple[Callable, Callable] | None:
    """(host part, compiled part) of the forward of a model class whose own forward computes from host values at
    every call (MiniMax H3: ``minimax.py``), or None: the model's own forward is compiled."""
    from . import minimax

    if minimax.is_minimax_h3(module):
        return minimax.prepare, minimax.core
    return None


def _forget(key: tuple, forward: BridgedForward) -> None:
    with _forwards_lock:
        held = _forwards.get(key)
        if held is not None and held[1] is forward:
            del _forwards[key]
    forward.release()


def release_all() -> None:
    """Drop every bridged model's device weights (ComfyUI's "unload models" and ``/free``): diffusion models, VAEs
    and text encoders."""
    with _forwards_lock:
        held = [f for _, f in _forwards.values()]
    for forward in held:
        forward.release()


def bridged_forwards() -> list[BridgedForward]:
    with _forwards_lock:
        return [f for _, f in _forwards.values()]


def compute_dtype_patch(base_model, compute_dtype: str, backend: str | None = None):
    """The ``manual_cast_dtype`` the model computes with on the runtime, or ``None`` to leave ComfyUI's choice
    (``KEEP_CAST``: keep what ComfyUI chose). Logs one line: the model, how its weights are stored, the dtype it computes
    in and why.

    ``auto`` computes as ComfyUI does on an accelerator with bfloat16: quantized weights (ComfyUI's QuantizedTensors:
    fp8, int8, nvfp4, mxfp8 files) and plain fp8 weights (the loader's ``weight_dtype`` fp8) in bfloat16 inside the
    program (dequantized, or int8 matmuls on bfloat16 activations), bf16/fp16 weights in their own dtype (on the host ``--cpu`` makes ComfyUI cast every layer
    up to float32), float32 weights in float32; on the runtime's CPU backend (``backend``: the runtime's, by default)
    it keeps ComfyUI's choice, which bfloat16 would only slow down there. ``as loaded`` keeps what ComfyUI chose for
    the device it loaded the model for (with ``--cpu``: float32, ComfyUI's own CPU result)."""
    from .quantized import weight_storage

    if backend is None:
        from ..engine.runtime import get_runtime

        backend = get_runtime().backend

    module = base_model.diffusion_model
    storage = weight_storage(module)
    config = getattr(base_model, "model_config", None)  # the attribute may hold another clone's object patch now
    host = getattr(config, "manual_cast_dtype", base_model.manual_cast_dtype) or base_model.get_dtype()
    if compute_dtype == "as loaded":
        chosen, why = KEEP_CAST, "compute_dtype 'as loaded': what ComfyUI chose when it loaded the model"
    elif backend == "cpu":
        chosen, why = KEEP_CAST, ("compute_dtype 'auto' on the CPU backend keeps what ComfyUI chose (a TPU or GPU "
                                  "computes half-precision and quantized files in bfloat16)")
    elif storage.quantized or storage.fp8:
        chosen, why = torch.bfloat16, ("quantized or fp8 weights compute in bfloat16 inside the program (dequantized, "
                                       "or int8 matmuls on bfloat16 activations), as ComfyUI computes them on an "
                                       "accelerator")
    elif base_model.get_dtype() in _HALF:
        chosen, why = None, "bf16/fp16 weights compute in their own dtype, as ComfyUI does on an accelerator"
    else:
        chosen, why = KEEP_CAST, "float32 weights compute in float32"
    computed = host if chosen is KEEP_CAST else (chosen or base_model.get_dtype())
    differs = f"; ComfyUI's own run on this host computes {_name(host)} (compute_dtype 'as loaded' matches it)" \
        if computed != host else ""
    log.info("%s: weights %s; computing in %s: %s%s", type(module).__name__, storage.describe(), _name(computed),
             why, differs)
    return chosen


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


KEEP_CAST = object()


def refuse_dynamic_patcher(patcher, what: str) -> None:
    """Stop before any step when ComfyUI manages ``patcher``'s weights dynamically (newer ComfyUI on a GPU machine
    without ``--cpu``: ``ModelPatcherDynamic``). Such a patcher never merges a LoRA (or any weight patch) into the
    host weights: it applies it while casting each layer for its GPU, so a device copy made from the host weights
    would silently run without it."""
    is_dynamic = getattr(patcher, "is_dynamic", None)
    if callable(is_dynamic) and is_dynamic():
        raise InputError(
            f"ComfyUI manages {what}'s weights with dynamic VRAM ({type(patcher).__name__}): it applies LoRAs and "
            f"other weight patches only while casting each layer for its GPU, so the TPU runtime cannot take them. "
            f"Start ComfyUI with --cpu (on a TPU VM: ComfyUI keeps its models on the host and the TPU is the "
            f"runtime's) or with --disable-dynamic-vram")
