"""LoRA: the files people download (ComfyUI/original Wan names, kohya/musubi, diffusers/PEFT; CogVideoX in
diffusers format), merged into the weights on the devices, give diffusers' frames with the same LoRAs loaded and
fused at the same strengths; strength changes compile nothing and leave device memory as it was; keys that match
nothing are named; LoRAs of another family or size are refused before anything compiles."""

import logging

import numpy as np
import pytest
import torch
from conftest import NEGATIVE, PROMPT, WAN_SIZE
from oracle import lora_frames

from tpu_runtime.errors import InputError
from tpu_runtime.engine.stages import SampleSettings
from tpu_runtime.tools.generate import GenerateRequest, generate
from tpu_runtime.engine.lora import LoraSpec, parse_lora
from tpu_runtime.engine.runtime import compile_stats
from tpu_runtime.families.wan.tiny import LORA_FORMATS, TinyWanSpec, build_tiny_lora, build_tiny_wan

TOL = 1e-4
H, W, F = WAN_SIZE
STEPS = 3


@pytest.fixture(scope="module")
def wan21(tiny_wan):
    from tpu_runtime.families.wan.model import WanFamily

    family = WanFamily(tiny_wan["2.1"], dtype="float32")
    return family, family.encode(PROMPT, NEGATIVE)


def _sample(family, embeddings, loras=(), loras_2=(), height=H, width=W, frames=F, guidance=5.0, steps=STEPS,
            **more):
    settings = SampleSettings(height, width, frames, steps, guidance, 42, loras=tuple(loras), loras_2=tuple(loras_2),
                              **more)
    return family.decode(family.sample(embeddings, settings)).numpy()


def _wan_reference(folder, loras=(), loras_2=(), pipeline=False, steps=STEPS, guidance=5.0, scheduler=None):
    from diffusers import WanPipeline

    frames, pipe = lora_frames(WanPipeline, folder, loras, loras_2, scheduler, prompt=PROMPT, negative_prompt=NEGATIVE,
                               height=H, width=W, num_frames=F, num_inference_steps=steps, guidance_scale=guidance,
                               seed=42)
    return (frames, pipe) if pipeline else frames


def _same_weights(state, module):
    """Our merged weights on the devices equal diffusers' fused module's, tensor by tensor."""
    theirs = module.state_dict()
    assert len(theirs) > 10
    for name, value in state.items():
        if name not in theirs:  # buffers diffusers does not save (RoPE tables)
            continue
        np.testing.assert_allclose(np.asarray(value), theirs[name].numpy(), rtol=0, atol=1e-5, err_msg=name)


def _close(ours, ref, base=None):
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() < TOL
    if base is not None:  # the LoRA must move the frames, or the comparison could not see it applied
        assert np.abs(ref - base).max() > 100 * TOL


@pytest.mark.parametrize("fmt", LORA_FORMATS)
def test_wan_lora_formats_match_diffusers_fused(wan21, tiny_wan, tmp_path, fmt):
    family, embeddings = wan21
    path = build_tiny_lora(tiny_wan["2.1"] / "transformer", tmp_path / f"{fmt}.safetensors", fmt, seed=3,
                           bias_diffs=fmt == "comfy")
    ours = _sample(family, embeddings, [LoraSpec(str(path), 0.8)])
    ref, pipe = _wan_reference(tiny_wan["2.1"], [(path, 0.8)], pipeline=True)
    _same_weights(family._states["transformer"], pipe.transformer)  # the biases of .diff_b included
    _close(ours, ref, base=_sample(family, embeddings))


def test_two_loras_at_once_match_diffusers(wan21, tiny_wan, tmp_path):
    family, embeddings = wan21
    a = build_tiny_lora(tiny_wan["2.1"] / "transformer", tmp_path / "a.safetensors", "comfy", seed=4)
    b = build_tiny_lora(tiny_wan["2.1"] / "transformer", tmp_path / "b.safetensors", "musubi", seed=5, rank=8)
    ours = _sample(family, embeddings, [LoraSpec(str(a), 0.6), LoraSpec(str(b), -0.4)])
    _close(ours, _wan_reference(tiny_wan["2.1"], [(a, 0.6), (b, -0.4)]))


def test_two_experts_take_their_own_loras_at_the_lightx2v_settings(tiny_wan, tmp_path):
    """Wan 2.2 A14B as the 4-step lightx2v LoRAs are used: one LoRA on the high-noise expert, another on the
    low-noise one, 4 steps, CFG off, Euler with ComfyUI's simple spacing at shift 5 (the cards' timesteps)."""
    from tpu_runtime.engine.schedulers import euler_simple_scheduler
    from tpu_runtime.families.wan.model import WanFamily

    folder = tiny_wan["2.2-A14B"]
    high = build_tiny_lora(folder / "transformer", tmp_path / "high.safetensors", "comfy", seed=6)
    low = build_tiny_lora(folder / "transformer_2", tmp_path / "low.safetensors", "diffusers", seed=7)
    family = WanFamily(folder, dtype="float32")
    scheduler = family.scheduler("euler_simple", 5.0)
    scheduler.set_timesteps(4)
    np.testing.assert_allclose(scheduler.timesteps.numpy(), [1000.0, 937.5, 833.3333, 625.0], atol=1e-3)
    embeddings = family.encode(PROMPT, NEGATIVE)
    lightx2v = dict(steps=4, guidance=1.0, scheduler="euler_simple", shift=5.0)
    ours = _sample(family, embeddings, [LoraSpec(str(high), 0.9)], [LoraSpec(str(low), 0.5)], **lightx2v)
    ref, pipe = _wan_reference(folder, [(high, 0.9)], [(low, 0.5)], pipeline=True, steps=4, guidance=1.0,
                               scheduler=euler_simple_scheduler(shift=5.0))
    _same_weights(family._states["transformer"], pipe.transformer)
    _same_weights(family._states["transformer_2"], pipe.transformer_2)
    _close(ours, ref)
    only_high = _sample(family, embeddings, [LoraSpec(str(high), 0.9)], **lightx2v)
    assert np.abs(only_high - ours).max() > 100 * TOL  # the low-noise expert's LoRA did change the video


def test_cogvideox_lora_matches_diffusers_fused(tiny_models, tmp_path):
    from diffusers import CogVideoXPipeline

    from tpu_runtime.families.cogvideox.model import CogVideoXFamily
    from tpu_runtime.families.cogvideox.tiny import build_tiny_lora as build_cogvideox_lora

    folder = tiny_models["5b"]
    path = build_cogvideox_lora(folder / "transformer", tmp_path / "cog.safetensors", "diffusers", seed=8)
    family = CogVideoXFamily(folder, dtype="float32")
    embeddings = family.encode(PROMPT, NEGATIVE)
    settings = dict(height=64, width=64, frames=9, guidance=6.0)
    ours = _sample(family, embeddings, [LoraSpec(str(path), 0.7)], **settings)
    ref, _ = lora_frames(CogVideoXPipeline, folder, [(path, 0.7)], prompt=PROMPT, negative_prompt=NEGATIVE,
                      height=64, width=64, num_frames=9, num_inference_steps=STEPS, guidance_scale=6.0, seed=42,
                      max_sequence_length=family.text_len)
    _close(ours, ref, base=_sample(family, embeddings, **settings))


def _live_bytes():
    import gc

    import jax

    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())


def test_strength_changes_compile_nothing_keep_memory_and_removal_restores(wan21, tiny_wan, tmp_path):
    family, embeddings = wan21
    path = build_tiny_lora(tiny_wan["2.1"] / "transformer", tmp_path / "l.safetensors", "comfy", seed=9)
    base = _sample(family, embeddings)
    loaded = {k: np.asarray(v) for k, v in family._states["transformer"].items()}
    first = _sample(family, embeddings, [LoraSpec(str(path), 0.5)])
    memory = _live_bytes()
    frames = {}
    for strength in (1.0, 0.2, -0.5, 1.5, 0.75):
        before = compile_stats()
        frames[strength] = _sample(family, embeddings, [LoraSpec(str(path), strength)])
        assert compile_stats().since(before).backend_compiles == 0, strength
        assert _live_bytes() == memory, strength
    assert np.abs(frames[1.0] - first).max() > 100 * TOL  # the strength really changed
    removed = _sample(family, embeddings)
    assert np.array_equal(removed, base)  # no LoRA: the loaded weights, exactly, without reading the files
    for name, value in family._states["transformer"].items():
        assert np.array_equal(np.asarray(value), loaded[name]), name


def test_unmatched_keys_are_named_and_the_rest_applied(wan21, tiny_wan, tmp_path, caplog):
    family, embeddings = wan21
    extra = {"diffusion_model.blocks.0.not_a_layer.lora_down.weight": torch.zeros(4, 8),
             "diffusion_model.blocks.0.not_a_layer.lora_up.weight": torch.zeros(8, 4),
             "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.zeros(4, 8)}
    path = build_tiny_lora(tiny_wan["2.1"] / "transformer", tmp_path / "x.safetensors", "comfy", seed=10,
                           extra=extra)
    clean = build_tiny_lora(tiny_wan["2.1"] / "transformer", tmp_path / "c.safetensors", "comfy", seed=10)
    with caplog.at_level(logging.WARNING, logger="tpu_runtime.engine.lora"):
        ours = _sample(family, embeddings, [LoraSpec(str(path), 1.0)])
    warned = " ".join(r.getMessage() for r in caplog.records)
    for key in extra:
        assert key in warned
    assert np.array_equal(ours, _sample(family, embeddings, [LoraSpec(str(clean), 1.0)]))


def test_difference_tensors_add_to_weights_and_biases(wan21, tmp_path):
    """``.diff`` (a norm's or any weight's full difference) and ``.diff_b`` (a bias's) add strength × tensor."""
    from safetensors.torch import save_file

    family, embeddings = wan21
    family.apply_loras({"transformer": ()})
    state = family._states["transformer"]
    norm = next(k for k in state if k.startswith("blocks.0.norm") and k.endswith(".weight"))
    bias = "blocks.1.ffn.net.2.bias"
    from tpu_runtime.families.wan.files import wan_transformer_to_original

    diff = torch.randn(*state[norm].shape, generator=torch.Generator().manual_seed(0))
    diff_b = torch.randn(*state[bias].shape, generator=torch.Generator().manual_seed(1))
    path = tmp_path / "diff.safetensors"
    save_file({f"diffusion_model.{wan_transformer_to_original(norm)[:-7]}.diff": diff,
               f"diffusion_model.{wan_transformer_to_original(bias)[:-5]}.diff_b": diff_b}, str(path))
    before = {k: np.asarray(state[k]) for k in (norm, bias)}
    family.apply_loras({"transformer": (LoraSpec(str(path), 0.5),)})
    np.testing.assert_allclose(np.asarray(state[norm]), before[norm] + 0.5 * diff.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state[bias]), before[bias] + 0.5 * diff_b.numpy(), rtol=0, atol=1e-6)
    family.apply_loras({"transformer": ()})
    assert np.array_equal(np.asarray(state[norm]), before[norm])


def test_other_family_or_size_refused_before_any_compile(tiny_wan, tiny_models, tmp_path):
    from tpu_runtime.families.cogvideox.tiny import build_tiny_lora as build_cogvideox_lora

    cog = build_cogvideox_lora(tiny_models["5b"] / "transformer", tmp_path / "cog.safetensors", "diffusers")
    wider = build_tiny_wan(tmp_path / "wide", "2.1", spec=TinyWanSpec(heads=4, layers=1))
    wide = build_tiny_lora(wider / "transformer", tmp_path / "wide.safetensors", "comfy")
    cases = [(cog, "looks like a LoRA for CogVideoX"), (wide, "another size of the model"),
             (tmp_path / "missing.safetensors", "not found")]
    for path, message in cases:
        before = compile_stats()
        with pytest.raises(InputError, match=message):
            generate(GenerateRequest(model=str(tiny_wan["2.1"]), output_dir=str(tmp_path / "out"), prompt="a cat",
                                     height=H, width=W, frames=F, steps=2, dtype="float32", loras=[str(path)]))
        assert compile_stats().since(before).backend_compiles == 0, path
    with pytest.raises(InputError, match="two-expert"):
        generate(GenerateRequest(model=str(tiny_wan["2.1"]), output_dir=str(tmp_path / "out"), prompt="a cat",
                                 height=H, width=W, frames=F, steps=2, dtype="float32", loras_2=[str(wide)]))


def test_lora_argument_parsing():
    assert parse_lora("style.safetensors") == LoraSpec("style.safetensors", 1.0)
    assert parse_lora("/loras/style.safetensors:0.75") == LoraSpec("/loras/style.safetensors", 0.75)
    assert parse_lora(r"C:\loras\style.safetensors:-1") == LoraSpec(r"C:\loras\style.safetensors", -1.0)
    assert parse_lora(r"C:\loras\style.safetensors") == LoraSpec(r"C:\loras\style.safetensors", 1.0)
    with pytest.raises(InputError, match="finite"):
        LoraSpec("a.safetensors", float("nan"))


def test_cli_lora_options(wan21, tiny_wan, tmp_path, capsys):
    """``--lora FILE:STRENGTH`` gives the frames of the same LoRA at that strength and is recorded in
    generation_config.json; ``--lora-2`` on a one-transformer model exits 2 with a message."""
    import json

    from tpu_runtime.tools import stage_files
    from tpu_runtime.tools.cli import main

    family, embeddings = wan21
    path = build_tiny_lora(tiny_wan["2.1"] / "transformer", tmp_path / "cli.safetensors", "musubi", seed=13)
    args = ["generate", "--model", str(tiny_wan["2.1"]), "--prompt", PROMPT, "--negative-prompt", NEGATIVE,
            "--height", str(H), "--width", str(W), "--frames", str(F), "--steps", str(STEPS), "--guidance", "5",
            "--seed", "42", "--dtype", "float32"]
    assert main(args + ["--lora", f"{path}:0.6", "--output-dir", str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert config["loras"] == [{"path": str(path), "strength": 0.6}]
    ours = stage_files.load_frames(tmp_path / "out").numpy()
    assert np.abs(ours - _sample(family, embeddings, [LoraSpec(str(path), 0.6)])).max() < TOL
    assert main(args + ["--lora-2", str(path), "--output-dir", str(tmp_path / "bad")]) == 2
    assert "two-expert" in capsys.readouterr().err
