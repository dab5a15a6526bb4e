"""Quantized weights on the devices: ComfyUI's ``QuantizedTensor`` weights placed in their packed form and
dequantized inside the compiled program by ComfyUI's own layer code.

ComfyUI (0.33 and later) loads quantized files (the ``*_fp8_scaled`` files its templates download, converted from
their ``scaled_fp8`` marker and per-layer ``scale_weight``; files with per-layer ``comfy_quant`` entries: fp8, int8,
mxfp8, nvfp4) into ``mixed_precision_ops`` layers whose weight is a comfy-kitchen ``QuantizedTensor``: a wrapper
tensor around the packed data and its layout's parameters (scales). How the bridge runs them:

- **Placement** (``device_parts``): each QuantizedTensor is taken apart by its own ``__tensor_flatten__``. The packed
  data goes to the devices under the weight's own name, split by the weight's rule (fp8 bytes as fp8, int8 as int8,
  nvfp4 as packed uint8: 1, 1 and 1/2 byte per element); each of its tensor parameters under ``name:field``, split
  as the weight where it has the weight's rank and the axis divides it. Block scales that cuBLAS's tiled layout
  holds (nvfp4's fp8 scales per 16 values, mxfp8's e8m0 scales per 32) are rearranged on the host into their plain
  ``[rows, blocks]`` layout, which splits over the mesh as the weight does.
- **In the program** (``assemble``): the QuantizedTensor is built again around the traced arrays
  (``__tensor_unflatten__``), so ComfyUI's own layer code runs as on the host: where it dequantizes (fp8, nvfp4 and
  mxfp8 on a machine without fp8 and fp4 matmuls) it dequantizes inside the program, where it runs its int8 matmul
  (an int8 layer whose input has the dtype its weight was loaded for: the input quantized per row, W8A8) the
  program does, an int8 ``dot_general`` accumulating in int32 (the MXU on a TPU). torchax hands every op that has a QuantizedTensor
  argument to the QuantizedTensor's own dispatch (``install``), and the comfy-kitchen ops that dispatch calls
  (``torch.ops.comfy_kitchen.dequantize_*``, ``int8_linear``) are lowered here to JAX (``LOWERINGS``), as
  comfy-kitchen's eager CPU backend computes them. A plain-layout block scale carries a trailing unit axis inside
  the program, which tells the lowering it needs no un-tiling.
- **Patches**: a LoRA on a quantized layer is applied by ComfyUI on the host, which quantizes the patched weight
  again (same layout and shapes); the bridge re-places that weight's parts, and nothing recompiles.

Layouts lowered: fp8 per tensor (e4m3, e5m2), int8 per tensor or per channel (with or without ConvRot rotation),
nvfp4, mxfp8. Any other layout is refused by name when the node is applied (``check_supported``).

Nothing here imports comfy-kitchen: a QuantizedTensor is recognised by what it has, and everything of kitchen's
this uses comes from the tensor (its class, its layout's class).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..errors import InputError

SEPARATOR = ":"  # the device name of a weight's parameter: "blocks.0.ffn.0.weight:scale"


@dataclass(frozen=True)
class BlockScales:
    """A layout's block scales: the parameter holding them in cuBLAS's tiled layout, the values each scales along a
    row, and the values a byte of packed data holds."""

    field: str
    block: int
    per_byte: int = 1


# Layout families (a layout class or one of its bases, by name) -> their block scales (None: a scale per tensor or
# per row).
LAYOUTS = {
    "TensorCoreFP8Layout": None,
    "TensorWiseINT8Layout": None,
    "TensorCoreNVFP4Layout": BlockScales("block_scale", 16, per_byte=2),
    "TensorCoreMXFP8Layout": BlockScales("scale", 32),
}


def is_quantized(tensor) -> bool:
    """Whether ``tensor`` is a comfy-kitchen QuantizedTensor (a wrapper around packed data and a layout)."""
    return isinstance(tensor, torch.Tensor) and hasattr(tensor, "_qdata") and hasattr(tensor, "_layout_cls") \
        and hasattr(type(tensor), "__tensor_unflatten__")


def _family(tensor) -> str | None:
    """The layout family (a key of ``LAYOUTS``) of a QuantizedTensor, or None for a layout not lowered here."""
    names = {cls.__name__ for cls in tensor.layout_cls.__mro__}
    return next((family for family in LAYOUTS if family in names), None)


@dataclass(frozen=True)
class QuantizedSpec:
    """What a quantized weight is apart from its arrays: rebuilt around the traced arrays in the program, and part of
    the program's identity (a weight that changes layout compiles again)."""

    tensor_class: type
    layout: str  # the layout's registered name, e.g. "TensorCoreFP8E4M3Layout"
    params_class: type
    fields: tuple[tuple[str, str], ...]  # (parameter, attribute name of the flattened tensor)
    non_tensor: tuple[tuple[str, Any], ...]  # orig_dtype, orig_shape, flags
    blocks: BlockScales | None = None  # placed in their plain layout (nvfp4 / mxfp8 block scales)

    @property
    def plain(self) -> tuple[str, ...]:
        return (self.blocks.field,) if self.blocks else ()

    def context(self) -> dict:
        return {"layout_cls": self.layout, "params_class": self.params_class, "tensor_fields": dict(self.fields),
                "non_tensor_fields": dict(self.non_tensor)}


def describe(tensor) -> QuantizedSpec:
    """The spec of a QuantizedTensor (its own flattening: the packed data and its tensor parameters)."""
    _, ctx = tensor.__tensor_flatten__()
    family = _family(tensor)
    blocks = LAYOUTS[family] if family else None
    return QuantizedSpec(
        tensor_class=type(tensor), layout=ctx["layout_cls"], params_class=ctx["params_class"],
        fields=tuple(ctx["tensor_fields"].items()), non_tensor=tuple(sorted(ctx["non_tensor_fields"].items())),
        blocks=blocks if blocks and blocks.field in ctx["tensor_fields"] else None)


def describe_all(named) -> dict[str, QuantizedSpec]:
    """name -> spec of every QuantizedTensor among ``named`` (name, tensor) pairs."""
    return {name: describe(t) for name, t in named if is_quantized(t)}


def check_supported(module: torch.nn.Module, label: str) -> None:
    """Refuse a model holding a quantized layout this module does not lower, naming the layer and the layout."""
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if is_quantized(tensor) and _family(tensor) is None:
            raise InputError(
                f"{label}: the weight {name} is quantized as {tensor._layout_cls}, which the TPU runtime does not "
                f"run (it runs fp8, int8 with or without ConvRot, nvfp4 and mxfp8 weights): use a file of one of "
                f"those formats (or bf16), or remove the TPU node to run this model on the host")


@dataclass
class WeightStorage:
    """How a module's weights are stored, by elements: per storage (a dtype, or a quantized layout and its packed
    dtype)."""

    elements: dict[str, int]
    quantized: bool = False
    fp8: bool = False

    def describe(self) -> str:
        total = sum(self.elements.values()) or 1
        parts = sorted(self.elements.items(), key=lambda kv: -kv[1])
        return ", ".join(f"{name} {100 * n / total:.0f}%" for name, n in parts)


def weight_storage(module: torch.nn.Module) -> WeightStorage:
    """How ``module``'s parameters and buffers are stored (for the log line that says what a model computes in)."""
    elements: dict[str, int] = {}
    quantized = fp8 = False
    for _, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if is_quantized(tensor):
            quantized = True
            name = f"{tensor._layout_cls} ({str(tensor._qdata.dtype).replace('torch.', '')})"
        else:
            name = str(tensor.dtype).replace("torch.", "")
            fp8 = fp8 or tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        elements[name] = elements.get(name, 0) + tensor.numel()
    return WeightStorage(elements, quantized, fp8)


# --- placement --------------------------------------------------------------------------------------------------------
def _plain_blocks(blocked: torch.Tensor, rows: int, blocks: int) -> torch.Tensor:
    """Block scales in cuBLAS's tiled layout (128-row by 4-block tiles, padded) as their plain [rows, blocks] matrix
    (comfy-kitchen's ``from_blocked``; torch reshapes, so it works on ``meta`` too)."""
    row_tiles, block_tiles = -(-rows // 128), -(-blocks // 4)
    plain = (blocked.reshape(-1, 32, 4, 4).transpose(1, 2).reshape(row_tiles, block_tiles, 128, 4)
             .permute(0, 2, 1, 3).reshape(row_tiles * 128, block_tiles * 4))
    return plain[:rows, :blocks].contiguous()


def _as_stored(value: torch.Tensor) -> torch.Tensor:
    """A parameter as the devices hold it: e8m0 block scales (no JAX/numpy dtype on every version) as their bytes."""
    if str(value.dtype) == "torch.float8_e8m0fnu":
        return value.view(torch.uint8)
    return value


class Part(NamedTuple):
    """One array a weight is placed as: its device name, an identity (tied weights are placed once), the host tensor
    and the weight it belongs to."""

    name: str
    key: tuple
    value: torch.Tensor
    weight: str


def parts_of(name: str, tensor) -> list[Part]:
    """The arrays a weight is placed as: a plain tensor itself; a QuantizedTensor its packed data under ``name``
    and each tensor parameter under ``name:field`` (block scales in their plain layout)."""
    if not is_quantized(tensor):
        return [Part(name, (id(tensor),), tensor, name)]
    spec = describe(tensor)
    qdata = tensor._qdata
    out = [Part(name, (id(qdata),), qdata, name)]
    for field, _ in spec.fields:
        value = getattr(tensor._params, field)
        if field in spec.plain and value.ndim == 2:
            rows, blocks = qdata.shape[0], qdata.shape[1] * spec.blocks.per_byte // spec.blocks.block
            value = _plain_blocks(value, rows, blocks)
        out.append(Part(f"{name}{SEPARATOR}{field}", (id(getattr(tensor._params, field)), field), _as_stored(value),
                        name))
    return out


def device_parts(named) -> list[Part]:
    """Every array ``named`` (name, tensor) pairs are placed as (see ``parts_of``)."""
    return [part for name, tensor in named for part in parts_of(name, tensor)]


def storage_shape(tensor) -> tuple[int, ...]:
    """The shape a weight has on the devices (a QuantizedTensor's packed data)."""
    return tuple(tensor._qdata.shape) if is_quantized(tensor) else tuple(tensor.shape)


def part_specs(parts: list[Part], specs: dict[str, tuple], mesh_sizes: dict[str, int]) -> dict[str, tuple]:
    """The PartitionSpec of every part, from its weight's (``specs``, by weight name: the packed data's): a
    parameter of a quantized weight is split as the weight along each axis of the weight's rank that the mesh axis
    divides (a vector along the weight's first axis), else whole."""
    ranks = {p.name: p.value.ndim for p in parts if p.name == p.weight}
    out = {}
    for part in parts:
        weight = specs[part.weight]
        if part.name == part.weight:
            out[part.name] = weight
            continue
        shape = tuple(part.value.shape)
        axes = weight if len(shape) == ranks[part.weight] else weight[:1] if len(shape) == 1 else ()
        out[part.name] = tuple(a if a is not None and i < len(shape) and shape[i] % mesh_sizes.get(a, 1) == 0
                               else None for i, a in enumerate(axes))
    return out


def device_bytes(state: dict, name: str) -> int:
    """Bytes the devices hold for weight ``name`` (its packed data and parameters), all shards together."""
    return sum(a.size * a.dtype.itemsize for k, a in state.items()
               if k == name or k.startswith(name + SEPARATOR))


# --- in the program ---------------------------------------------------------------------------------------------------
def assemble(weights: dict, quantized: dict[str, QuantizedSpec]) -> dict:
    """``weights`` (device name -> traced tensor) with each quantized weight's parts built back into its
    QuantizedTensor under the weight's name. Runs inside the torchax environment."""
    if not quantized:
        return weights
    out = dict(weights)
    for name, spec in quantized.items():
        if name not in out:
            continue  # left on the host (a text model's embedding)
        inner = {"_qdata": out.pop(name)}
        for field, attribute in spec.fields:
            value = out.pop(f"{name}{SEPARATOR}{field}")
            inner[attribute] = value.unsqueeze(-1) if field in spec.plain else value
        out[name] = spec.tensor_class.__tensor_unflatten__(inner, spec.context(), None, None)
    return out


def signature(quantized: dict[str, QuantizedSpec]) -> tuple:
    """What a program compiled for these quantized weights depends on besides the arrays' shapes."""
    return tuple(sorted((name, spec.layout, spec.plain, spec.non_tensor) for name, spec in quantized.items()))


@contextlib.contextmanager
def tracing(quantized: dict[str, QuantizedSpec]):
    """While a program with quantized weights is traced: comfy-kitchen's own dispatch (its ``int8_linear`` called by
    ComfyUI's fused activation path) picks the runtime's implementation (``torchax`` backend)."""
    if not quantized:
        yield
        return
    registry = _kitchen_registry(next(iter(quantized.values())))
    if registry is None:
        yield
        return
    with registry.use_backend(_BACKEND):
        yield


# --- torchax: QuantizedTensor ops and comfy-kitchen's ops ------------------------------------------------------------
_BACKEND = "torchax"


def install(env) -> None:
    """Teach the torchax environment ``env`` QuantizedTensors (once): an op with a QuantizedTensor argument goes to
    the QuantizedTensor's own dispatch (the torch-level call to the dispatcher, which decomposes it as on the host;
    the aten op to ``__torch_dispatch__``, run inside the environment), and comfy-kitchen's quantization ops have
    JAX lowerings."""
    if getattr(env, "_quantized_installed", False):
        return
    from torchax.tensor import OperatorNotFound

    original = env.dispatch

    def dispatch(func, types, args=(), kwargs=None):
        quantized = _first_quantized((args, kwargs))
        if quantized is None:
            return original(func, types, args, kwargs)
        if not isinstance(func, torch._ops.OpOverload):
            raise OperatorNotFound(f"{func} takes a QuantizedTensor: the dispatcher decomposes it")
        enabled = env.enabled
        try:
            with env:
                return type(quantized).__torch_dispatch__(func, types, args, kwargs or {})
        finally:
            env.enabled = enabled

    env.dispatch = dispatch
    for name, lowering in LOWERINGS.items():
        packet = getattr(getattr(torch.ops, "comfy_kitchen", None), name, None)
        if packet is not None:
            env.override_op_definition(packet.default, _on_arrays(env, lowering))
    env._quantized_installed = True


def _on_arrays(env, lowering):
    """``lowering`` (on jax arrays) as torchax calls an op: torchax tensors in and out."""

    def run(*args, **kwargs):
        return env.j2t_iso(lowering(*env.t2j_iso(args), **env.t2j_iso(kwargs)))

    run.__name__ = f"comfy_kitchen_{lowering.__name__}"
    return run


def _first_quantized(tree):
    import torch.utils._pytree as pytree

    return next((leaf for leaf in pytree.tree_leaves(tree) if is_quantized(leaf)), None)


def _kitchen_registry(spec: QuantizedSpec):
    """comfy-kitchen's backend registry (from the QuantizedTensor's own package), with the runtime's backend
    registered in it; None when that kitchen has none."""
    import sys

    package = spec.tensor_class.__module__.split(".")[0]
    registry_module = sys.modules.get(f"{package}.registry")
    registry = getattr(registry_module, "registry", None)
    if registry is None or not hasattr(registry, "use_backend"):
        return None
    if not registry.is_available(_BACKEND):
        registry.register(_BACKEND, _TorchaxBackend, {"int8_linear": None})
    return registry


class _TorchaxBackend:
    """comfy-kitchen's functions as a backend of its registry, for traced tensors: each calls the kitchen op that
    this module lowers."""

    @staticmethod
    def int8_linear(x, weight, weight_scale, bias=None, out_dtype=None, convrot=False, convrot_groupsize=256,
                    input_act=None):
        code = _CODES[out_dtype or torch.bfloat16]
        return torch.ops.comfy_kitchen.int8_linear(x, weight, weight_scale, bias, code, convrot, convrot_groupsize,
                                                   input_act)


# --- the lowerings: comfy-kitchen's eager CPU backend (backends/eager/quantization.py), in JAX ----------------------
_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _out_dtype(code: int):
    import jax.numpy as jnp

    return {0: jnp.float32, 1: jnp.float16, 2: jnp.bfloat16}[code]


def dequantize_fp8(x, scale, code):
    dtype = _out_dtype(code)
    return x.astype(dtype) * scale.astype(dtype)


def _e2m1(nibbles, dtype):
    """fp4 e2m1 codes (sign, 2 exponent bits, 1 mantissa bit) as values: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives."""
    import jax.numpy as jnp

    mantissa = (nibbles & 1).astype(dtype)
    exponent = (nibbles >> 1) & 3
    power = jnp.left_shift(jnp.ones_like(exponent), jnp.maximum(exponent, 1) - 1).astype(dtype)
    magnitude = jnp.where(exponent == 0, mantissa * 0.5, (1 + mantissa * 0.5) * power)
    return jnp.where((nibbles & 8) != 0, -magnitude, magnitude)


def _unblocked(scales, rows: int, blocks: int):
    """Block scales as [rows, blocks]: a plain-layout one (its trailing unit axis dropped), or a tiled one
    un-tiled as comfy-kitchen's ``from_blocked`` does."""
    if scales.ndim == 3:
        return scales[..., 0]
    row_tiles, block_tiles = -(-rows // 128), -(-blocks // 4)
    plain = (scales.reshape(-1, 32, 4, 4).transpose(0, 2, 1, 3).reshape(row_tiles, block_tiles, 128, 4)
             .transpose(0, 2, 1, 3).reshape(row_tiles * 128, block_tiles * 4))
    return plain[:rows, :blocks]


def dequantize_nvfp4(qx, tensor_scale, block_scales, code, hi_first=True):
    import jax.numpy as jnp

    dtype = _out_dtype(code)
    rows, cols = qx.shape[0], qx.shape[1] * 2
    high, low = qx >> 4, qx & 15
    nibbles = jnp.stack([high, low] if hi_first else [low, high], axis=-1).reshape(rows, cols)
    values = _e2m1(nibbles, dtype).reshape(rows, cols // 16, 16)
    total = tensor_scale.astype(dtype) * _unblocked(block_scales, rows, cols // 16).astype(dtype)
    return (values * total[..., None]).reshape(rows, cols).astype(dtype)


def _e8m0(exponents):
    """e8m0 block scales (biased powers of two; 0 reads as 0) as float32."""
    import jax
    import jax.numpy as jnp

    if exponents.dtype != jnp.uint8:
        exponents = jax.lax.bitcast_convert_type(exponents, jnp.uint8)
    biased = exponents.astype(jnp.int32)
    value = jax.lax.bitcast_convert_type(jnp.left_shift(biased, 23), jnp.float32)
    return jnp.where(biased == 0, jnp.float32(0), value)


def dequantize_mxfp8(qx, block_scales, code):
    import jax.numpy as jnp

    rows, cols = qx.shape
    scales = _e8m0(_unblocked(block_scales, rows, cols // 32))
    data = qx.astype(jnp.float32).reshape(rows, cols // 32, 32) * scales[..., None]
    return data.reshape(rows, cols).astype(_out_dtype(code))


def dequantize_int8_simple(q, scale):
    import jax.numpy as jnp

    return q.astype(jnp.float32) * scale


def dequantize_int8_simple_dtype(q, scale, code):
    return dequantize_int8_simple(q, scale).astype(_out_dtype(code))


def hadamard(size: int):
    """ConvRot's normalized regular Hadamard matrix of ``size`` (a power of 4), float32 (comfy-kitchen's
    ``_build_hadamard``), as a constant."""
    import numpy as np

    if size < 4 or size & (size - 1) or math.log(size, 4) % 1:
        raise ValueError(f"ConvRot's Hadamard size must be a power of 4, got {size}")
    h4 = np.array([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=np.float32)
    h = h4
    while h.shape[0] < size:
        h = np.kron(h, h4)
    return h / np.float32(size ** 0.5)


def _rotated(x, group: int, h):
    """``x``'s last axis in groups of ``group``, each multiplied by ``h`` (ConvRot's rotation)."""
    import jax.numpy as jnp

    shape = x.shape
    grouped = x.reshape(-1, shape[-1] // group, group)
    return jnp.matmul(grouped, jnp.asarray(h, dtype=x.dtype)).reshape(shape)


def dequantize_int8_convrot_weight(q, scale, group_size):
    return _rotated(dequantize_int8_simple(q, scale), group_size, hadamard(group_size).T)


def dequantize_int8_convrot_weight_dtype(q, scale, group_size, code):
    return dequantize_int8_convrot_weight(q, scale, group_size).astype(_out_dtype(code))


def dequantize_int8_embedding(q, scale, indices, group_size, code):
    import jax.numpy as jnp

    x = jnp.take(q, indices, axis=0).astype(jnp.float32)
    x = x * (jnp.take(scale, indices, axis=0).astype(jnp.float32) if scale.ndim >= 2 else scale.astype(jnp.float32))
    if group_size > 0:
        x = _rotated(x, group_size, hadamard(group_size).T)
    return x.astype(_out_dtype(code))


def _input_act(x, input_act):
    """comfy-kitchen's ``apply_input_act``: the activation a fused int8 linear applies to its input first."""
    import jax
    import jax.numpy as jnp

    if input_act in (None, "none"):
        return x
    wide = x.astype(jnp.float32)  # torch computes a half-precision activation in float32, rounded once
    if input_act == "gelu_tanh":
        return jax.nn.gelu(wide, approximate=True).astype(x.dtype)
    if input_act == "swiglu":
        gate, up = jnp.split(x, 2, axis=-1)
        return jax.nn.silu(gate.astype(jnp.float32)).astype(x.dtype) * up
    raise ValueError(f"unsupported input_act: {input_act!r}")


def quantize_int8_rows(x):
    """Each row of ``x`` as int8 with its own scale (|max| / 127), rounded half to even, computed in ``x``'s dtype
    as comfy-kitchen's ``quantize_int8_rowwise``: (int8 values, float32 scales [..., 1])."""
    import jax.numpy as jnp

    scale = jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True).astype(jnp.float32) / 127.0, 1e-30)
    divisor = scale.astype(x.dtype)
    divisor = jnp.where(divisor == 0, jnp.finfo(x.dtype).tiny, divisor)
    return jnp.clip(jnp.round(x / divisor), -128, 127).astype(jnp.int8), scale


def int8_linear(x, weight, weight_scale, bias, code, convrot=False, convrot_groupsize=256, input_act=None):
    """W8A8: ``x`` quantized per row, an int8 x int8 matmul accumulated in int32 (the MXU's int8 path on a TPU),
    scaled back by the row's and the weight's scales."""
    import jax
    import jax.numpy as jnp

    out_dtype = _out_dtype(code)
    x = _input_act(x, input_act)
    if convrot:
        x = _rotated(x, convrot_groupsize, hadamard(convrot_groupsize))
    shape = x.shape
    q, row_scale = quantize_int8_rows(x.reshape(-1, shape[-1]))
    with jax.named_scope("int8_matmul"):
        accumulated = jax.lax.dot_general(q, weight, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    scale = row_scale * weight_scale.astype(jnp.float32).reshape(1, -1)
    out = (accumulated.astype(jnp.float32) * scale).astype(out_dtype)
    if bias is not None:
        out = out + bias.astype(out_dtype).reshape(1, -1)
    return out.reshape(*shape[:-1], weight.shape[0])


#: comfy-kitchen op name -> JAX lowering (the op's own arguments, dtypes as kitchen's codes).
LOWERINGS = {
    "dequantize_fp8": dequantize_fp8,
    "dequantize_nvfp4": dequantize_nvfp4,
    "dequantize_mxfp8": dequantize_mxfp8,
    "dequantize_int8_simple": dequantize_int8_simple,
    "dequantize_int8_simple_dtype": dequantize_int8_simple_dtype,
    "dequantize_int8_convrot_weight": dequantize_int8_convrot_weight,
    "dequantize_int8_convrot_weight_dtype": dequantize_int8_convrot_weight_dtype,
    "dequantize_int8_embedding": dequantize_int8_embedding,
    "int8_linear": int8_linear,
}


# --- planning: a model as a released quantized file holds it ----------------------------------------------------------
#: plan's weight formats -> (ComfyUI's format name in its QUANT_ALGOS, the quantizer's arguments).
PLAN_FORMATS = {
    "fp8": ("float8_e4m3fn", {"scale": "recalculate"}),
    "int8": ("int8_tensorwise", {}),
    "nvfp4": ("nvfp4", {"scale": "recalculate"}),
    "mxfp8": ("mxfp8", {}),
}


def quantize_blocks(module: torch.nn.Module, fmt: str) -> int:
    """``module`` as ComfyUI holds a released quantized file of it (``*_fp8_scaled``, int8, nvfp4, mxfp8 files
    quantize the linear layers of the repeated blocks and keep the rest): every linear weight inside a
    ``ModuleList``'s blocks replaced by the QuantizedTensor ComfyUI's own quantizer makes of it (on ``meta``: shapes
    only). Returns how many weights were quantized."""
    if fmt not in PLAN_FORMATS:
        raise InputError(f"weights {fmt!r}: one of bf16, {', '.join(PLAN_FORMATS)}")
    try:
        from comfy.quant_ops import QUANT_ALGOS, QuantizedTensor
    except ImportError:
        raise InputError(f"weights {fmt}: this ComfyUI has no quantized weights (comfy/quant_ops.py, ComfyUI 0.33 "
                         "and later)") from None
    name, arguments = PLAN_FORMATS[fmt]
    layout = QUANT_ALGOS[name]["comfy_tensor_layout"]
    linears = {id(m): m for blocks in module.modules() if isinstance(blocks, torch.nn.ModuleList)
               for m in blocks.modules() if isinstance(m, torch.nn.Linear) and not is_quantized(m.weight)}
    for linear in linears.values():
        quantized = QuantizedTensor.from_float(linear.weight.detach(), layout, **arguments)
        linear.weight = torch.nn.Parameter(quantized, requires_grad=False)
    return len(linears)
