"""Quantized weights on the devices (ComfyUI 0.33's comfy-kitchen QuantizedTensor weights): placed packed with their
scales, dequantized (or multiplied as int8) inside the program by ComfyUI's own layer code, equal to ComfyUI's own
CPU run on the same file.

Tiny models of ComfyUI's own classes are quantized by ComfyUI's own quantizers (``QuantizedTensor.from_float`` with
its layouts) and saved as the files its loaders read: per-layer ``weight`` + ``weight_scale`` (+ ``weight_scale_2``)
with the ``_quantization_metadata`` header, or the legacy ``scaled_fp8`` marker with per-layer ``scale_weight``; they
are read back by ComfyUI's own file loading (``load_torch_file``, ``convert_old_quants``). The kitchen ops the
program runs are checked against comfy-kitchen's eager CPU backend.
"""

import json
import logging
from pathlib import Path

import pytest
import torch
from comfy_native import comfyui_session, load_pack, relative, versions_param
from tpu_runtime.bridge.tiny import quantize, save_quantized  # noqa: F401 - ComfyUI's own layouts

pytestmark = pytest.mark.comfy_versions("0.33")

TOL = 1e-4
PROMPTS = ("a cat", "a dog running on the beach at sunset, cinematic")


@pytest.fixture(scope="module", params=versions_param())
def pack(request):
    with comfyui_session(request.param), torch.inference_mode():
        yield load_pack()


# --- files as ComfyUI writes them ---------------------------------------------------------------------------------
def save_scaled_fp8(state: dict, path, chosen, prefix: str = "", extra: dict | None = None):
    """The legacy ``*_fp8_scaled`` file: the ``chosen(name)`` weights float8_e4m3fn with a per-layer
    ``scale_weight``, and the ``scaled_fp8`` marker."""
    from safetensors.torch import save_file

    out = dict(extra or {})
    for key, value in state.items():
        if key.endswith(".weight") and value.ndim == 2 and chosen(key):
            scale = value.abs().max() / 448.0
            out[prefix + key] = (value / scale).to(torch.float8_e4m3fn)
            out[prefix + key[: -len("weight")] + "scale_weight"] = scale.float()
        else:
            out[prefix + key] = value
    out[prefix + "scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    save_file(out, str(path))
    return path


# umT5 (Wan's text encoder) at a reduced size, its layers in the formats ComfyUI 0.33 loads: those it dequantizes
# (fp8 e4m3 and e5m2, nvfp4, mxfp8) in one file, int8 (per tensor, and per row with ConvRot) in another.
FLOAT_FORMATS = {"q": ("float8_e4m3fn", {}), "k": ("float8_e5m2", {}), "v": ("nvfp4", {}), "o": ("mxfp8", {}),
                 "wi_0": ("nvfp4", {}), "wi_1": ("mxfp8", {}), "wo": ("float8_e4m3fn", {})}
CONVROT = ("int8_tensorwise", {"convrot": True, "convrot_groupsize": 16})
INT8_FORMATS = {"q": ("int8_tensorwise", {}), "k": ("int8_tensorwise", {}), "v": CONVROT, "o": CONVROT,
                "wi_0": ("int8_tensorwise", {}), "wi_1": CONVROT, "wo": CONVROT}
STORED = {"float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2", "nvfp4": "uint8", "mxfp8": "float8_e4m3fn",
          "int8_tensorwise": "int8"}


def _umt5_state(seed: int) -> tuple[dict, dict]:
    """Random weights of umT5 at the tests' reduced size (two blocks), and that size."""
    import comfy.ops
    import comfy.text_encoders.t5 as t5

    from tpu_runtime.bridge.tiny import TEXT_CONFIGS, random_state, umt5_config

    reduced = {**TEXT_CONFIGS["umt5"][1], "num_layers": 2}
    config = umt5_config(Path(comfy.ops.__file__).parents[1], **reduced)
    return random_state(t5.T5(config, torch.float32, "cpu", comfy.ops.manual_cast), seed), reduced


def load_text_encoder(path, reduced: dict):
    """A umT5 file as ComfyUI's Load CLIP (type wan) reads it: ``load_torch_file`` and ``convert_old_quants`` (what
    ``comfy.sd.load_clip`` does), then the Wan text encoder with the quantization ``t5_xxl_detect`` finds, built at
    the reduced size the file holds (ComfyUI's detection needs umT5-XXL's 24 blocks)."""
    import comfy.sd
    import comfy.text_encoders.sd3_clip as sd3_clip
    import comfy.text_encoders.wan as wan
    import comfy.utils

    sd, metadata = comfy.utils.load_torch_file(str(path), safe_load=True, return_metadata=True)
    sd, _ = comfy.utils.convert_old_quants(sd, model_prefix="", metadata=metadata)

    class Target:
        params: dict = {}
        clip = wan.te(**sd3_clip.t5_xxl_detect(sd))
        tokenizer = wan.WanT5Tokenizer

    tokenizer = {"spiece_model": sd.pop("spiece_model")}
    return comfy.sd.CLIP(Target(), tokenizer_data=tokenizer, state_dict=[sd],
                         parameters=comfy.utils.calculate_parameters(sd),
                         model_options={"dtype": torch.float32, "umt5xxl_model_config": reduced})


@pytest.fixture(scope="module")
def text_files(pack, tmp_path_factory):
    from tpu_runtime.bridge.tiny import umt5_tokenizer_data

    base = tmp_path_factory.mktemp("quantized_text")
    state, reduced = _umt5_state(seed=3)
    tokenizer = umt5_tokenizer_data()

    def chosen(formats):
        return lambda key: formats.get(key.split(".")[-2]) if key.startswith("encoder.block.") else None

    files = {kind: save_quantized(state, base / f"umt5_{kind}.safetensors", chosen(formats), extra=tokenizer)
             for kind, formats in (("float", FLOAT_FORMATS), ("int8", INT8_FORMATS))}
    files["scaled_fp8"] = save_scaled_fp8(state, base / "umt5_fp8_scaled.safetensors",
                                          lambda k: k.startswith("encoder.block."), extra=tokenizer)
    return {kind: (path, reduced) for kind, path in files.items()}


def weight_name(leaf: str, block: int = 0) -> str:
    """The name of umT5's layer ``leaf`` (q, k, v, o, wi_0, wi_1, wo) in block ``block``."""
    part = "1.DenseReluDense" if leaf.startswith("w") else "0.SelfAttention"
    return f"encoder.block.{block}.layer.{part}.{leaf}.weight"


def assert_packed(state: dict, formats: dict) -> None:
    """Each layer on the devices as its format stores it: its packed data's dtype, and its bytes per element (fp8,
    int8 and mxfp8 one byte, nvfp4 half a byte; with the scales: mxfp8 an e8m0 scale per 32 values, nvfp4 an fp8
    scale per 16, ConvRot's int8 a float32 scale per row)."""
    from tpu_runtime.bridge.quantized import device_bytes

    extra = {"nvfp4": 1 / 16, "mxfp8": 1 / 32}
    for leaf, (fmt, conf) in formats.items():
        name = weight_name(leaf)
        assert str(state[name].dtype) == STORED[fmt], name
        elements = state[name].size * (2 if fmt == "nvfp4" else 1)
        per_element = device_bytes(state, name) / elements
        row = state[name].shape[1] * (2 if fmt == "nvfp4" else 1)
        expected = (0.5 if fmt == "nvfp4" else 1) + extra.get(fmt, 0) + (4 / row if conf.get("convrot") else 0)
        assert expected <= per_element <= expected + 8 / elements, (name, per_element)


def tpu_text(pack, clip, **inputs):
    return pack.NODE_CLASS_MAPPINGS["TPUTextEncoder"]().apply(clip, **inputs)[0]


def encode(clip, text):
    import nodes

    return nodes.CLIPTextEncode().encode(clip, text)[0][0][0]


def text_model(clip):
    from tpu_runtime.bridge.text import bridged_text_models

    (model,) = bridged_text_models(clip).values()
    return model


# --- the kitchen ops, against comfy-kitchen's eager CPU backend ----------------------------------------------------
def _jax(t):
    import jax.numpy as jnp

    from tpu_runtime.engine.dtypes import host_array

    return jnp.asarray(host_array(t))


def _torch(a):
    import jax
    import numpy as np

    a = np.array(jax.device_get(a))
    return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16) if a.dtype.name == "bfloat16" else \
        torch.from_numpy(a)


def _lowered(fn, *args):
    """``fn`` (a lowering) jitted on ``args``: tensors as arrays, anything else static."""
    import jax

    positions = tuple(i for i, a in enumerate(args) if not isinstance(a, torch.Tensor))
    jitted = jax.jit(fn, static_argnums=positions)
    return _torch(jitted(*[_jax(a) if i not in positions else a for i, a in enumerate(args)]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kitchen_ops_lowered_as_kitchens_eager_backend_computes(dtype):
    """Every dequantization exactly as comfy-kitchen's eager CPU backend computes it (bit for bit; ConvRot's
    rotation, a float matmul, to its rounding), and the W8A8 linear, per-row input quantization and int8 matmul,
    to one rounding of the output (float32) or exactly (bfloat16)."""
    from comfy_kitchen.backends.eager import quantization as eager

    from tpu_runtime.bridge import quantized as q

    code = {torch.float32: 0, torch.bfloat16: 2}[dtype]
    g = torch.Generator().manual_seed(0)
    w, x, bias = torch.randn(48, 96, generator=g), torch.randn(2, 5, 96, generator=g), torch.randn(48, generator=g)

    def same(out, ref, tol=0.0):
        assert out.dtype == ref.dtype and out.shape == ref.shape
        assert (out.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()

    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        scale = w.abs().max() / torch.finfo(fp8).max
        packed = eager.quantize_per_tensor_fp8(w, scale, fp8)
        same(_lowered(q.dequantize_fp8, packed, scale, code), eager.dequantize_per_tensor_fp8(packed, scale, dtype))
    tensor_scale = w.abs().max() / (448 * 6)
    packed, blocked = eager.quantize_nvfp4(w, tensor_scale)
    reference = eager.dequantize_nvfp4(packed, tensor_scale, blocked, dtype)
    same(_lowered(q.dequantize_nvfp4, packed, tensor_scale, blocked, code), reference)
    plain = q._plain_blocks(blocked, 48, 96 // 16).unsqueeze(-1)  # as placed: the plain layout, marked
    same(_lowered(q.dequantize_nvfp4, packed, tensor_scale, plain, code), reference)
    packed, blocked = eager.quantize_mxfp8(w)
    same(_lowered(q.dequantize_mxfp8, packed, blocked.view(torch.uint8), code),
         eager.dequantize_mxfp8(packed, blocked, dtype))
    packed, scale = eager.quantize_int8_tensorwise(w)
    same(_lowered(q.dequantize_int8_simple_dtype, packed, scale, code),
         eager.dequantize_int8_simple_dtype(packed, scale, code))
    rotated, rows = eager.quantize_int8_convrot_weight(w, 16)
    same(_lowered(q.dequantize_int8_convrot_weight_dtype, rotated, rows, 16, code),
         eager.dequantize_int8_convrot_weight_dtype(rotated, rows, 16, code), tol=1e-3 if code else 1e-6)
    ids = torch.tensor([[3, 0, 7]])
    same(_lowered(q.dequantize_int8_embedding, rotated, rows, ids, 16, code),
         eager.dequantize_int8_embedding(rotated, rows, ids, 16, code), tol=1e-3 if code else 1e-6)
    for weight, weight_scale, convrot in ((packed, scale, False), (rotated, rows, True)):
        for act in (None, "gelu_tanh", "swiglu"):
            xs = torch.cat([x, x], dim=-1) if act == "swiglu" else x
            reference = eager.int8_linear(xs.to(dtype), weight, weight_scale, bias, dtype, convrot, 16, act)
            out = _lowered(q.int8_linear, xs.to(dtype), weight, weight_scale, bias, code, convrot, 16, act)
            same(out, reference, tol=1e-6 if dtype == torch.float32 else 0.0)


def test_block_scales_split_as_their_weight():
    """nvfp4's block scales, placed in their plain [rows, blocks] layout, split as their weight: a column-split
    weight (rows over tp) and a row-split one (its packed columns over tp) take their scales along; a per-tensor
    scale stays whole, and so does an axis tp does not divide."""
    from comfy_kitchen.tensor import QuantizedTensor  # its layouts register themselves

    from tpu_runtime.bridge import quantized as q

    g = torch.Generator().manual_seed(1)
    named = [(name, QuantizedTensor.from_float(torch.randn(256, 512, generator=g), "TensorCoreNVFP4Layout"))
             for name in ("up.weight", "down.weight")]
    parts = q.device_parts(named)
    shapes = {p.name: (tuple(p.value.shape), p.value.dtype) for p in parts}
    assert shapes["up.weight"] == ((256, 256), torch.uint8)  # two fp4 values a byte
    assert shapes["up.weight:block_scale"] == ((256, 32), torch.float8_e4m3fn)  # plain: one a 16 values
    assert shapes["up.weight:scale"] == ((), torch.float32)
    specs = q.part_specs(parts, {"up.weight": ("tp", None), "down.weight": (None, "tp")}, {"tp": 8})
    assert specs["up.weight:block_scale"] == ("tp", None) and specs["down.weight:block_scale"] == (None, "tp")
    assert specs["up.weight:scale"] == ()
    assert q.part_specs(parts, {"up.weight": ("tp", None), "down.weight": (None, "tp")},
                        {"tp": 64})["down.weight:block_scale"] == (None, None)  # 32 blocks a row: 64 does not divide
    # the plain layout is kitchen's own un-tiling of the blocked one
    from comfy_kitchen.float_utils import from_blocked

    tensor = named[0][1]
    plain = next(p.value for p in parts if p.name == "up.weight:block_scale")
    assert torch.equal(plain.view(torch.uint8), from_blocked(tensor._params.block_scale, 256, 32).view(torch.uint8))


# --- the text encoder: every format in one file ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["float", "scaled_fp8"])
def test_quantized_text_encoder_equals_native(pack, text_files, kind):
    """umT5 from a quantized file (fp8 e4m3 and e5m2, nvfp4 and mxfp8 layers in one file; or the legacy scaled fp8
    file as 0.33 converts it): its layers are QuantizedTensors, placed packed with their scales, and TPU Text
    Encoder equals ComfyUI's CPU encode, which dequantizes these formats exactly. One program; a second prompt
    compiles nothing."""
    from tpu_runtime.engine.runtime import compile_stats

    path, reduced = text_files[kind]
    clip = load_text_encoder(path, reduced)
    attention = clip.cond_stage_model.umt5xxl.transformer.encoder.block[0].layer[0].SelfAttention
    assert type(attention.q.weight).__name__ == "QuantizedTensor"
    on_tpu = tpu_text(pack, clip)
    assert relative(encode(on_tpu, PROMPTS[0]), encode(clip, PROMPTS[0])) < TOL
    compiles = compile_stats().xla_compiles
    assert relative(encode(on_tpu, PROMPTS[1]), encode(clip, PROMPTS[1])) < TOL
    model = text_model(on_tpu)
    assert model.stats.programs == 1 and compile_stats().xla_compiles == compiles
    assert_packed(model.state, FLOAT_FORMATS if kind == "float" else
                  dict.fromkeys(FLOAT_FORMATS, ("float8_e4m3fn", {})))
    if kind == "float":  # block scales in their plain layout: a row's scales, as many rows as the weight
        assert str(model.state[weight_name("o") + ":scale"].dtype) == "uint8"  # mxfp8's e8m0 scales
        assert model.state[weight_name("wi_0") + ":block_scale"].shape == (128, 64 // 16)
        assert model.state[weight_name("wi_1") + ":scale"].shape == (128, 64 // 32)


def with_dequantized_weights(layers):
    """While the block runs, ComfyUI's layers ``layers`` dequantize their weights (ComfyUI's own on-the-fly patch
    path, here with a patch that changes nothing): ComfyUI's float result for a quantized file."""
    import contextlib

    @contextlib.contextmanager
    def scope():
        for layer in layers:
            layer.weight_function = [lambda w: w]
        try:
            yield
        finally:
            for layer in layers:
                layer.weight_function = []

    return scope()


def quantized_layers(module):
    return [m for m in module.modules() if type(getattr(m, "weight", None)).__name__ == "QuantizedTensor"]


def test_int8_text_encoder_within_comfyuis_own_spread(pack, text_files):
    """umT5 from an int8 file (per tensor, and per row with ConvRot): ComfyUI runs its int8 layers W8A8 (each
    layer's input quantized per row), so an input rounding half a step either way flips and no two runs of
    different float arithmetic agree to float rounding. One encode (one model call) through TPU Text Encoder lies
    closer to ComfyUI's W8A8 encode than ComfyUI's own dequantized float encode of the same file does."""
    path, reduced = text_files["int8"]
    clip = load_text_encoder(path, reduced)
    on_tpu = tpu_text(pack, clip)
    for text in PROMPTS:
        native = encode(clip, text)
        with with_dequantized_weights(quantized_layers(clip.cond_stage_model)):
            spread = relative(encode(clip, text), native)
        assert relative(encode(on_tpu, text), native) < spread, text
    assert_packed(text_model(on_tpu).state, INT8_FORMATS)


def test_unsupported_layout_is_refused_when_the_node_is_applied(pack, text_files):
    """A layout the runtime does not lower (ConvRot W4A4) is refused by the node, naming the weight and the
    formats it runs, before anything is placed or compiled."""
    from comfy.quant_ops import QuantizedTensor

    from tpu_runtime.errors import InputError

    path, reduced = text_files["float"]
    clip = load_text_encoder(path, reduced)
    q = clip.cond_stage_model.umt5xxl.transformer.encoder.block[1].layer[0].SelfAttention.q
    q.weight = torch.nn.Parameter(QuantizedTensor.from_float(torch.randn(64, 64), "TensorCoreConvRotW4A4Layout",
                                                             convrot_groupsize=16), requires_grad=False)
    with pytest.raises(InputError, match="encoder.block.1.layer.0.SelfAttention.q.weight is quantized as "
                                         "TensorCoreConvRotW4A4Layout.*fp8, int8 with or without ConvRot, nvfp4"):
        tpu_text(pack, clip)


# --- int8 layers of a diffusion model: W8A8 ---------------------------------------------------------------------------
def _int8_feed_forward(convrot: bool):
    """Wan's feed-forward block (``WanFeedForward``: its GELU folded into the int8 down-projection) in ComfyUI's ops
    as ComfyUI builds a quantized diffusion model on this machine (``pick_operations``), its two layers loaded from
    an int8 state dict (with ConvRot, or per tensor)."""
    import comfy.ldm.wan.model as wan
    import comfy.ops

    class Config:
        quant_config = {"mixed_ops": True}

    ops = comfy.ops.pick_operations(None, torch.float32, load_device=torch.device("cpu"), model_config=Config())
    ffn = wan.WanFeedForward(ops.Linear(64, 128), torch.nn.GELU(approximate="tanh"), ops.Linear(128, 64))
    g = torch.Generator().manual_seed(5)
    state = {}
    for i, (rows, cols) in ((0, (128, 64)), (2, (64, 128))):
        conf = {"convrot": True, "convrot_groupsize": 16} if convrot else {}
        tensors, layer = quantize(torch.randn(rows, cols, generator=g) / cols ** 0.5, "int8_tensorwise", **conf)
        state.update({f"{i}.{k}": v for k, v in tensors.items()})
        state[f"{i}.bias"] = 0.1 * torch.randn(rows, generator=g)
        state[f"{i}.comfy_quant"] = torch.tensor(list(json.dumps(layer).encode()), dtype=torch.uint8)
    ffn.load_state_dict(state, strict=False)
    return ffn


@pytest.mark.parametrize("convrot", [False, True])
def test_int8_layers_run_w8a8_on_the_devices(pack, convrot):
    """int8 layers of a diffusion model quantize their input per row and multiply int8 by int8 (ComfyUI's CPU path
    on the host, an int8 ``dot_general`` accumulating in int32 in the program, the MXU's on a TPU): the bridged
    feed-forward equals ComfyUI's W8A8 result to float rounding, far closer than ComfyUI's own dequantized float
    result (the same weights without the int8 matmul) is to it."""
    import jax

    from tpu_runtime.bridge.calls import split_call
    from tpu_runtime.bridge.program import BridgedModule
    from tpu_runtime.bridge.rules import GENERIC
    from tpu_runtime.engine.runtime import tracing

    ffn = _int8_feed_forward(convrot)
    assert type(ffn[0].weight).__name__ == "QuantizedTensor" and ffn[0].weight._qdata.dtype == torch.int8
    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(6))
    native = ffn(x)
    for layer in (ffn[0], ffn[2]):
        layer.weight_function = [lambda w: w]  # ComfyUI's on-the-fly patch path: it dequantizes the weight
    dequantized = ffn(x)
    for layer in (ffn[0], ffn[2]):
        layer.weight_function = []
    bridged = BridgedModule(module=ffn, method=type(ffn).forward, rules=GENERIC, options_arg=None)
    out = bridged(x)
    assert relative(out, native) < 1e-6 < 0.01 * relative(dequantized, native)
    assert str(bridged.state["0.weight"].dtype) == "int8" and str(bridged.state["2.weight"].dtype) == "int8"
    program, _, _ = bridged.program_function(split_call(((x,), {})), None, bridged.mesh)
    with tracing():
        text = jax.jit(program).lower(bridged.state, bridged._abstract_inputs(split_call(((x,), {})))).as_text()
    int8_dots = [line for line in text.splitlines() if "dot_general" in line and "xi8>" in line and "xi32>" in line]
    assert len(int8_dots) == 2  # both layers: int8 x int8 -> int32


# --- plan: quantized weights per chip, and int8 on a TPU ------------------------------------------------------------
def test_plan_puts_quantized_weights_packed_per_chip(pack):
    """``plan --comfy-model --comfy-weights``: Wan 2.1 1.3B (every block, as released) placed on a v6e-8 as a
    quantized file holds it. Each weight whole on every chip (sp=8): fp8 about half the bytes of bf16 (a byte an
    element; the layers outside the blocks stay bf16), nvfp4 about a quarter (half a byte, an fp8 scale per 16
    values). Split over tp=4 (heads), the packed data and the scales shrink with it as bf16 does; the bf16 layers
    outside the blocks, whole on every chip, weigh a little more there."""
    from tpu_runtime.bridge.architectures import architecture
    from tpu_runtime.tools.plan_compile import shard_bytes
    from tpu_runtime.tools.plan_native import _native_program, _with_weights
    from tpu_runtime.tools.topology import parse_topology

    topo, arch = parse_topology("v6e-8"), architecture("wan2.1-t2v-1.3b")
    per_chip = {}
    for weights in ("bf16", "fp8", "nvfp4"):
        for mesh in ("dp=1,sp=8,tp=1", "dp=1,sp=2,tp=4"):
            module = _with_weights(arch.build(), weights)
            program, _, _ = _native_program(arch, module, topo, mesh, True, 480, 832, 81, None)
            per_chip[weights, mesh] = shard_bytes(program.example[0])
    whole, split = "dp=1,sp=8,tp=1", "dp=1,sp=2,tp=4"
    assert 0.50 < per_chip["fp8", whole] / per_chip["bf16", whole] < 0.52
    assert 0.28 < per_chip["nvfp4", whole] / per_chip["bf16", whole] < 0.30
    assert per_chip["fp8", split] / per_chip["bf16", split] < 0.55
    assert per_chip["nvfp4", split] / per_chip["bf16", split] < 0.35
    for weights in ("bf16", "fp8", "nvfp4"):  # the blocks' parts split over tp=4: a little over a quarter a chip
        assert per_chip[weights, split] < 0.3 * per_chip[weights, whole]


def test_plan_refuses_an_unknown_weight_format_before_compiling(pack, capsys):
    """An unknown format, or --comfy-weights for our families' --model (which read the format from their files), is
    refused with the choices before anything is built or compiled."""
    from tpu_runtime.errors import InputError
    from tpu_runtime.tools.cli import main
    from tpu_runtime.tools.plan_native import plan_native

    with pytest.raises(InputError, match="--comfy-weights int4: one of bf16, fp8, int8, nvfp4, mxfp8"):
        plan_native("wan2.1-t2v-1.3b", None, "v6e-8", weights="int4")
    assert main(["plan", "--model", "wan2.1-t2v-1.3b", "--topology", "v6e-8", "--comfy-weights", "fp8"]) == 2
    assert "--comfy-weights fp8 plans ComfyUI's own model classes: give --comfy-model" in capsys.readouterr().err


def test_int8_compiles_to_int8_matmuls_for_a_tpu(pack):
    """The int8 feed-forward as TPU Diffusion Model compiles it for a v6e-8 (libtpu's compiler, no TPU needed):
    its matmuls take int8 operands and accumulate in int32 on the MXU."""
    import re

    from tpu_runtime.bridge.calls import split_call
    from tpu_runtime.bridge.planning import PlannedProgram, _on_mesh, abstract_weights
    from tpu_runtime.bridge.program import BridgedModule
    from tpu_runtime.bridge.rules import GENERIC
    from tpu_runtime.engine.runtime import lower
    from tpu_runtime.tools.plan_compile import _lower_and_compile
    from tpu_runtime.tools.topology import parse_topology

    topo = parse_topology("v6e-8")
    ffn = _int8_feed_forward(convrot=True)
    bridged = BridgedModule(module=ffn, method=type(ffn).forward, rules=GENERIC, options_arg=None)
    spec = _on_mesh(bridged, "dp=1,sp=8,tp=1", topo.devices())
    weights = abstract_weights(bridged)
    call = split_call(((torch.empty(1, 256, 64, device="meta"),), {}))
    fn, _, _ = bridged.program_function(call, None, bridged.mesh)
    planned = PlannedProgram("ffn", fn, weights, bridged._abstract_inputs(call), spec, "int8 ffn", "diffusion_model")
    _, compiled = _lower_and_compile(planned.stage_program(("quant", "int8 ffn")), topo, lower)
    matmuls = [line for line in compiled.as_text().splitlines() if "int8_matmul" in line and "convolution(" in line]
    assert len(matmuls) == 2 and all(re.search(r"= s32\[", line) for line in matmuls)  # ConvRot's rotation aside


def _text_lora(clip, seed: int, rank: int = 4) -> dict:
    """A LoRA in ComfyUI's text-encoder key format for every attention projection and feed-forward layer."""
    g = torch.Generator().manual_seed(seed)
    lora = {}
    transformer = clip.cond_stage_model.umt5xxl.transformer
    for name, module in transformer.named_modules():
        weight = getattr(module, "weight", None)
        if name.startswith("encoder.block.") and isinstance(weight, torch.Tensor) and weight.ndim == 2 and (
                ".SelfAttention." in name or ".DenseReluDense." in name):
            key = f"text_encoders.umt5xxl.transformer.{name}"
            lora[f"{key}.lora_up.weight"] = torch.randn(weight.shape[0], rank, generator=g) * 0.3
            lora[f"{key}.lora_down.weight"] = torch.randn(rank, weight.shape[1], generator=g) * 0.3
    return lora


def test_lora_on_quantized_weights_reaches_the_devices(pack, text_files):
    """A LoRA on a quantized text encoder: ComfyUI patches the dequantized weights and quantizes them again (same
    layout, new scales); the device copy follows (the patched layers' packed data and scales re-placed) for each
    strength and without the LoRA again, equal to ComfyUI's encode each time, and nothing compiles."""
    import comfy.sd

    from tpu_runtime.engine.runtime import compile_stats

    path, reduced = text_files["float"]
    clip = load_text_encoder(path, reduced)
    on_tpu = tpu_text(pack, clip)
    plain = encode(clip, PROMPTS[1])
    assert relative(encode(on_tpu, PROMPTS[1]), plain) < TOL
    model = text_model(on_tpu)
    programs, refreshes, compiles = model.stats.programs, model.stats.weight_refreshes, compile_stats().xla_compiles
    lora = _text_lora(clip, seed=5)
    for strength in (0.5, 1.0):
        native = encode(comfy.sd.load_lora_for_models(None, clip, lora, 0.0, strength)[1], PROMPTS[1])
        assert relative(native, plain) > 1e-2  # the LoRA changes the result
        patched = comfy.sd.load_lora_for_models(None, on_tpu, lora, 0.0, strength)[1]
        assert relative(encode(patched, PROMPTS[1]), native) < TOL
    assert model.stats.weight_refreshes - refreshes >= 2  # each strength re-placed the patched weights
    assert model.stats.programs == programs and compile_stats().xla_compiles == compiles
    assert relative(encode(on_tpu, PROMPTS[1]), plain) < TOL  # without the LoRA again
    assert str(model.state[weight_name("v")].dtype) == "uint8"  # still nvfp4 on the devices


# --- the diffusion model: Wan from quantized files --------------------------------------------------------------------
WAN_FLOAT_FORMATS = {"q": ("float8_e4m3fn", {}), "k": ("float8_e5m2", {}), "v": ("nvfp4", {}), "o": ("mxfp8", {}),
                     "0": ("nvfp4", {}), "2": ("float8_e4m3fn", {})}
WAN_INT8_FORMATS = {"q": ("int8_tensorwise", {}), "k": CONVROT, "v": ("int8_tensorwise", {}), "o": CONVROT,
                    "0": CONVROT, "2": ("int8_tensorwise", {})}


@pytest.fixture(scope="module")
def wan_files(pack, tmp_path_factory):
    """A tiny Wan (ComfyUI's WanModel) saved as Load Diffusion Model reads it: its blocks' layers in the formats
    ComfyUI dequantizes (fp8 e4m3/e5m2, nvfp4, mxfp8), in int8 (per tensor and ConvRot), or as the legacy scaled fp8
    file."""
    from tpu_runtime.bridge.tiny import random_state, tiny_wan

    base = tmp_path_factory.mktemp("quantized_wan")
    state = random_state(tiny_wan("t2v"), seed=21)
    prefix = "model.diffusion_model."

    def chosen(formats):
        return lambda key: formats.get(key.split(".")[-2]) if key.startswith("blocks.") else None

    return {"float": save_quantized(state, base / "wan_float.safetensors", chosen(WAN_FLOAT_FORMATS), prefix),
            "int8": save_quantized(state, base / "wan_int8.safetensors", chosen(WAN_INT8_FORMATS), prefix),
            "scaled_fp8": save_scaled_fp8(state, base / "wan_fp8_scaled.safetensors",
                                          lambda k: k.startswith("blocks."), prefix)}


def tpu(pack, model, **inputs):
    return pack.NODE_CLASS_MAPPINGS["TPUDiffusionModel"]().apply(model, **inputs)[0]


def test_auto_computes_quantized_files_in_bfloat16_and_says_so(pack, wan_files, caplog):
    """compute_dtype auto: a quantized file (which ComfyUI with --cpu reports as float32 and computes in float32)
    computes in bfloat16 on a TPU, as ComfyUI does on an accelerator; the node logs one line per model with the class,
    how its weights are stored, the dtype, why, and how ComfyUI's own run here differs. On the runtime's CPU backend
    (this machine's) auto keeps ComfyUI's float32, and so does ``as loaded`` everywhere."""
    from comfy_native import load

    from tpu_runtime.bridge.comfy import KEEP_CAST, compute_dtype_patch

    model = load(wan_files["int8"])
    assert model.model.manual_cast_dtype == torch.float32  # what ComfyUI chose under --cpu
    with caplog.at_level(logging.INFO, logger="tpu_runtime.bridge.comfy"):
        assert compute_dtype_patch(model.model, "auto", backend="tpu") == torch.bfloat16
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("WanModel: weights")]
    assert "TensorWiseINT8Layout (int8)" in line and "computing in bfloat16" in line
    assert "ComfyUI's own run on this host computes float32" in line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tpu_runtime.bridge.comfy"):
        on_tpu = tpu(pack, model)  # this runtime's backend is the CPU: ComfyUI's own choice stays
    assert "manual_cast_dtype" not in on_tpu.object_patches
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("WanModel: weights")]
    assert "computing in float32" in line and "on the CPU backend" in line
    assert compute_dtype_patch(model.model, "auto", backend="cpu") is KEEP_CAST
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tpu_runtime.bridge.comfy"):
        exact = tpu(pack, model, compute_dtype="as loaded")
    assert "manual_cast_dtype" not in exact.object_patches
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("WanModel: weights")]
    assert "computing in float32" in line and "own run" not in line


LATENT = torch.zeros(1, 16, 3, 8, 8)


def conds(length=12, seed=1, width=4096):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(1, length, width, generator=g), {}]], [[torch.randn(1, length, width, generator=g), {}]]


def bridged(model):
    return next(v for k, v in model.object_patches.items() if k.startswith("diffusion_model.")).bridged


@pytest.mark.parametrize("kind", ["float", "scaled_fp8"])
def test_quantized_wan_equals_native(pack, wan_files, kind):
    """Wan from a quantized file (fp8 e4m3 and e5m2, nvfp4 and mxfp8 layers; or the legacy scaled fp8 file as 0.33
    converts it), loaded by Load Diffusion Model and sampled by ComfyUI's sampler: TPU Diffusion Model (compute_dtype
    'as loaded': float32, as ComfyUI computes on this host) equals ComfyUI's native run; its layers stay packed on
    the devices; one program for the whole run."""
    from comfy_native import load, sample

    model = load(wan_files[kind])
    assert type(model.model.diffusion_model.blocks[0].self_attn.q.weight).__name__ == "QuantizedTensor"
    positive, negative = conds()
    native = sample(model, LATENT, positive, negative)
    on_tpu = tpu(pack, model, compute_dtype="as loaded")
    assert relative(sample(on_tpu, LATENT, positive, negative), native) < TOL
    module = bridged(on_tpu)
    assert module.stats.programs == 1
    stored = {"float": {"q": "float8_e4m3fn", "k": "float8_e5m2", "v": "uint8", "o": "float8_e4m3fn"},
              "scaled_fp8": dict.fromkeys("qkvo", "float8_e4m3fn")}[kind]
    for leaf, dtype in stored.items():
        assert str(module.state[f"blocks.1.cross_attn.{leaf}.weight"].dtype) == dtype, leaf


def test_int8_wan_one_call_within_comfyuis_own_spread(pack, wan_files):
    """Wan from an int8 file (per tensor and ConvRot layers): ComfyUI runs them W8A8, so float rounding that moves
    a layer input across a half step flips its int8 value. One model call (a one-step sample: the CFG batch's
    denoised latents) through TPU Diffusion Model lies closer to ComfyUI's W8A8 result than ComfyUI's own
    dequantized float result of the same file does; its weights stay int8 on the devices."""
    from comfy_native import load, sample

    model = load(wan_files["int8"])
    positive, negative = conds()
    native = sample(model, LATENT, positive, negative, steps=1)
    with with_dequantized_weights(quantized_layers(model.model.diffusion_model)):
        spread = relative(sample(model, LATENT, positive, negative, steps=1), native)
    on_tpu = tpu(pack, model, compute_dtype="as loaded")
    ours = relative(sample(on_tpu, LATENT, positive, negative, steps=1), native)
    assert ours < spread, (ours, spread)
    assert str(bridged(on_tpu).state["blocks.0.ffn.2.weight"].dtype) == "int8"


def _wan_lora(model, seed: int, rank: int = 4) -> dict:
    """A LoRA in ComfyUI's key format for every attention projection of the blocks."""
    g = torch.Generator().manual_seed(seed)
    lora = {}
    for name, module in model.model.diffusion_model.named_modules():
        if ".self_attn." in name and type(module).__name__ == "Linear":
            key = f"diffusion_model.{name}"
            lora[f"{key}.lora_up.weight"] = torch.randn(module.out_features, rank, generator=g) * 0.2
            lora[f"{key}.lora_down.weight"] = torch.randn(rank, module.in_features, generator=g) * 0.2
    return lora


@pytest.mark.parametrize("where", ["before", "after"])
def test_lora_on_a_quantized_wan_reaches_the_devices(pack, wan_files, where):
    """A LoRA on a quantized Wan, before or after TPU Diffusion Model: ComfyUI dequantizes the patched layers, adds
    the LoRA and quantizes them again on the host; the device copy follows at each strength and without the LoRA,
    equal to ComfyUI's run each time; nothing compiles after the first run."""
    import comfy.sd
    from comfy_native import load, sample

    from tpu_runtime.engine.runtime import compile_stats

    model = load(wan_files["float"])
    lora = _wan_lora(model, seed=11)
    positive, negative = conds()
    plain = sample(model, LATENT, positive, negative, steps=2)
    on_tpu = tpu(pack, model, compute_dtype="as loaded") if where == "after" else None
    counted = None
    for strength in (0.6, 1.3):
        with_lora = comfy.sd.load_lora_for_models(model if where == "before" else on_tpu, None, lora, strength, 0)[0]
        native = sample(comfy.sd.load_lora_for_models(model, None, lora, strength, 0)[0], LATENT, positive,
                        negative, steps=2)
        patched = tpu(pack, with_lora, compute_dtype="as loaded") if where == "before" else with_lora
        assert relative(native, plain) > 1e-2  # the LoRA changes the result
        assert relative(sample(patched, LATENT, positive, negative, steps=2), native) < TOL
        counted = counted or (compile_stats().xla_compiles, bridged(patched).stats.programs)
    module = bridged(patched)
    assert module.stats.weight_refreshes >= 1 and str(module.state["blocks.0.self_attn.v.weight"].dtype) == "uint8"
    assert (compile_stats().xla_compiles, module.stats.programs) == counted  # the second strength compiled nothing
    unpatched = sample(on_tpu if where == "after" else tpu(pack, model, compute_dtype="as loaded"), LATENT,
                       positive, negative, steps=2)
    assert relative(unpatched, plain) < TOL


def test_auto_bfloat16_matches_comfyuis_bfloat16_run(pack, wan_files, monkeypatch):
    """compute_dtype auto on a quantized file computes on a TPU in bfloat16 what ComfyUI computes for it in bfloat16 (its run
    with the compute dtype set to bfloat16, sampled just before: that clone's object patch is still on the shared
    model when the node is applied). Two bfloat16 runs round differently (XLA keeps some intermediates in float32
    that torch rounds), so one model call's result lies within bfloat16's rounding of ComfyUI's, as far from it as
    ComfyUI's bfloat16 run is from its float32 run, within a factor 2; and clearly not ComfyUI's float32 result."""
    from comfy_native import load, sample

    model = load(wan_files["float"])
    positive, negative = conds()
    in_float32 = sample(model, LATENT, positive, negative, steps=1)
    as_gpu = model.clone()
    as_gpu.add_object_patch("manual_cast_dtype", torch.bfloat16)
    reference = sample(as_gpu, LATENT, positive, negative, steps=1)
    from tpu_runtime.engine.runtime import get_runtime

    monkeypatch.setattr(get_runtime(), "backend", "tpu")  # auto chooses as on a TPU; the program runs here
    on_tpu = tpu(pack, model)
    monkeypatch.undo()
    ours = sample(on_tpu, LATENT, positive, negative, steps=1)
    rounding = relative(reference, in_float32)
    assert relative(ours, reference) < 2 * rounding and relative(ours, in_float32) > 0.2 * rounding


def test_quantized_wan_split_over_eight_devices_equals_native(pack, tmp_path, request):
    """A quantized Wan with four heads on 8 simulated devices (tp=4): its packed weights split by the Wan rules
    (q/k/v and the first feed-forward layer by rows, o and the second by columns), each layer's block scales split
    along with it in their plain layout, a per-tensor scale whole on every device; sampled, it equals ComfyUI's
    native run."""
    from comfy_native import COMFYUI_TREES
    from test_bridge_mesh import _run

    from tpu_runtime.bridge.tiny import random_state, tiny_wan

    formats = {"q": ("nvfp4", {}), "k": ("float8_e4m3fn", {}), "v": ("mxfp8", {}), "o": ("mxfp8", {}),
               "0": ("nvfp4", {}), "2": ("nvfp4", {})}
    state = random_state(tiny_wan("t2v", dim=512), seed=8)
    path = save_quantized(state, tmp_path / "wan4.safetensors",
                          lambda k: formats.get(k.split(".")[-2]) if k.startswith("blocks.") else None,
                          "model.diffusion_model.")
    mesh = "dp=1,sp=2,tp=4"
    tree = COMFYUI_TREES[request.node.callspec.params["pack"]]
    report = _run([path, mesh, "--as-loaded"], TPU_VIDEO_COMFYUI=tree)["meshes"][mesh]
    assert report["relative"] < TOL and report["programs"] == 1
    arrays = report["block0"]
    for name, spec, shard in (
            ("self_attn.q.weight", ["tp", "None"], [128, 256]),  # nvfp4 [512, 256] packed, rows over tp
            ("self_attn.q.weight:block_scale", ["tp", "None"], [128, 32]),
            ("self_attn.o.weight", ["None", "tp"], [512, 128]),  # mxfp8 [512, 512], columns over tp
            ("self_attn.o.weight:scale", ["None", "tp"], [512, 4]),  # e8m0, one per 32 columns
            ("ffn.2.weight", ["None", "tp"], [512, 128]),  # nvfp4 [512, 1024]: packed [512, 512]
            ("ffn.2.weight:block_scale", ["None", "tp"], [512, 16]),
            ("self_attn.k.weight:scale", [], [])):
        assert arrays[f"blocks.0.{name}"]["spec"] == spec, name
        assert arrays[f"blocks.0.{name}"]["shard"] == shard, name
