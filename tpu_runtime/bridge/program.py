"""Run a method of any torch module on the runtime: weights placed once by rules, one compiled program per call
structure, the runtime's mesh, attention and compilation caches.

``BridgedModule`` is what the native bridge is made of: ComfyUI's diffusion models, VAEs and text encoders are
torch modules, and torchax traces their own code into a JAX program. It knows nothing of ComfyUI: the ComfyUI side
(``bridge/comfy.py``) says which method to run, supplies the attention and tells it when the host weights changed.

- **Weights**: every parameter and buffer, on the devices, each placed by the first matching rule of the module's
  rule table (``bridge/rules.py``); held until ``release``. ``refresh(names)`` re-places the named tensors from the
  module's current host values (a LoRA patched them): same shapes and shardings, so nothing recompiles. Quantized
  weights (ComfyUI's QuantizedTensors) are placed packed, with their scales, and dequantized inside the program
  (``bridge/quantized.py``).
- **Programs**: a call is split (``calls.split_call``) into tensors and a structure; one program per structure,
  mesh and attention setting, and per set of option values the model read while traced (``calls.OptionReads``).
- **Mutable arguments**: with ``mutable_lists``, lists passed in are returned by the program too and written back
  in place, their tensors as ``DeviceValue``s that stay on the devices (a causal VAE's convolution cache), placed
  as ``input_spec`` says so that the next call takes them as they are. A cache list changes its structure over
  the first calls (ComfyUI's Wan VAE: empty, then markers and one-frame caches, then steady two-frame caches): a
  ``CacheSettling`` policy lets the first call's program return the caches already in their steady form (found by
  tracing later calls abstractly, each from what the one before left, until the first call's caches can be settled
  into a later call's), so that the second call runs the program of the later calls.
- **Recorded arguments**: ``recorded_args`` name list arguments (a text model's ``num_tokens``) that key a program
  only when the model reads them (``calls.RecordedSequence``).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch

from ..engine.attention import AttentionConfig, attention_scope
from ..engine.memory import PLAN_NATIVE, gib, is_out_of_memory, out_of_memory
from ..engine.sharding import MeshSpec
from ..errors import InputError
from . import kitchen, quantized
from .calls import DeviceValue, OptionReads, RecordedOptions, RecordedSequence, rebuild, split_call
from .rules import ArchRules, placement_specs
from .saved import saved_program

log = logging.getLogger(__name__)

# Past this many programs for one call structure, the model reads an option that changes between calls.
VARIANT_WARNING = 8


class UntraceableModel(InputError):
    """The model's code cannot be compiled: the message names the class, the op and the line."""


class CacheSettling:
    """How the lists a bridged method mutates (a causal cache) reach their steady form.

    ``probe`` gives the arguments of a later call from the first call's (the lists themselves are filled in by the
    caller); the bridge traces such later calls one after another without data until the caches the first call left
    can be turned into the caches some later call left (``settles`` says which values can be; the caches of a later
    call may first pass through forms of their own, as an encoder's deferred downsampling slots do). The first
    call's program then returns its caches in that form (``settle``, inside the traced program), so that the second
    call runs the program of the calls that follow that later one. ``probe_steps`` bounds how many later calls are
    traced ahead; without a steady form the second call compiles a program of its own."""

    probe_steps = 8

    def probe(self, positional: list, keyword: dict) -> tuple[list, dict]:
        return positional, keyword

    def carried(self, before: list, after: list) -> list:
        """What a list holds when the next call starts: what the first call left in a list it put arrays in (the
        caches), the list as it was passed otherwise (an index the caller starts again from 0)."""
        return after if any(_is_struct(v) for v in after) else before

    def settles(self, value: Any, steady: Any) -> bool:
        """Whether ``settle`` turns ``value`` (what the first call left: a ``jax.ShapeDtypeStruct`` for an array,
        else the Python value) into ``steady`` (what a later call leaves, in the same form)."""
        return False

    def settle(self, value: Any, steady: Any) -> Any:
        """``value``: what the first call left (a traced tensor or a Python value); ``steady``: what the later call
        leaves there (a ``jax.ShapeDtypeStruct``, where ``settles`` said yes)."""
        return None


@dataclass
class _Variant:
    reads: OptionReads
    key: tuple
    executable: Any
    list_layouts: list = field(default_factory=list)
    number: int = 0  # the module's programs in order (a slice's workers know them by it)


_serials = itertools.count()


@dataclass
class CallStats:
    """Per bridged module: model calls, programs compiled (traced and built) and seconds in each part of a call."""

    calls: int = 0
    programs: int = 0  # held: traced and compiled here, or loaded
    trace_compile_seconds: float = 0.0
    to_device_seconds: float = 0.0
    run_seconds: float = 0.0
    to_host_seconds: float = 0.0
    call_seconds: float = 0.0  # whole calls, from the arguments to the result on the host (compiles excluded)
    weight_refreshes: int = 0
    programs_loaded: int = 0  # of ``programs``: saved by an earlier process and loaded (``saved.py``)

    def reset(self) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, type(getattr(self, name))())


@dataclass
class BridgedModule:
    """``method`` of ``module`` (a function taking the module first, e.g. ``type(module)._forward``) run on the
    runtime's devices. ``options_arg`` names the argument whose dict is recorded rather than traced
    (ComfyUI's ``transformer_options``); ``prepare_options`` adds what the runtime supplies to it (the attention)."""

    module: torch.nn.Module
    method: Callable
    rules: ArchRules
    mesh_spec: MeshSpec | None = None
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    options_arg: str | None = "transformer_options"
    prepare_options: Callable[[dict], dict] | None = None
    mutable_lists: bool = False
    label: str = ""
    device_dtypes: Callable[[str, torch.Tensor], torch.dtype] | None = None
    settle: CacheSettling | None = None
    input_spec: Callable[[tuple[int, ...], dict], tuple] | None = None  # (shape, mesh sizes) -> PartitionSpec
    trace_context: Callable[[], ContextManager] | None = None
    recorded_args: tuple[str, ...] = ()
    skip_weights: frozenset = frozenset()
    memory_hint: str = ""
    constant_args: tuple[str, ...] = ()  # arguments whose tensors are constants of the program (``calls``)
    # Constant arguments whose tensors the model's code meets on the devices (a boolean mask it indexes device values
    # with): they enter the trace as concrete arrays rather than host tensors (mixed host and device math).
    device_constant_args: tuple[str, ...] = ()
    # Attributes the model's forward records on itself for the code around it (redone on the host after each call,
    # ``text.record_host_values``) and its program never reads: left out of its saved programs' key (``saved.py``),
    # which must not depend on the call before.
    host_recorded: tuple[str, ...] = ()

    def __post_init__(self):
        self.signature = inspect.signature(self.method)
        self.label = self.label or type(self.module).__qualname__
        self.state: dict | None = None
        self.stats = CallStats()
        self._variants: dict[tuple, list[_Variant]] = {}
        self._lock = threading.RLock()
        self._runtime = None
        self._mesh = None
        self._warned_variants: set = set()
        self._serial = next(_serials)  # program keys name this module, never another one that reused its id
        self._driver = None  # on a multi-host slice's first process: the workers' side of this module
        self.quantized: dict[str, quantized.QuantizedSpec] = {}  # the placed quantized weights, by name
        self._quantized_key: tuple = ()
        quantized.check_supported(self.module, self.label)

    # --- devices --------------------------------------------------------------------------------------------
    @property
    def runtime(self):
        if self._runtime is None:
            from ..engine.runtime import get_runtime

            self._runtime = get_runtime()
        return self._runtime

    @property
    def mesh(self):
        if self._mesh is None:
            spec = self.mesh_spec or self.rules.auto_mesh(self.module, len(self.runtime.devices))
            self.rules.check_mesh(self.module, spec, len(self.runtime.devices))
            self._mesh = self.runtime.make_mesh(spec)
            log.info("%s on mesh %s (%s)", self.label, spec, self.rules.describe())
        return self._mesh

    def _named(self) -> list[tuple[str, torch.Tensor]]:
        named = list(self.module.named_parameters(remove_duplicate=False))
        named += list(self.module.named_buffers(remove_duplicate=False))
        return [(n, t) for n, t in named if n not in self.skip_weights]

    def include_weights(self, names) -> None:
        """Place weights left out so far (``skip_weights``) as well, from the next call on."""
        names = set(names) & set(self.skip_weights)
        if names:
            with self._lock:
                self.skip_weights = frozenset(set(self.skip_weights) - names)
                self.state = None

    def _specs(self, named, parts=None) -> dict[str, tuple]:
        """The PartitionSpec of every array ``named`` weights are placed as (``parts``: those arrays, if known)."""
        sizes = dict(self.mesh.shape)
        specs = placement_specs({n: quantized.storage_shape(t) for n, t in named}, self.rules, sizes, self.label)
        return quantized.part_specs(parts or quantized.device_parts(named), specs, sizes)

    def _host_value(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if self.device_dtypes is not None:
            dtype = self.device_dtypes(name, tensor)
            if dtype is not None and dtype != tensor.dtype:
                tensor = tensor.to(dtype)
        return tensor

    def _slice(self):
        """On the first process of a multi-host slice, the workers' side of this module (else None)."""
        slice_ = getattr(self.runtime, "slice", None)
        if slice_ is None or not slice_.is_driver:
            return None
        if self._driver is None:
            from ..multihost.bridge import DriverBridge

            self._driver = DriverBridge(slice_, self.runtime, self.label)
        return self._driver

    def _place_named(self, state: dict, named) -> int:
        """Place ``named`` tensors into ``state`` (every process of a slice its own shards), a quantized weight as
        its packed data and scales (``quantized.parts_of``); tensors tied under several names are placed once (once
        per name on a slice, where the workers know names only)."""
        parts = quantized.device_parts(named)
        specs = self._specs(named, parts)
        driver = self._slice()
        if driver is not None:
            from ..engine.dtypes import host_array

            driver.place(self.mesh, state, [(p.name, host_array(self._host_value(p.name, p.value)), specs[p.name])
                                            for p in parts])
            return len(named)
        moved: dict[tuple, Any] = {}
        for part in parts:
            if part.key not in moved:
                moved[part.key] = self.runtime.put(self._host_value(part.name, part.value),
                                                   self.runtime.sharding(self.mesh, specs[part.name]))
            state[part.name] = moved[part.key]
        return len({p.key for p in parts if p.name == p.weight})

    def place(self) -> dict:
        """The weights on the devices (placed on first use, then kept). Out of device memory, the error names the
        module, its weights' size, the mesh and the fix."""
        with self._lock:
            if self.state is None:
                start = time.perf_counter()
                named = self._named()
                self._set_quantized(quantized.describe_all(named), replace=True)
                state: dict = {}
                try:
                    moved = self._place_named(state, named)
                except Exception as error:  # noqa: BLE001 - the devices' own errors, named for the user where we can
                    if is_out_of_memory(error):
                        raise self._memory_error(None, error, needs=f"its weights are {gib(_host_bytes(named))} in "
                                                 "all, split over the mesh by its placement rules") from error
                    raise
                self.state = state
                log.info("%s: %d weights placed on %d device(s) in %.1f s", self.label, moved,
                         self.mesh.size, time.perf_counter() - start)
            return self.state

    def refresh(self, names) -> int:
        """Re-place the named weights from the module's current host values; returns how many were placed."""
        with self._lock:
            if self.state is None:
                return 0
            named = dict(self._named())
            names = [n for n in names if n in named and n in self.state]
            if not names:
                return 0
            chosen = [(n, named[n]) for n in names]
            self._set_quantized(quantized.describe_all(chosen), replace=False, names=names)
            self._place_named(self.state, chosen)
            self.stats.weight_refreshes += 1
            return len(names)

    def _set_quantized(self, found: dict, replace: bool, names=()) -> None:
        """Record the quantized weights placed (all of them, or those of ``names``): the program depends on their
        layouts, so a change keys new programs."""
        current = {} if replace else {n: s for n, s in self.quantized.items() if n not in set(names)}
        self.quantized = {**current, **found}
        self._quantized_key = quantized.signature(self.quantized)
        if self.quantized:
            quantized.install(self.runtime.env)

    @property
    def saved_role(self) -> str:
        """The role of this module's saved programs (``saved.py``)."""
        return f"{self.label} (native bridge)"

    def read_ahead(self) -> None:
        """Start loading this module's most recently used saved programs in the background, so that a warm start's
        first call finds its program loaded while ComfyUI prepared the model and its inputs. Never fails: a program
        read ahead is still used only when its whole key equals the call's."""
        try:
            runtime = self.runtime  # a runtime that cannot start says so at the first call, as before
            if getattr(runtime, "slice", None) is not None:
                return
            started = runtime.read_ahead(self.saved_role)
        except Exception as error:  # noqa: BLE001 - an optimisation: the call loads or builds as before
            log.debug("%s: no saved programs read ahead (%s: %s)", self.label, type(error).__name__, error)
            return
        if started:
            log.info("%s: reading %d saved program%s ahead", self.label, len(started), "s" if len(started) > 1 else "")

    def release(self) -> None:
        """Drop the device copy of the weights (compiled programs stay: they hold no weights)."""
        if self._runtime is not None:
            self._runtime.saved_programs.drop_read_ahead(self.saved_role)
        with self._lock:
            if self.state is not None:
                log.info("%s: device weights released", self.label)
                if self._slice() is not None:
                    self._driver.release()
            self.state = None

    @property
    def program_count(self) -> int:
        return sum(len(v) for v in self._variants.values())

    # --- calls ----------------------------------------------------------------------------------------------
    def _arguments(self, args, kwargs) -> tuple[list, dict, Any]:
        """(positional, keyword, options) of a call, the module itself not included."""
        bound = self.signature.bind(self.module, *args, **kwargs)
        positional, keyword = [], {}
        # Before a *args parameter, named parameters must be passed by position too (LLaMA's forward(input_ids,
        # *args, **kwargs)): a keyword there would collide with the positional rest.
        by_position = (inspect.Parameter.POSITIONAL_ONLY,) + (
            (inspect.Parameter.POSITIONAL_OR_KEYWORD,) if any(
                p.kind is inspect.Parameter.VAR_POSITIONAL for p in self.signature.parameters.values()) else ())
        for i, (name, value) in enumerate(bound.arguments.items()):
            if i == 0:
                continue  # the module
            kind = self.signature.parameters[name].kind
            if kind in by_position:
                positional.append(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                positional.extend(value)
            elif kind is inspect.Parameter.VAR_KEYWORD:
                keyword.update(value)
            else:
                keyword[name] = value
        options = keyword.pop(self.options_arg, None) if self.options_arg else None
        return positional, keyword, options

    def __call__(self, *args, **kwargs):
        entered = time.perf_counter()
        positional, keyword, options = self._arguments(args, kwargs)
        if options is not None and self.prepare_options is not None:
            options = self.prepare_options(dict(options))
        recorded = {name: keyword.pop(name) for name in self.recorded_args if isinstance(keyword.get(name), list)}
        call = split_call((positional, keyword), self.constant_args + self.device_constant_args)
        runtime = self.runtime
        mesh = self.mesh
        state = self.place()
        base = (call.structure, tuple(sorted(recorded)), tuple(mesh.shape.items()), self.attention,
                tuple(sorted(state)), self._quantized_key)
        context = _read_context(options, recorded)
        with self._lock:
            variant = next((v for v in self._variants.get(base, ()) if v.reads.matches(context)), None)
            compiled = 0.0
            if variant is None:
                before = time.perf_counter()
                variant = self._compile(base, call, options, recorded, state, positional, keyword)
                compiled = time.perf_counter() - before
        self.stats.calls += 1
        start = time.perf_counter()
        if self._slice() is not None:
            result, arrays, keys = self._run_on_slice(variant, call, state)
            if self.mutable_lists:
                _write_back(_lists_of(positional, keyword), variant.list_layouts, arrays, keys)
            self.stats.call_seconds += time.perf_counter() - entered - compiled
            return result
        inputs = self._inputs(call)
        placed = time.perf_counter()
        import jax

        try:
            out, arrays = variant.executable(state, inputs)
            jax.block_until_ready((out, arrays))
        except Exception as error:  # noqa: BLE001 - the devices' own errors, named for the user where we can
            if is_out_of_memory(error):
                raise self._memory_error(call, error) from error
            raise
        ran = time.perf_counter()
        result = runtime.to_cpu(out)
        if self.mutable_lists:
            _write_back(_lists_of(positional, keyword), variant.list_layouts, arrays)
        self.stats.to_device_seconds += placed - start
        self.stats.run_seconds += ran - placed
        self.stats.to_host_seconds += time.perf_counter() - ran
        self.stats.call_seconds += time.perf_counter() - entered - compiled
        return result

    def _run_on_slice(self, variant: _Variant, call, state):
        """A call on a multi-host slice: its host inputs sent to every process, the program run on all of them.
        Values an earlier call left on the devices (a causal VAE's caches) stay there: every process holds its
        shards of them under the same keys, and the call names them. Returns (result, arrays left in the call's
        lists, their keys)."""
        from ..engine.dtypes import host_array

        inputs, specs, order = [], [], []
        for leaf in call.leaves:
            if isinstance(leaf, DeviceValue):
                if leaf.key is None:
                    raise InputError(f"{self.label}: a value kept on this process's devices was passed to a program "
                                     "that runs on the whole slice: start the decode again")
                order.append(["device", leaf.key])
            else:
                order.append(["host", len(inputs)])
                inputs.append(host_array(leaf))
                specs.append(self._spec(tuple(leaf.shape)))
        return self._driver.run(self.mesh, state, variant.executable, variant.number, inputs, specs, order)

    def _memory_error(self, call, error, needs: str = "") -> InputError:
        """Out of device memory for ``call`` (None: while placing the weights), in words (``engine.memory``)."""
        doing = f"for {_describe(call)}" if call is not None else "while placing its weights"
        return out_of_memory(self.label, doing, error, self.mesh, needs=needs, plan=PLAN_NATIVE,
                             fix=self.memory_hint or "Use more devices (a larger slice) or smaller inputs.")

    def _inputs(self, call) -> list:
        return [leaf.array if isinstance(leaf, DeviceValue) else self.runtime.put(leaf, self._input_sharding(leaf))
                for leaf in call.leaves]

    def _abstract_inputs(self, call) -> list:
        """The call's inputs as shapes (to trace without data): host tensors may be on ``meta``."""
        import jax

        from ..engine.dtypes import jax_dtype

        return [leaf.array if isinstance(leaf, DeviceValue) else
                jax.ShapeDtypeStruct(tuple(leaf.shape), jax_dtype(leaf.dtype), sharding=self._input_sharding(leaf))
                for leaf in call.leaves]

    def _spec(self, shape: tuple[int, ...], mesh=None) -> tuple:
        mesh = mesh or self.mesh
        if self.input_spec is not None:
            return tuple(self.input_spec(tuple(shape), dict(mesh.shape)))
        dp = mesh.shape["dp"]
        if dp > 1 and len(shape) >= 1 and shape[0] % dp == 0:
            return ("dp",)
        return ()

    def _input_sharding(self, leaf):
        """Inputs replicated, except a leading batch that dp divides (CFG's cond and uncond) split over dp; or as
        ``input_spec`` places them."""
        return self.runtime.sharding(self.mesh, self._spec(tuple(leaf.shape)))

    # --- compiling ------------------------------------------------------------------------------------------
    def program_function(self, call, options, mesh, recorded: dict | None = None,
                         plan: list | None = None) -> tuple[Callable, OptionReads, list]:
        """The function the runtime compiles for ``call`` on ``mesh``: ``fn(weights, leaves) -> (output, the
        arrays left in the call's lists)``; the options (and ``recorded`` arguments) the model reads while it is
        traced are recorded in the returned ``OptionReads``, and the lists' layout in the returned list (filled by
        the trace). ``plan``: per mutated list, per item, the steady value a settled item becomes (``None``: left
        as it is; see ``CacheSettling``)."""
        env = self.runtime.env
        kitchen.install(env)  # the comfy-kitchen ops ComfyUI's model code may call (none on older ComfyUI)
        reads = OptionReads()
        options_view = RecordedOptions(options, reads) if options is not None else None
        recorded_view = {name: RecordedSequence(("argument", name), value, reads)
                         for name, value in (recorded or {}).items()}
        holder = _Holder(self.module)
        method, options_arg, attention = self.method, self.options_arg, self.attention
        mutable, settle, trace_context = self.mutable_lists, self.settle, self.trace_context
        quantized_weights = dict(self.quantized)
        device_constants = _concrete_constants(call, self.device_constant_args)
        layouts: list = []

        def keep_placed(array):  # a list's array leaves placed as the next call takes it
            import jax

            return jax.lax.with_sharding_constraint(array, self.runtime.sharding(mesh, self._spec(array.shape, mesh)))

        def program(weights, leaves):
            weights, leaves = env.j2t_iso((weights, leaves))
            positional, keyword = rebuild(call.structure, leaves, call.objects)
            for name, array in device_constants.items():
                keyword[name] = _on_devices_concrete(array, env)
            if options_view is not None:
                keyword[options_arg] = options_view
            keyword.update(recorded_view)
            arrays: list = []
            layouts.clear()
            with module_state_kept(holder), env, attention_scope(attention, mesh), \
                    quantized.tracing(quantized_weights), (
                    trace_context() if trace_context else contextlib.nullcontext()):
                params = {f"inner.{k}": v for k, v in quantized.assemble(weights, quantized_weights).items()}
                out = torch.func.functional_call(holder, params, ((method, positional, keyword),), strict=False,
                                                 tie_weights=False)
                for i, values in enumerate(_lists_of(positional, keyword) if mutable else ()):
                    layout = []
                    for j, value in enumerate(values):
                        steady = plan[i][j] if plan is not None else None
                        if steady is not None:
                            settled = settle.settle(value, steady)
                            value = value if settled is None else settled
                        if isinstance(value, torch.Tensor):
                            layout.append(("array", len(arrays)))
                            arrays.append(value)
                        else:
                            layout.append(("value", value))
                    layouts.append(layout)
            return env.t2j_iso(out), [keep_placed(a) for a in env.t2j_iso(arrays)]

        return program, reads, layouts

    def _abstract_layouts(self, call, options, recorded, state) -> list:
        """Trace ``call`` without compiling or running it: each mutated list's final items, arrays as shapes."""
        import jax

        from ..engine.runtime import tracing

        program, _, layouts = self.program_function(call, options, self.mesh, recorded)
        with tracing():
            _, arrays = jax.eval_shape(program, state, self._abstract_inputs(call))
        return [[arrays[ref] if kind == "array" else ref for kind, ref in layout] for layout in layouts]

    def _settle_plan(self, call, options, recorded, state, positional, keyword) -> list | None:
        """For a first call (its lists hold no arrays yet), what each list item settles to: the items some later call
        leaves, found by tracing the first call and then later ones (``settle.probe``) without data, each taking
        what the one before left, until the first call's items can be settled into a later call's (see
        ``CacheSettling``)."""
        lists = _lists_of(positional, keyword)
        if not lists or any(isinstance(v, (torch.Tensor, DeviceValue)) for values in lists for v in values):
            return None
        try:
            first = self._abstract_layouts(call, options, recorded, state)
            if not any(_is_struct(v) for values in first for v in values):
                return None  # the call carries nothing to the next one (ComfyUI's Wan VAE without a cache)
            probe_positional, probe_keyword = self.settle.probe(list(positional), dict(keyword))
            left = first
            for _ in range(self.settle.probe_steps):
                probe = self._probe_call(probe_positional, probe_keyword, left)
                left = self._abstract_layouts(probe, options, recorded, state)
                plan = self._plan_towards(first, left)
                if plan is not _UNSETTLED:
                    return plan
        except Exception as error:  # noqa: BLE001 - a probe that does not fit only costs the second call a program
            log.info("%s: the caches' steady form could not be found ahead (%s: %s); the second call compiles a "
                     "program of its own", self.label, type(error).__name__, error)
            return None
        log.info("%s: the caches reach no form the first call's can settle into within %d later calls; the second "
                 "call compiles a program of its own", self.label, self.settle.probe_steps)
        return None

    def _probe_call(self, positional: list, keyword: dict, left: list):
        """The probe's call with each of its lists holding what the call before left in it (``settle.carried``)."""
        filled = iter(left)

        def fill(value):
            if not isinstance(value, list):
                return value
            return [DeviceValue(v) if _is_struct(v) else v for v in self.settle.carried(list(value), next(filled))]

        return split_call(([fill(v) for v in positional], {k: fill(v) for k, v in keyword.items()}))

    def _plan_towards(self, first: list, later: list):
        """Per list, per item, the value the first call's item settles to so that every list that carries arrays
        holds what ``later`` holds (``None``: already the same); ``_UNSETTLED`` where an item cannot be settled,
        ``None`` where nothing needs to be."""
        plan, changes = [], 0
        for before, after in zip(first, later):
            if not any(_is_struct(v) for v in after):  # an index list: the caller passes it afresh
                plan.append([None] * len(before))
                continue
            if len(before) != len(after):
                return _UNSETTLED
            row = []
            for value, target in zip(before, after):
                if _same_item(value, target):
                    row.append(None)
                elif self.settle.settles(value, target):
                    row.append(target)
                    changes += 1
                else:
                    return _UNSETTLED
            plan.append(row)
        return plan if changes else None

    def _compile_for_slice(self, program, state: dict, call, number: int):
        """The program traced here once, serialized (``jax.export``) and sent to the workers; every process runs the
        same serialized module."""
        from ..multihost.bridge import export_program

        names = list(state)
        weights = dict(zip(names, _structs(state[n] for n in names)))
        example = self._abstract_inputs(call)
        log.info("preparing %s for %s on the slice (once per shape)", self.label, _describe(call))
        blob, executable = export_program(program, (weights, example))
        self._driver.add_program(number, blob)
        return executable

    def _compile(self, base: tuple, call, options, recorded, state, positional, keyword) -> _Variant:
        runtime = self.runtime
        key = ("bridge", self.label, self._serial, base, len(self._variants.get(base, ())))
        saved = None if self._slice() is not None else saved_program(
            self, base, call, options, recorded, state, f"{self.label} for {_describe(call)}")
        loaded = saved.load() if saved is not None else None
        if loaded is not None:  # a program an earlier process saved: nothing traced, nothing compiled
            executable, reads, layouts = loaded
            self.stats.programs_loaded += 1
            return self._add_variant(base, _Variant(reads, key, executable, layouts, self.program_count))
        plan = self._settle_plan(call, options, recorded, state, positional, keyword) if (
            self.settle is not None and self.mutable_lists) else None
        program, reads, layouts = self.program_function(call, options, self.mesh, recorded, plan)
        start = time.perf_counter()
        number = self.program_count
        try:
            if self._slice() is not None:
                executable = self._compile_for_slice(program, state, call, number)
            else:
                executable = runtime.compiled(key, program, state, self._inputs(call), to_save=saved is not None,
                                              describe=f"{self.label} for {_describe(call)}")
        except UntraceableModel:
            raise
        except Exception as error:  # noqa: BLE001 - any failure inside the model's code while traced
            if is_out_of_memory(error):
                raise self._memory_error(call, error) from error
            raise explain_trace_failure(self.label, error) from error
        self.stats.trace_compile_seconds += time.perf_counter() - start
        reads.finish(_read_context(options, recorded))
        if saved is not None:
            saved.save(executable, reads, layouts)
        return self._add_variant(base, _Variant(reads, key, executable, [list(layout) for layout in layouts], number))

    def _add_variant(self, base: tuple, variant: _Variant) -> _Variant:
        self.stats.programs += 1
        reads = variant.reads
        variants = self._variants.setdefault(base, [])
        variants.append(variant)
        if len(variants) > VARIANT_WARNING and base not in self._warned_variants:
            self._warned_variants.add(base)
            log.warning("%s: %d programs for one input shape: the model reads options that change between calls "
                        "(%s); each new value compiles again", self.label, len(variants), reads.describe())
        return variant


@contextlib.contextmanager
def module_state_kept(module: torch.nn.Module):
    """While the block runs (a trace of the module's own code, or an observation of it on ``meta``), whatever that
    code does to the modules' own state is undone when it ends, whether it succeeded or failed half way: every
    attribute of every submodule set back to the object it held (attributes added are removed), and the items of
    the lists and dicts they hold (the parameter, buffer and submodule tables among them) set back in place.

    Model code keeps state on its modules: ComfyUI 0.3.64's Wan VAEs reset their causal caches with ``clear_cache()``
    (a new list on the module, which the decode loop then passes to the next chunk), other models remember a
    computed table. A trace must leave none of its traced values there and must not replace what the caller's loop
    holds; the model, used on the host afterwards (the automatic mode's fallback, the same VAE without the node),
    runs exactly as it would without the pack."""
    saved = []
    for sub in module.modules():
        attributes = dict(vars(sub))
        items = {name: (list(value) if type(value) is list else dict(value))
                 for name, value in attributes.items() if type(value) in (list, dict)}
        saved.append((sub, attributes, items))
    try:
        yield
    finally:
        for sub, attributes, items in saved:
            current = vars(sub)
            for name in [n for n in current if n not in attributes]:
                del current[name]
            current.update(attributes)
            for name, value in items.items():
                held = attributes[name]
                if type(held) is list:
                    held[:] = value
                else:
                    held.clear()
                    held.update(value)


def _concrete_constants(call, names: tuple[str, ...]) -> dict:
    """name -> a concrete JAX array, for each constant keyword argument of ``call`` named in ``names``: made before
    the trace, so that the model's code meets its values (a JAX array made while a program is traced is a tracer,
    and a boolean mask must be concrete to index with)."""
    if not names:
        return {}
    import jax.numpy as jnp

    _, keyword = rebuild(call.structure, call.leaves, call.objects)
    return {n: jnp.asarray(keyword[n].detach().cpu().numpy()) for n in names if isinstance(keyword.get(n), torch.Tensor)}


def _on_devices_concrete(array, env):
    from torchax.tensor import Tensor

    return Tensor(array, env)


def _structs(values) -> list:
    import jax

    return [jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for v in values]


def _read_context(options, recorded: dict) -> dict:
    """What a compiled program may have read besides its inputs: the options, and the recorded arguments under
    ("argument", name)."""
    context = dict(options) if options is not None else {}
    context.update({("argument", name): value for name, value in recorded.items()})
    return context


def _is_struct(value) -> bool:
    import jax

    return isinstance(value, jax.ShapeDtypeStruct)


_UNSETTLED = object()


def _same_item(value, target) -> bool:
    """Whether two items of a list (shape structs or Python values) are the same for a program's structure."""
    if _is_struct(value) or _is_struct(target):
        return (_is_struct(value) and _is_struct(target) and value.shape == target.shape
                and value.dtype == target.dtype)
    return type(value) is type(target) and value == target




def _host_bytes(named) -> int:
    """The bytes of ``named`` tensors on the host, each distinct tensor once."""
    total = 0
    for tensor in {id(t): t for _, t in named}.values():
        try:
            total += tensor.numel() * tensor.element_size()
        except Exception:  # noqa: BLE001 - a tensor subclass without sizes counts as nothing
            continue
    return total


def _lists_of(positional, keyword) -> list[list]:
    """The lists passed to a call (as arguments, not inside other values), in argument order."""
    return [v for v in list(positional) + list(keyword.values()) if isinstance(v, list)]


def _write_back(targets: list[list], layouts: list, arrays, keys=None) -> None:
    """Give the caller's lists the values the program left in them: arrays stay on the devices (``DeviceValue``,
    with the key every process of a slice holds it under), other values (indices, ``None``) as they were when
    traced."""
    for target, layout in zip(targets, layouts):
        target[:] = [DeviceValue(arrays[ref], keys[ref] if keys else None) if kind == "array" else ref
                     for kind, ref in layout]


class _Holder(torch.nn.Module):
    """Lets ``torch.func.functional_call`` swap the module's tensors while any function of it runs."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.inner = module

    def forward(self, call):
        method, positional, keyword = call
        return method(self.inner, *positional, **keyword)


def _describe(call) -> str:
    shapes = [tuple(leaf.shape) for leaf in call.leaves[:3]]
    more = f" +{len(call.leaves) - 3} inputs" if len(call.leaves) > 3 else ""
    return "inputs " + ", ".join("x".join(map(str, s)) or "scalar" for s in shapes) + more


_OUR_CODE = ("/torch/", "/torchax/", "/jax/", "/jaxlib/", "/tpu_runtime/", "/functools.py", "/contextlib.py")


def explain_trace_failure(label: str, error: BaseException) -> UntraceableModel:
    """What failed while tracing ``label``'s code, in words a user can act on: the op or the Python construct,
    and the line of the model's own code where it happened."""
    import jax

    name = type(error).__name__
    text = str(error).strip().splitlines()[0] if str(error).strip() else name
    concrete = (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError,
                jax.errors.TracerIntegerConversionError, jax.errors.TracerArrayConversionError)
    if isinstance(error, concrete):
        what = ("data-dependent Python control flow: a value computed from the inputs is used as a Python "
                "number or truth value (`if tensor`, `.item()`, `int(tensor)`), which a compiled program cannot do")
    elif name == "OperatorNotFound":
        op = text.replace("Operator with name ", "").replace(" has no lowering", "")
        what = f"the op {op} has no JAX lowering in torchax"
    else:
        what = f"{name}: {text}"
    where = ""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if not any(part in frame.filename.replace("\\", "/") for part in _OUR_CODE):
            where = f" at {frame.filename}:{frame.lineno} in {frame.name}()" + (
                f": `{frame.line.strip()}`" if frame.line else "")
            break
    return UntraceableModel(
        f"{label} cannot run on the TPU runtime: {what}{where}. Remove the TPU node in front of this model to run "
        f"it with ComfyUI's own code on the host (the model itself is unchanged)."
    )
