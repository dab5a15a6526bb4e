"""A call of a torch method split into what a compiled program takes and what it is compiled for.

A bridged model is called with a mix of values: tensors (latents, timesteps, text, masks, VACE's context, a
ControlNet's residuals), Python numbers and strings (LTX-Video's frame rate, VACE's strengths), ``None`` for
inputs a model kind leaves out, nested lists and dicts of those, and objects (functions of a patch). ``split_call``
turns such a call into

- the *dynamic leaves*: every tensor, in a fixed order; they become the program's array inputs;
- the *structure*: a hashable description of everything else, tensor shapes and dtypes included. Two calls with
  the same structure run the same program; anything else compiles another one (a Python number is a constant of
  the program, one program per value, as ``jax.jit`` treats static arguments).
- *constant tensors*: the tensors of arguments named in ``constants`` are constants of the program like Python
  numbers (their values are in the structure): a model whose code branches on a tensor's values or sizes a tensor
  by them (LTX's denoise mask: which frames are kept, which tokens take part) traces with the values known. Meant
  for tensors that stay the same through a sampling run.

``RecordedSequence`` does for a list argument what ``RecordedOptions`` does for the options: ComfyUI passes its text
models the prompt's token count as a Python list (``num_tokens``) that most of them never read; the list keys a
program only when the model read it while traced.

``RecordedOptions`` stands in for ComfyUI's ``transformer_options`` while a program is traced. The options carry
values that change at every call (the current sigma, the conds' uuids) beside values a model reads (patches, block
replacements): a program depends only on what the model read during its trace, so those reads are recorded, with
a fingerprint of each value, and a compiled program is reused for a later call only when every value it read is
the same. A model that copies the whole options into a dict of its own (LTX's ``{**transformer_options, **kwargs}``)
gets its tensors and lists as stand-ins that record a read when they are used (``RecordedTensor``,
``RecordedSequence``): the sampler's per-call values (the current ``sigmas``, the conds' ``uuids``) key a program only
if the model uses them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

MISSING = ("<missing>",)
_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


class DeviceValue:
    """A value that lives on the devices between two calls of a bridged method (a causal VAE's convolution cache):
    the host holds this handle, the program takes the array itself. Shape and dtype are the array's."""

    __slots__ = ("array", "key")

    def __init__(self, array, key: str | None = None):
        self.array = array
        self.key = key  # on a multi-host slice: the name every process holds its shards of the array under

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def dtype(self):
        return self.array.dtype


@dataclass
class SplitCall:
    """``structure`` (hashable: the program's identity apart from weights and mesh), ``leaves`` (the tensors and
    device values, in order) and ``objects`` (the non-value objects, by position, to rebuild the call)."""

    structure: tuple
    leaves: list
    objects: list = field(default_factory=list)


def split_call(tree: Any, constants: tuple[str, ...] = ()) -> SplitCall:
    """Split a nested call value (see the module's docstring); tensors under a dict key named in ``constants`` are
    constants of the program."""
    leaves: list = []
    objects: list = []

    def walk(x, name=None):
        if name in constants and isinstance(x, torch.Tensor):
            objects.append(x)
            return ("C", len(objects) - 1, fingerprint(x, []))
        if isinstance(x, torch.Tensor):
            leaves.append(x)
            return ("T", tuple(x.shape), str(x.dtype))
        if isinstance(x, DeviceValue):
            leaves.append(x)
            return ("T", x.shape, str(x.dtype))
        if isinstance(x, _SCALARS):
            return ("S", type(x).__name__, x)
        if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
            return ("L" if type(x) is list else "U", tuple(walk(v) for v in x))
        if type(x) is dict and all(isinstance(k, _SCALARS) for k in x):
            return ("D", tuple((k, walk(v, k)) for k, v in x.items()))
        objects.append(x)
        return ("O", len(objects) - 1, type(x).__qualname__, id(x))

    return SplitCall(walk(tree), leaves, objects)


def rebuild(structure: tuple, leaves: list, objects: list) -> Any:
    """The call value ``structure`` describes, with ``leaves`` (in order) where its tensors were; constant tensors
    stay host tensors (inside a program, torch computes with them on the host while the program is traced, and
    what they meet on the devices takes them as constants)."""
    position = iter(range(len(leaves)))

    def build(node):
        kind = node[0]
        if kind == "T":
            return leaves[next(position)]
        if kind == "C":
            return objects[node[1]]
        if kind == "S":
            return node[2]
        if kind == "L":
            return [build(c) for c in node[1]]
        if kind == "U":
            return tuple(build(c) for c in node[1])
        if kind == "D":
            return {k: build(c) for k, c in node[1]}
        return objects[node[1]]

    return build(structure)


# --- transformer_options: what a model reads ----------------------------------------------------------------------
def fingerprint(value: Any, keep: list) -> Any:
    """A hashable stand-in for ``value`` that is equal for equal values: tensors by shape, dtype and a digest of
    their bytes, containers element by element, numbers and strings by value, any other object by identity (kept
    alive in ``keep`` so that its id cannot be reused)."""
    if isinstance(value, torch.Tensor):
        data = value.detach().to("cpu").contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
        digest = hashlib.blake2b(raw, digest_size=16).hexdigest()
        return ("T", tuple(data.shape), str(data.dtype), digest)
    if isinstance(value, _SCALARS) or value is MISSING:
        return ("S", type(value).__name__, value)
    if isinstance(value, (list, tuple)):
        return ("L", type(value).__name__, tuple(fingerprint(v, keep) for v in value))
    if isinstance(value, dict):
        return ("D", tuple((fingerprint(k, keep), fingerprint(v, keep)) for k, v in value.items()))
    keep.append(value)
    return ("O", type(value).__qualname__, id(value))


@dataclass
class OptionReads:
    """The options a traced model read: key -> fingerprint of the value it saw (``everything``: it iterated them)."""

    reads: dict = field(default_factory=dict)
    everything: bool = False
    keep: list = field(default_factory=list)

    def matches(self, options: dict) -> bool:
        """Whether a later call's ``options`` hold the same values for every key this trace read."""
        if self.everything:
            return fingerprint(dict(options), []) == self.reads.get("<all>")
        scratch: list = []
        return all(fingerprint(options.get(k, MISSING), scratch) == fp for k, fp in self.reads.items())

    def finish(self, options: dict) -> None:
        if self.everything:
            self.reads = {"<all>": fingerprint(dict(options), self.keep)}

    def describe(self) -> str:
        return "every option" if self.everything else ", ".join(sorted(map(str, self.reads))) or "none"


class RecordedSequence(Sequence):
    """A list argument as the model sees it while traced: any read of it (length, item, iteration, comparison) is
    recorded in ``log`` under ``name`` with a fingerprint of the whole list. Not a ``list`` subclass on purpose: C
    code reads a list's items without calling its methods, which would read it unrecorded."""

    def __init__(self, name: str, values: list, log: "OptionReads"):
        self._name, self._values, self._log = name, list(values), log

    def _note(self) -> list:
        if self._name not in self._log.reads:
            self._log.reads[self._name] = fingerprint(self._values, self._log.keep)
        return self._values

    def __getitem__(self, index):
        return self._note()[index]

    def __len__(self) -> int:
        return len(self._note())

    def __iter__(self):
        return iter(self._note())

    def __contains__(self, value) -> bool:
        return value in self._note()

    def __reversed__(self):
        return reversed(self._note())

    def __eq__(self, other) -> bool:
        return self._note() == (list(other) if isinstance(other, RecordedSequence) else other)

    __hash__ = None

    def __repr__(self) -> str:
        return repr(self._note())


class RecordedTensor(torch.Tensor):
    """A tensor option handed to a whole copy of the options: the first torch operation on it (an item, arithmetic,
    a comparison, a cast) records the option's value in ``log``; a copy that is never used records nothing."""

    @staticmethod
    def __new__(cls, value: torch.Tensor, key, log: "OptionReads"):
        stand_in = torch.Tensor._make_subclass(cls, value)
        stand_in._recorded = (key, value, log)
        return stand_in

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def plain(x):
            if isinstance(x, RecordedTensor):
                key, value, log = x._recorded
                if key not in log.reads:
                    log.reads[key] = fingerprint(value, log.keep)
                return value
            return x

        args, kwargs = torch.utils._pytree.tree_map(plain, (args, kwargs or {}))
        return func(*args, **kwargs)


def _stand_in(key, value, log: "OptionReads"):
    """What a whole copy of the options holds for ``value``: tensors and lists as stand-ins that record their read
    when used, anything else ``None`` (recorded at once)."""
    if type(value) is torch.Tensor:
        return RecordedTensor(value, key, log)
    if type(value) is list:
        return RecordedSequence(key, value, log)
    return None


class RecordedOptions(dict):
    """``transformer_options`` as the model sees it while traced: reads are recorded in ``log`` (the first read of
    each key, unless the model wrote it first); writes stay in this copy. ``copy()`` shares the log.

    Copying the whole options (``{**options}``, ``dict(options)``: Python asks ``keys()``, then each item) records
    each value when it is handed out, tensors and lists when the copy's holder uses them (``_stand_in``)."""

    def __init__(self, data: dict, log: OptionReads, written: set | None = None):
        super().__init__(data)
        self._log = log
        self._written = set(written or ())
        self._handing_out: set = set()

    def _note(self, key) -> None:
        if key not in self._written and key not in self._log.reads:
            self._log.reads[key] = fingerprint(dict.get(self, key, MISSING), self._log.keep)

    def __getitem__(self, key):
        value = super().__getitem__(key)
        if key in self._handing_out:
            self._handing_out.discard(key)
            stand_in = _stand_in(key, value, self._log) if key not in self._written else None
            if stand_in is not None:
                return stand_in
        self._note(key)
        return value

    def get(self, key, default=None):
        self._note(key)
        return super().get(key, default)

    def __contains__(self, key) -> bool:
        self._note(key)
        return super().__contains__(key)

    def setdefault(self, key, default=None):
        self._note(key)
        self._written.add(key)
        return super().setdefault(key, default)

    def pop(self, key, *default):
        self._note(key)
        self._written.add(key)
        return super().pop(key, *default)

    def __setitem__(self, key, value) -> None:
        self._written.add(key)
        super().__setitem__(key, value)

    def __delitem__(self, key) -> None:
        self._written.add(key)
        super().__delitem__(key)

    def update(self, *args, **kwargs) -> None:
        other = dict(*args, **kwargs)
        self._written.update(other)
        super().update(other)

    def _everything(self) -> None:
        self._log.everything = True

    def __iter__(self):
        self._everything()
        return super().__iter__()

    def keys(self):
        self._handing_out = set(dict.keys(self))  # a copy follows: each item is recorded as it is handed out
        return super().keys()

    def values(self):
        self._everything()
        return super().values()

    def items(self):
        self._everything()
        return super().items()

    def copy(self) -> "RecordedOptions":
        data = {k: dict.__getitem__(self, k) for k in dict.keys(self)}  # the items, none handed out nor read
        return RecordedOptions(data, self._log, self._written)

    def __copy__(self) -> "RecordedOptions":
        return self.copy()

    def __reduce__(self):  # deep copies and pickles see a plain dict
        self._everything()
        return (dict, (dict(dict.items(self)),))
