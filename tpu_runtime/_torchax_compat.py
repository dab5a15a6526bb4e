"""Import torchax on torch versions newer than the torchax release expects.

torchax 0.0.13 (the newest release) references ATen ops and overloads at import time that newer torch builds
no longer have: the named-tensor overloads (``aten::prod.dim_Dimname``, ``aten::all.dimname`` ...) are gone in
torch 2.13, and whole ops (``aten::cholesky``, ``aten::qr``, some collectives) in torch 2.15. Each reference is
only a key in a lowering or autocast table, so a stand-in that can never match a real op is harmless.

``import_torchax`` first tries a plain import. Only if that fails with such a missing-op ``AttributeError`` does
it retry with lookups of missing ``torch.ops.aten`` ops and overloads answered by stand-ins, then restores torch.
With a torchax release that imports cleanly this module does nothing; delete it when the minimum torchax
version is one that does.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys

import torch
import torch._ops as torch_ops

log = logging.getLogger(__name__)

#: names of the ops / overloads answered by stand-ins during the last tolerant import.
tolerated_missing_ops: list[str] = []


class MissingAtenOp:
    """Stands in for an ATen op or overload that this torch build does not have.

    Hashable and unique, so it can sit in torchax's tables without ever matching a real op; attribute access
    (``.default``, ``.overloads()`` ...) yields further stand-ins.
    """

    def __init__(self, name: str):
        self._name = name

    def __repr__(self) -> str:
        return f"<missing torch op {self._name}>"

    def name(self) -> str:
        return self._name

    def overloads(self) -> list[str]:
        return []

    def __getattr__(self, key: str) -> "MissingAtenOp":
        if key.startswith("__"):
            raise AttributeError(key)
        return MissingAtenOp(f"{self._name}.{key}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} does not exist in torch {torch.__version__}")


@contextlib.contextmanager
def _tolerate_missing_aten_ops():
    packet_getattr = torch_ops.OpOverloadPacket.__getattr__
    namespace_getattr = torch_ops._OpNamespace.__getattr__

    def packet_lookup(self, key):
        try:
            return packet_getattr(self, key)
        except AttributeError:
            if key.startswith("__") or not self._qualified_op_name.startswith("aten::"):
                raise
            name = f"{self._qualified_op_name}.{key}"
            tolerated_missing_ops.append(name)
            return MissingAtenOp(name)

    def namespace_lookup(self, op_name):
        try:
            return namespace_getattr(self, op_name)
        except (AttributeError, RuntimeError):
            if op_name.startswith("__") or self.name != "aten":
                raise
            name = f"aten::{op_name}"
            tolerated_missing_ops.append(name)
            return MissingAtenOp(name)

    torch_ops.OpOverloadPacket.__getattr__ = packet_lookup
    torch_ops._OpNamespace.__getattr__ = namespace_lookup
    try:
        yield
    finally:
        torch_ops.OpOverloadPacket.__getattr__ = packet_getattr
        torch_ops._OpNamespace.__getattr__ = namespace_getattr


def _forget_partial_import() -> None:
    for name in [m for m in sys.modules if m == "torchax" or m.startswith("torchax.")]:
        del sys.modules[name]


# torchax imports these lazily when its first Environment is built; they name ops too.
_LAZY_SUBMODULES = (
    "torchax.ops.jaten",
    "torchax.ops.jc10d",
    "torchax.ops.jtorch",
    "torchax.ops.jtorchvision_nms",
    "torchax.decompositions",
)


def _import_all():
    module = importlib.import_module("torchax")
    for name in _LAZY_SUBMODULES:
        importlib.import_module(name)
    return module


def import_torchax():
    """Return the ``torchax`` module, importing it tolerantly when this torch build lacks ops it names."""
    if "torchax.decompositions" in sys.modules:
        return sys.modules["torchax"]
    try:
        return _import_all()
    except AttributeError as exc:
        if "overload name" not in str(exc) and "has no attribute" not in str(exc):
            raise
        first_error = exc
    _forget_partial_import()
    tolerated_missing_ops.clear()
    with _tolerate_missing_aten_ops():
        module = _import_all()
    log.info(
        "torchax %s imported on torch %s with %d missing ATen ops tolerated (first failure: %s)",
        getattr(module, "__version__", "?"), torch.__version__, len(tolerated_missing_ops), first_error,
    )
    return module


# --- in-place ops on views ------------------------------------------------------------------------------------------
# torchax 0.0.13 writes an in-place op's result back into the tensor a view was taken from only for the ops in its
# own mutation table (add_, mul_, clamp_ ...). Any other in-place op (addcmul_, addcdiv_, lerp_ ...) reaches it as a
# decomposition that updates a copy: ``e[..., :2].addcmul_(a, b)`` leaves ``e`` unchanged, with no error. ComfyUI
# 0.33's LLaMA RoPE is written exactly so. ``fix_in_place_ops_on_views`` registers every such op of an environment as
# its functional op followed by the write-back torchax uses for its own table. Drop it when torchax does this itself.
def _functional_of(op):
    """The functional overload of an in-place ATen overload (``aten.addcmul_.default`` -> ``aten.addcmul.default``),
    or None."""
    packet = op.overloadpacket
    name = packet.__name__
    if not name.endswith("_") or name.startswith("_") or name.endswith("__"):
        return None
    functional = getattr(torch.ops.aten, name[:-1], None)
    if functional is None:
        return None
    return getattr(functional, op._overloadname, None)


def fix_in_place_ops_on_views(env) -> list[str]:
    """Give every in-place ATen op that ``env`` lowers without writing through views the write-back; returns the ops
    fixed."""
    from torchax.ops import op_base, ops_registry

    fixed = []
    for table in (env._ops, env._decomps):
        for op, operator in list(table.items()):
            if not isinstance(op, torch_ops.OpOverload) or op.namespace != "aten" or operator.is_view_op:
                continue
            if not op._schema.arguments or not op._schema.arguments[0].is_write:
                continue
            functional = _functional_of(op)
            if functional is None:
                continue
            env._ops[op] = ops_registry.Operator(op, op_base.InplaceOp(functional), is_jax_function=False,
                                                 is_user_defined=True, needs_env=False, is_view_op=True)
            fixed.append(str(op))
    return fixed
