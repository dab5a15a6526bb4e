"""One loading path for every family: modules built with their parameters on ``meta`` and each tensor assigned
once, the dtypes and float32-kept modules the libraries' own ``from_pretrained`` gives, CogVideoX without
accelerate and without its warning."""

import subprocess
import sys

import pytest
import torch
from conftest import subprocess_env

from tpu_runtime.engine.family import builder, model_class
from tpu_runtime.engine.folders import read_config, read_model_index
from tpu_runtime.engine.weights import TensorSource, keep_fp32_modules, load_into_meta_module, safetensors_files


def _ours(folder, name, dtype):
    library, cls_name = read_model_index(folder)[name]
    cls = model_class(library, cls_name)
    source = TensorSource(safetensors_files(folder / name))
    return load_into_meta_module(builder(cls, read_config(folder / name)), source, {k: k for k in source.keys()},
                                 dtype, name, keep_fp32=keep_fp32_modules(cls, dtype))


def _theirs(folder, name, dtype):
    library, cls_name = read_model_index(folder)[name]
    return model_class(library, cls_name).from_pretrained(folder / name, dtype=dtype).eval()


def _tensors(module):
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update({f"buffer:{k}": v for k, v in module.named_buffers(remove_duplicate=False)})
    return named


@pytest.mark.parametrize("model, name", [("cog-2b", "transformer"), ("cog-5b", "transformer"),
                                         ("cog-5b", "text_encoder"), ("cog-5b", "vae"), ("wan", "transformer"),
                                         ("wan", "text_encoder")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weights_equal_the_libraries_from_pretrained(tiny_models, tiny_wan, model, name, dtype):
    """Every parameter and buffer: same names, dtypes (Wan's ``_keep_in_fp32_modules`` stay float32 in bfloat16;
    transformers keeps T5's only for float16) and values as diffusers' / transformers' own loader."""
    folder = {"cog-2b": tiny_models["2b"], "cog-5b": tiny_models["5b"], "wan": tiny_wan["2.1"]}[model]
    ours, theirs = _tensors(_ours(folder, name, dtype)), _tensors(_theirs(folder, name, dtype))
    assert sorted(ours) == sorted(theirs)
    for key, tensor in theirs.items():
        assert ours[key].dtype == tensor.dtype, key
        assert torch.equal(ours[key], tensor), key
    if model == "wan" and name == "transformer" and dtype == torch.bfloat16:
        assert ours["scale_shift_table"].dtype == torch.float32  # diffusers' _keep_in_fp32_modules


def test_a_tied_embedding_is_one_tensor(tiny_models):
    """T5's token embedding is stored once (``shared.weight``) and used twice: one tensor, one device copy."""
    t5 = _ours(tiny_models["5b"], "text_encoder", torch.float32)
    assert t5.encoder.embed_tokens.weight is t5.shared.weight


_CHILD = r"""
import logging, sys
for name in ("accelerate", "peft"):  # as if not installed (peft needs accelerate): import fails, find_spec is None
    sys.modules[name] = None
logging.basicConfig(level=logging.INFO)
from tpu_runtime.families.cogvideox.model import CogVideoXFamily
family = CogVideoXFamily(sys.argv[1], dtype="bfloat16")
for name in ("text_encoder", "transformer", "vae"):
    family._component(name)
states = family._states["text_encoder"]
print("OK", states["shared.weight"] is states["encoder.embed_tokens.weight"], sys.modules["accelerate"] is not None)
"""


def test_cogvideox_loads_without_accelerate_and_says_nothing_of_it(tiny_models):
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tiny_models["5b"])], capture_output=True, text=True,
                          env=subprocess_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["OK", "True", "False"]
    assert "accelerate" not in proc.stderr.lower()


def test_scaled_fp8_formats_are_weight_times_scale(tmp_path):
    """Both ways ComfyUI stores scaled fp8 load as weight x scale: the older ``scale_weight`` (0-dim) and the
    per-layer ``weight_scale`` (0-dim or one per output row); scales, ``input_scale``, ``comfy_quant`` records and
    markers are not weights; a parameter merely named ``weight_scale`` (no ``.weight`` beside it) still is one."""
    import json

    from safetensors.torch import save_file

    w = torch.tensor([[1.0, -2.0], [0.5, 4.0], [3.0, 0.25]]).to(torch.float8_e4m3fn)
    row = torch.tensor([2.0, 0.5, 0.25])
    save_file({"a.weight": w.clone(), "a.scale_weight": torch.tensor(0.125), "a.scale_input": torch.tensor(1.0),
               "scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn),
               "b.weight": w.clone(), "b.weight_scale": torch.tensor(4.0), "b.input_scale": torch.tensor(1.0),
               "b.comfy_quant": torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()),
                                             dtype=torch.uint8),
               "c.weight": w.clone(), "c.weight_scale": row, "norm.weight_scale": torch.tensor([3.0])},
              str(tmp_path / "q.safetensors"))
    source = TensorSource([tmp_path / "q.safetensors"])
    assert sorted(source.keys()) == ["a.weight", "b.weight", "c.weight", "norm.weight_scale"]
    torch.testing.assert_close(source.get("a.weight", torch.float32), w.float() * 0.125)
    torch.testing.assert_close(source.get("b.weight", torch.float32), w.float() * 4.0)
    torch.testing.assert_close(source.get("c.weight", torch.bfloat16), (w.float() * row[:, None]).bfloat16())
    torch.testing.assert_close(source.get("norm.weight_scale", torch.float32), torch.tensor([3.0]))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_dequantisation_equals_torch_elementwise(fp8, dtype):
    """The table-driven fp8 dequantisation (every byte value, large tensors split over threads) gives exactly
    torch's ``(q.float() * scale).to(dtype)``, NaNs and signed zeros included."""
    from tpu_runtime.engine.weights import dequantise_fp8

    every = torch.arange(256, dtype=torch.uint8).view(fp8)
    big = (torch.randn(17 * (2**18 + 3)) * 3).to(fp8)  # over four chunks: the threaded path
    for q in (every, big.reshape(-1, 17)):
        for scale in (torch.tensor(1.0), torch.tensor(0.0013), torch.tensor([3.7e-3])):
            want = (q.float() * scale.reshape(())).to(dtype)
            got = dequantise_fp8(q, scale, dtype)
            assert got.dtype == dtype and got.shape == q.shape
            assert torch.equal(got.float().nan_to_num(7.0), want.float().nan_to_num(7.0))
            assert torch.equal(torch.signbit(got.float()), torch.signbit(want.float()))


def _comfy_nvfp4(weight):
    """ComfyUI's NVFP4 encoding of ``weight`` (comfy-kitchen's own quantiser, its eager CPU version): (packed,
    block scales in cuBLAS' tiled layout, tensor scale), and its own dequantisation of them in float32."""
    from comfy_kitchen.backends.eager.quantization import dequantize_nvfp4, quantize_nvfp4

    tensor_scale = (weight.abs().max() / (6.0 * 448.0)).float()
    packed, blocks = quantize_nvfp4(weight, tensor_scale)
    return packed, blocks, tensor_scale, dequantize_nvfp4(packed, tensor_scale, blocks, torch.float32)


@pytest.mark.parametrize("shape", [(256, 64), (200, 96), (16, 16), (130, 272)])
def test_nvfp4_weights_equal_comfyuis_dequantisation(shape, tmp_path):
    """An NVFP4 layer as ComfyUI writes it (packed E2M1 pairs, float8 block scales in cuBLAS' tiled layout, a tensor
    scale, ``comfy_quant`` {"format": "nvfp4"}) loads as the layer's full-width matrix, equal to ComfyUI's own
    dequantisation (rows and block columns that do not fill a tile included), and its header reports the
    unpacked shape."""
    import json

    from safetensors.torch import save_file

    from tpu_runtime.engine.weights import read_header

    torch.manual_seed(shape[0])
    weight = torch.randn(shape) * torch.rand(shape[0], 1) * 3
    packed, blocks, tensor_scale, want = _comfy_nvfp4(weight)
    save_file({"q.weight": packed, "q.weight_scale": blocks, "q.weight_scale_2": tensor_scale,
               "q.input_scale": torch.tensor(1.0),
               "q.comfy_quant": torch.tensor(list(json.dumps({"format": "nvfp4"}).encode()), dtype=torch.uint8)},
              str(tmp_path / "fp4.safetensors"))
    assert read_header(tmp_path / "fp4.safetensors")["q.weight"] == (shape, "NVFP4")
    source = TensorSource([tmp_path / "fp4.safetensors"])
    assert source.keys() == ["q.weight"]
    torch.testing.assert_close(source.get("q.weight", torch.float32), want, rtol=0, atol=0)
    torch.testing.assert_close(source.get("q.weight", torch.bfloat16), want.bfloat16(), rtol=0, atol=0)
    assert (want - weight).abs().max() < 0.25 * weight.abs().max()  # it is the weight, 4-bit coarse


def test_tiny_weights_rounded_for_fp8_stay_finite_and_exact():
    """The tiny models' fp8-exact rounding never leaves a value past fp8_e4m3fn's 448 (torch casts it to NaN, not
    to 448): whatever a matrix's largest magnitude, its values stay finite and the fp8 encoding of the files holds
    them exactly. Largest magnitudes between powers of two times 448, where the scale was rounded down, are tried."""
    from tpu_runtime.engine.tiny import exact, fp8_quantise

    base = torch.randn(32, 48, generator=torch.Generator().manual_seed(0))
    base = base / base.abs().max()
    for absmax in (0.05, 448.0 / 2**10 * 1.3, 448.0 / 2**10 * 1.45, 448.0 / 2**9 * 1.9, 3.0):
        rounded = exact(base * absmax, fp8=True)
        assert torch.isfinite(rounded).all(), absmax
        assert (rounded - base * absmax).abs().max() <= absmax * 2**-3, absmax  # a rounding, not another matrix
        values, scale = fp8_quantise(rounded)
        assert torch.equal(values.float() * scale, rounded), absmax
