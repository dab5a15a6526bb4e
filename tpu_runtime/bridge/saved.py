"""A bridged module's programs saved for later processes and loaded without tracing ComfyUI's code again
(``engine/program_store.py`` keeps the files; this module says what a bridged program is and what it needs).

A bridged program depends on more than its inputs' shapes (``program.BridgedModule``): the call's structure (its
Python values, ``calls.split_call``), the option values the model read while it was traced (``calls.OptionReads``:
a program is reused only for calls whose options hold the same values), the layout of the lists it writes back (a
causal VAE's caches, settled by probes when it was traced), the placed weights' names, shapes, dtypes and shardings
(quantized ones as their packed parts), the mesh, the attention, and the model itself: its classes, ComfyUI's code
and its modules' attributes (``program_key.describe_module``). All of it keys the file; the option reads and the
list layouts travel with the program (``extra``), so a loaded program is used for exactly the calls it was traced
for. Constant tensors (``constant_args``, ``device_constant_args``: a mask the model's code indexes with) are in the
call's structure by value, so a program traced with one mask is never loaded for another; a host-prepared forward
(``comfy.host_prepared``: MiniMax H3) is keyed by its compiled part and the layout its host part gives (the call's
Python values). A program whose key would hold an object another process cannot recognise (an option holding a function
made at run time, an object passed in the call) is not saved: said once per module in the log.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import types
from typing import Any

from ..engine.program_key import ProgramKey, describe_module, stable_text
from .calls import MISSING, OptionReads, fingerprint

log = logging.getLogger(__name__)

_FORMAT = 1  # of ``extra``


class _Unstable(Exception):
    """A value whose identity only this process knows."""


def global_name(obj: Any) -> str | None:
    """``module.qualname`` of a module-level function or class that another process finds under that name."""
    if not isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, type)):
        return None
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if not module or "<locals>" in qualname or "<lambda>" in qualname:
        return None
    found = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return f"{module}.{qualname}" if found is obj else None


def _callable_name(fn: Any) -> str | None:
    """A function's place in the code (closures too: their code is the package's, keyed by its sources)."""
    if fn is None:
        return None
    inner = getattr(fn, "__func__", fn)
    return f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', type(inner).__qualname__)}"


def stable_fingerprint(fp: Any, objects: dict[int, Any]) -> Any:
    """A ``calls.fingerprint`` as another process would make it: objects (kept by identity) by their global name;
    ``_Unstable`` for one without."""
    kind = fp[0]
    if kind in ("S", "T"):
        return fp
    if kind == "L":
        return ("L", fp[1], tuple(stable_fingerprint(v, objects) for v in fp[2]))
    if kind == "D":
        return ("D", tuple((stable_fingerprint(k, objects), stable_fingerprint(v, objects)) for k, v in fp[1]))
    if kind == "O":
        name = global_name(objects.get(fp[2]))
        if name is None:
            raise _Unstable(f"a {fp[1]} object")
        return ("G", name)
    raise _Unstable(f"a value fingerprinted as {kind!r}")


def _structure_text(node: Any) -> str:
    """The call's structure (``calls.split_call``) as text; ``_Unstable`` where it holds an object."""
    def check(n):
        kind = n[0]
        if kind == "O":
            raise _Unstable(f"a {n[2]} object passed in the call")
        if kind in ("L", "U"):
            for child in n[1]:
                check(child)
        elif kind == "D":
            for _, child in n[1]:
                check(child)

    check(node)
    return repr(node)


def _stable_reads(reads: OptionReads) -> dict:
    objects = {id(o): o for o in reads.keep}
    return {key: stable_fingerprint(fp, objects) for key, fp in reads.reads.items()}


def _stable_current(key, context: dict, everything: bool):
    """The stable fingerprint of what ``context`` holds now for an option a saved program read (all of them)."""
    keep: list = []
    fp = fingerprint(dict(context), keep) if everything else fingerprint(context.get(key, MISSING), keep)
    return stable_fingerprint(fp, {id(o): o for o in keep})


class SavedProgram:
    """One bridged call's program as the saved programs know it: ``load()`` it, or ``save()`` it once compiled."""

    def __init__(self, bridged, base: tuple, call, options, recorded: dict, state: dict, describe: str):
        self.bridged, self.describe = bridged, describe
        self.context = dict(options) if options is not None else {}
        self.context.update({("argument", name): value for name, value in recorded.items()})
        self.key: ProgramKey | None = None
        try:
            fields = _program_fields(bridged, base, call)
        except _Unstable as why:
            _say_unsaved(bridged, f"its call holds {why}")
            return
        role = ProgramKey(bridged.saved_role,
                          {"program": fields, "model": describe_module(bridged.module, bridged.host_recorded)})
        self.key = bridged.runtime.program_key(role, (state, bridged._abstract_inputs(call)))

    def load(self) -> tuple[Any, OptionReads, list] | None:
        """(executable, the option reads it was traced with, its lists' layouts) of a saved program whose option
        reads hold the values this call's options hold; None when there is none."""
        if self.key is None:
            return None

        def accept(extra) -> bool:
            if not isinstance(extra, dict) or extra.get("format") != _FORMAT:
                return False
            try:
                return all(_stable_current(k, self.context, extra["everything"]) == fp
                           for k, fp in extra["reads"].items())
            except _Unstable:
                return False

        loaded = self.bridged.runtime.load_program(self.key, self.describe, accept)
        if loaded is None:
            return None
        extra = loaded.extra
        reads = OptionReads(everything=extra["everything"])
        if reads.everything:
            reads.reads = {"<all>": fingerprint(dict(self.context), reads.keep)}
        else:
            reads.reads = {k: fingerprint(self.context.get(k, MISSING), reads.keep) for k in extra["reads"]}
        return loaded.executable, reads, [list(layout) for layout in extra["layouts"]]

    def save(self, executable, reads: OptionReads, layouts: list) -> None:
        if self.key is None:
            return
        try:
            stable = _stable_reads(reads)
        except _Unstable as why:
            _say_unsaved(self.bridged, f"the model read an option holding {why}")
            return
        extra = {"format": _FORMAT, "everything": reads.everything, "reads": stable,
                 "layouts": [list(layout) for layout in layouts]}
        variant = hashlib.sha256(repr(sorted(stable.items(), key=repr)).encode()).hexdigest()
        self.bridged.runtime.save_program(self.key, executable, self.describe, extra=extra, variant=variant)


def saved_program(bridged, base: tuple, call, options, recorded: dict, state: dict,
                  describe: str) -> SavedProgram | None:
    """The saved-program side of a bridged call about to be compiled (``describe``: the call in the log's words);
    None where programs are not saved (saved programs turned off, a multi-host slice)."""
    if not bridged.runtime.saved_programs.enabled:
        return None
    return SavedProgram(bridged, base, call, options, recorded, state, describe)


def _program_fields(bridged, base: tuple, call) -> dict:
    structure, recorded_names, mesh_items, attention, _, quantized_key = base
    return {
        "method": _callable_name(bridged.method), "call": _structure_text(structure), "recorded": list(recorded_names),
        "mesh": [list(item) for item in mesh_items], "attention": stable_text(attention) or repr(attention),
        "quantized": stable_text(quantized_key) or _unstable("its quantized weights' layout"),
        "options_arg": bridged.options_arg, "prepare_options": _callable_name(bridged.prepare_options),
        "mutable_lists": bridged.mutable_lists, "settle": type(bridged.settle).__qualname__,
        "input_spec": _callable_name(bridged.input_spec), "trace_context": _callable_name(bridged.trace_context),
        "device_dtypes": _callable_name(bridged.device_dtypes), "constant_args": list(bridged.constant_args),
        "device_constant_args": list(bridged.device_constant_args),
    }


def _unstable(what: str):
    raise _Unstable(what)


def _say_unsaved(bridged, why: str) -> None:
    said = bridged.__dict__.setdefault("_unsaved_said", set())
    if why not in said:
        said.add(why)
        log.info("%s: its programs are not saved for later processes: %s, which another process cannot recognise",
                 bridged.label, why)

