"""The pack loads the way ComfyUI loads it, and the node chain makes the same frames as diffusers."""

import importlib.util
import sys

import numpy as np
import pytest
import torch
from conftest import NEGATIVE, PROMPT, ROOT
from oracle import diffusers_frames

from tpu_runtime.errors import Interrupted

EXPECTED = {
    "TPUCogVideoXLoader": ("TPU_COGVIDEOX_MODEL",),
    "TPUCogVideoXTextEncode": ("TPU_COGVIDEOX_EMBEDS",),
    "TPUCogVideoXImageEncode": ("TPU_COGVIDEOX_IMAGE", "INT", "INT", "INT"),
    "TPUCogVideoXLoRA": ("TPU_COGVIDEOX_MODEL",),
    "TPUCogVideoXStepCache": ("TPU_COGVIDEOX_MODEL",),
    "TPUCogVideoXSampler": ("LATENT",),
    "TPUCogVideoXDecode": ("IMAGE",),
    "TPUWanLoader": ("TPU_WAN_MODEL",),
    "TPUWanModelFilesLoader": ("TPU_WAN_MODEL",),
    "TPUWanTextEncode": ("TPU_WAN_EMBEDS",),
    "TPUWanImageEncode": ("TPU_WAN_IMAGE", "INT", "INT", "INT"),
    "TPUWanLoRA": ("TPU_WAN_MODEL",),
    "TPUWanStepCache": ("TPU_WAN_MODEL",),
    "TPUWanSampler": ("LATENT",),
    "TPUWanDecode": ("IMAGE",),
    "TPULTX2Loader": ("TPU_LTX2_MODEL",),
    "TPULTX2ModelFilesLoader": ("TPU_LTX2_MODEL",),
    "TPULTX2TextEncode": ("TPU_LTX2_EMBEDS",),
    "TPULTX2ImageEncode": ("TPU_LTX2_IMAGE", "INT", "INT", "INT"),
    "TPULTX2LoRA": ("TPU_LTX2_MODEL",),
    "TPULTX2Sampler": ("LATENT",),
    "TPULTX2Upsample": ("LATENT",),
    "TPULTX2Decode": ("IMAGE", "AUDIO"),
}
# The native bridge's nodes: ComfyUI's own models on the runtime, ComfyUI's own types in and out.
BRIDGE = {"TPUDiffusionModel": ("MODEL",), "TPUVAE": ("VAE",), "TPUTextEncoder": ("CLIP",),
          "TPUCLIPVision": ("CLIP_VISION",), "TPUAudioEncoder": ("AUDIO_ENCODER",)}
EXPECTED.update(BRIDGE)
CATEGORIES = {"Wan": "TPU video/Wan", "CogVideoX": "TPU video/CogVideoX", "LTX2": "TPU video/LTX-2"}


@pytest.fixture(scope="module")
def pack():
    """Import the folder as ComfyUI does: a module spec on its __init__.py under a name of the folder's."""
    name = "tpu_video_nodes_under_test"
    spec = importlib.util.spec_from_file_location(name, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_pack_registers_nodes(pack):
    assert set(pack.NODE_CLASS_MAPPINGS) == set(EXPECTED)
    assert set(pack.NODE_DISPLAY_NAME_MAPPINGS) == set(EXPECTED)
    for key, cls in pack.NODE_CLASS_MAPPINGS.items():
        assert cls.RETURN_TYPES == EXPECTED[key]
        if key in BRIDGE:
            assert cls.CATEGORY == "TPU video" and pack.NODE_DISPLAY_NAME_MAPPINGS[key].startswith("TPU ")
            assert set(cls.INPUT_TYPES()["required"]) == {BRIDGE[key][0].lower()}  # model, vae, clip, clip_vision, audio_encoder
            continue
        assert cls.CATEGORY == next(c for name, c in CATEGORIES.items() if key.startswith(f"TPU{name}"))
        assert callable(getattr(cls, cls.FUNCTION))
        inputs = cls.INPUT_TYPES()
        assert "required" in inputs
        for spec in inputs["required"].values():
            assert isinstance(spec, tuple) and spec
        assert "(TPU)" in pack.NODE_DISPLAY_NAME_MAPPINGS[key]


def test_import_touches_no_device():
    """ComfyUI imports every pack at start-up: importing ours must not start JAX or torchax."""
    import subprocess

    code = (
        "import importlib.util, sys;"
        f"spec = importlib.util.spec_from_file_location('p', r'{ROOT / '__init__.py'}', "
        f"submodule_search_locations=[r'{ROOT}']);"
        "m = importlib.util.module_from_spec(spec); sys.modules['p'] = m; spec.loader.exec_module(m);"
        "print(len(m.NODE_CLASS_MAPPINGS), 'jax' in sys.modules, 'torchax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(len(EXPECTED)), "False", "False"]


def _run_chain(pack, model_dir, steps=3, seed=4, **sampler_overrides):
    m = pack.NODE_CLASS_MAPPINGS
    (model,) = m["TPUCogVideoXLoader"]().load("", "float32", model_path=str(model_dir))
    (embeds,) = m["TPUCogVideoXTextEncode"]().encode(model, PROMPT, NEGATIVE)
    kwargs = dict(width=96, height=64, length=9, steps=steps, cfg=6.0, seed=seed, scheduler="model default",
                  dynamic_cfg=False)
    kwargs.update(sampler_overrides)
    (latent,) = m["TPUCogVideoXSampler"]().sample(model, embeds, **kwargs)
    (image,) = m["TPUCogVideoXDecode"]().decode(model, latent, tiling=False)
    return model, latent, image


def test_node_chain_matches_diffusers(pack, tiny_models):
    model, latent, image = _run_chain(pack, tiny_models["5b"])
    assert latent["samples"].shape == (1, 4, 3, 8, 12)  # ComfyUI LATENT: [B, C, T, H/8, W/8]
    assert image.dtype == torch.float32 and image.shape == (9, 64, 96, 3)
    assert 0.0 <= float(image.min()) and float(image.max()) <= 1.0
    ref = diffusers_frames(tiny_models["5b"], PROMPT, NEGATIVE, 64, 96, 9, 3, 6.0, 4)
    assert np.abs(image.numpy() - ref).max() < 1e-4
    # Loading the same folder again reuses the loaded model (and its device buffers).
    (again,) = pack.NODE_CLASS_MAPPINGS["TPUCogVideoXLoader"]().load("", "float32", model_path=str(tiny_models["5b"]))
    assert again is model


def test_interrupt_stops_between_steps_and_next_run_is_correct(pack, tiny_models):
    m = pack.NODE_CLASS_MAPPINGS
    (model,) = m["TPUCogVideoXLoader"]().load("", "float32", model_path=str(tiny_models["2b"]))
    (embeds,) = m["TPUCogVideoXTextEncode"]().encode(model, PROMPT, NEGATIVE)
    from tpu_runtime.families.cogvideox.model import SampleSettings

    seen = []
    with pytest.raises(Interrupted, match="before step 3 of 5"):
        model.sample(embeds, SampleSettings(64, 96, 9, steps=5, guidance=6.0, seed=4),
                     on_step=lambda i, n: seen.append(i), should_stop=lambda: len(seen) >= 2)
    assert seen == [1, 2]
    _, _, image = _run_chain(pack, tiny_models["2b"])
    ref = diffusers_frames(tiny_models["2b"], PROMPT, NEGATIVE, 64, 96, 9, 3, 6.0, 4)
    assert np.abs(image.numpy() - ref).max() < 1e-4


def test_decode_takes_a_plain_comfy_latent(pack, tiny_models):
    """Between our sampler and decoder, ComfyUI's own latent nodes hand on a plain {"samples": tensor}."""
    from tpu_runtime.errors import StageFileError

    model, latent, image = _run_chain(pack, tiny_models["5b"])
    decode = pack.NODE_CLASS_MAPPINGS["TPUCogVideoXDecode"]()
    (plain,) = decode.decode(model, {"samples": latent["samples"].clone()}, tiling=False)
    assert torch.equal(plain, image)
    with pytest.raises(StageFileError, match=r"shape \(1, 4, 8, 12\); CogVideoX decodes video latents"):
        decode.decode(model, {"samples": torch.zeros(1, 4, 8, 12)}, tiling=False)


def test_switching_models_releases_the_previous_one(pack, tiny_models):
    loader = pack.NODE_CLASS_MAPPINGS["TPUCogVideoXLoader"]()
    (first,) = loader.load("", "float32", model_path=str(tiny_models["2b"]))
    first.encode("a cat")  # puts the text encoder on the device
    assert first._states
    (second,) = loader.load("", "float32", model_path=str(tiny_models["5b"]))
    assert second is not first and not first._states


def test_comfy_unload_hook_frees_our_models(pack, tiny_models, monkeypatch):
    import types

    calls = []
    comfy = types.ModuleType("comfy")
    mm = types.ModuleType("comfy.model_management")
    mm.unload_all_models = lambda: calls.append("comfy")
    comfy.model_management = mm
    monkeypatch.setitem(sys.modules, "comfy", comfy)
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    nodes_module = pack.nodes.common
    assert nodes_module.install_comfy_unload_hook() and nodes_module.install_comfy_unload_hook()
    (model,) = pack.NODE_CLASS_MAPPINGS["TPUCogVideoXLoader"]().load("", "float32", model_path=str(tiny_models["2b"]))
    model.encode("a cat")
    mm.unload_all_models()  # what ComfyUI's "free memory" / "unload models" calls
    assert calls == ["comfy"] and not model._states and not nodes_module._models


@pytest.fixture
def fake_comfy_folders(tmp_path, monkeypatch):
    """A stand-in for ComfyUI's folder_paths with its real API: models/diffusers plus an extra_model_paths entry."""
    import types

    import os

    models = tmp_path / "ComfyUI" / "models"
    extra = tmp_path / "shared_models" / "diffusers"
    kinds = ("diffusion_models", "text_encoders", "vae", "loras")
    for p in (models / "diffusers", models / "CogVideo", extra, *(models / k for k in kinds)):
        p.mkdir(parents=True)
    registry = {"diffusers": ([str(models / "diffusers"), str(extra)], set())}
    registry.update({k: ([str(models / k)], {".safetensors"}) for k in kinds})
    fp = types.ModuleType("folder_paths")
    fp.models_dir = str(models)
    fp.folder_names_and_paths = registry
    fp.add_model_folder_path = lambda name, path: registry.setdefault(name, ([], set()))[0].append(path)
    fp.get_folder_paths = lambda name: list(registry[name][0])
    fp.get_filename_list = lambda name: sorted(f for d in registry[name][0] for f in os.listdir(d))

    def get_full_path(name, filename):
        for d in registry[name][0]:
            if os.path.isfile(os.path.join(d, filename)):
                return os.path.join(d, filename)
        return None

    fp.get_full_path = get_full_path
    (tmp_path / "ComfyUI" / "output").mkdir()
    fp.get_output_directory = lambda: str(tmp_path / "ComfyUI" / "output")
    monkeypatch.setitem(sys.modules, "folder_paths", fp)
    return models, extra


def test_loader_lists_models_from_comfy_folders(pack, tiny_models, fake_comfy_folders):
    import shutil

    models, extra = fake_comfy_folders
    shutil.copytree(tiny_models["2b"], models / "CogVideo" / "CogVideoX-2b")  # where the GPU wrapper downloads
    shutil.copytree(tiny_models["5b"], extra / "CogVideoX-5b")  # from extra_model_paths.yaml
    (models / "diffusers" / "not-a-model").mkdir()
    loader = pack.NODE_CLASS_MAPPINGS["TPUCogVideoXLoader"]
    assert loader.INPUT_TYPES()["required"]["model"][0] == ["CogVideoX-2b", "CogVideoX-5b"]
    (model,) = loader().load("CogVideoX-5b", "float32")
    assert model.generation == "5b"


def test_missing_model_lists_where_we_looked(pack, fake_comfy_folders):
    from tpu_runtime.errors import ModelFolderError
    from tpu_runtime.families import registry

    models, extra = fake_comfy_folders
    loader = pack.NODE_CLASS_MAPPINGS["TPUCogVideoXLoader"]
    assert loader.INPUT_TYPES()["required"]["model"][0] == [pack.nodes.kinds.no_models(registry.spec_named("cogvideox"))]
    with pytest.raises(ModelFolderError) as err:
        loader().load("CogVideoX-2b", "auto")
    message = str(err.value)
    for folder in (models / "diffusers", extra, models / "CogVideo"):
        assert str(folder) in message


def test_device_buffers_stable_over_prompts_and_freed_on_unload(pack, tiny_models):
    import gc

    import jax

    nodes_module = pack.nodes.common

    def live_bytes():
        gc.collect()
        return sum(a.nbytes for a in jax.live_arrays())

    nodes_module.unload_all()
    baseline = live_bytes()
    counts = []
    for seed in range(5):
        _run_chain(pack, tiny_models["2b"], steps=2, seed=seed)
        gc.collect()
        counts.append((len(jax.live_arrays()), live_bytes()))
    assert counts[0][1] > baseline + 100_000  # the weights are on the device
    assert len(set(counts)) == 1, f"live device buffers grew over prompts: {counts}"
    nodes_module.unload_all()
    assert live_bytes() <= baseline + 64  # only torchax's PRNG key (8 bytes) may appear, never model buffers


def test_nodes_run_under_comfy_inference_mode(pack, tiny_models, tiny_wan):
    """ComfyUI executes nodes inside torch.inference_mode(); tracing must still see decomposed ops (every trace:
    the compiled programs and the shapes the Wan frame-by-frame decode works out for its later-frame program)."""
    import tpu_runtime.engine.runtime as rt

    rt.get_runtime().clear_programs()  # make the chains trace again, inside inference mode
    with torch.inference_mode():
        _, _, image = _run_chain(pack, tiny_models["2b"], steps=2, seed=1)
        (wan,) = pack.NODE_CLASS_MAPPINGS["TPUWanLoader"]().load("", "float32", model_path=str(tiny_wan["2.1"]))
        _, wan_image = _wan_chain(pack, wan, steps=2)
    assert image.shape == (9, 64, 96, 3)
    assert wan_image.shape == (9, 64, 64, 3)


# --- Wan -----------------------------------------------------------------------------------------------------------
def _wan_chain(pack, loaded, steps=3, seed=4, **sampler):
    m = pack.NODE_CLASS_MAPPINGS
    (embeds,) = m["TPUWanTextEncode"]().encode(loaded, PROMPT, NEGATIVE)
    kwargs = dict(width=64, height=64, length=9, steps=steps, cfg=5.0, seed=seed, scheduler="model default")
    kwargs.update(sampler)
    (latent,) = m["TPUWanSampler"]().sample(loaded, embeds, **kwargs)
    (image,) = m["TPUWanDecode"]().decode(loaded, latent)
    return latent, image


def test_wan_node_chain_matches_diffusers(pack, tiny_wan):
    from oracle import wan_frames

    (model,) = pack.NODE_CLASS_MAPPINGS["TPUWanLoader"]().load("", "float32", model_path=str(tiny_wan["2.1"]))
    latent, image = _wan_chain(pack, model)
    assert latent["samples"].shape == (1, 16, 3, 8, 8)  # ComfyUI LATENT: [B, C, T, H/8, W/8]
    assert image.shape == (9, 64, 64, 3)
    ref = wan_frames(tiny_wan["2.1"], PROMPT, NEGATIVE, 64, 64, 9, 3, 5.0, 4)
    assert np.abs(image.numpy() - ref).max() < 1e-4


def test_wan_files_loader_lists_comfy_folders_and_matches_diffusers(pack, tiny_wan, fake_comfy_folders):
    """Two-expert Wan 2.2 from ComfyUI's own folders (scaled-fp8 experts), with a second guidance."""
    from oracle import wan_frames

    from comfy_files import export_wan_files as export_comfy_files

    models, _ = fake_comfy_folders
    files = export_comfy_files(tiny_wan["2.2-A14B"], models / "staging", "fp8_scaled")
    for key, kind in (("transformer", "diffusion_models"), ("transformer_2", "diffusion_models"),
                      ("text_encoder", "text_encoders"), ("vae", "vae")):
        files[key].rename(models / kind / files[key].name)
    loader = pack.NODE_CLASS_MAPPINGS["TPUWanModelFilesLoader"]
    inputs = loader.INPUT_TYPES()
    high, low = "wan_transformer_fp8_scaled.safetensors", "wan_transformer_2_fp8_scaled.safetensors"
    assert inputs["required"]["diffusion_model"][0] == sorted([high, low])
    assert inputs["optional"]["diffusion_model_2"][0] == ["none", *sorted([high, low])]
    (model,) = loader().load(high, files["text_encoder"].name, files["vae"].name, "float32",
                             diffusion_model_2=low)
    assert model.two_experts
    _, image = _wan_chain(pack, model, steps=5, cfg=4.0, cfg_2=2.0)
    ref = wan_frames(tiny_wan["2.2-A14B"], PROMPT, NEGATIVE, 64, 64, 9, 5, 4.0, 4, guidance_2=2.0)
    assert np.abs(image.numpy() - ref).max() < 1e-4


def test_wan_nodes_refuse_what_the_model_does_not_have(pack, tiny_wan):
    from tpu_runtime.errors import InputError

    (model,) = pack.NODE_CLASS_MAPPINGS["TPUWanLoader"]().load("", "float32", model_path=str(tiny_wan["2.1"]))
    with pytest.raises(InputError, match="cfg_2=3.0 applies only to two-expert.*leave cfg_2 unset"):
        _wan_chain(pack, model, cfg_2=3.0)
    with pytest.raises(InputError, match=r"length=10 must be 4\*N\+1 for Wan 2.1 \(nearest: 9 or 13"):
        _wan_chain(pack, model, length=10)


def test_wan_interrupt_stops_between_steps(pack, tiny_wan):
    from tpu_runtime.engine.stages import SampleSettings

    (model,) = pack.NODE_CLASS_MAPPINGS["TPUWanLoader"]().load("", "float32", model_path=str(tiny_wan["2.1"]))
    (embeds,) = pack.NODE_CLASS_MAPPINGS["TPUWanTextEncode"]().encode(model, PROMPT, NEGATIVE)
    seen = []
    with pytest.raises(Interrupted, match="before step 3 of 5"):
        model.sample(embeds, SampleSettings(64, 64, 9, steps=5, guidance=5.0, seed=4),
                     on_step=lambda i, n: seen.append(i), should_stop=lambda: len(seen) >= 2)
    assert seen == [1, 2]


def test_wan_loader_lists_wan_folders_only(pack, tiny_wan, tiny_models, fake_comfy_folders):
    import shutil

    models, _ = fake_comfy_folders
    shutil.copytree(tiny_wan["2.1"], models / "diffusers" / "Wan2.1-T2V-1.3B-Diffusers")
    shutil.copytree(tiny_models["2b"], models / "diffusers" / "CogVideoX-2b")
    assert pack.NODE_CLASS_MAPPINGS["TPUWanLoader"].INPUT_TYPES()["required"]["model"][0] == \
        ["Wan2.1-T2V-1.3B-Diffusers"]
    assert pack.NODE_CLASS_MAPPINGS["TPUCogVideoXLoader"].INPUT_TYPES()["required"]["model"][0] == ["CogVideoX-2b"]


def test_wan_lora_nodes_chain_per_expert_and_leave_no_trace(pack, tiny_wan, fake_comfy_folders):
    """LoRA nodes chained between loader and sampler, one per expert of Wan 2.2 A14B, listing models/loras: the
    frames equal diffusers with the same LoRAs fused; the same loaded model without them samples as before."""
    from diffusers import WanPipeline
    from oracle import lora_frames, wan_frames

    from tpu_runtime.errors import InputError
    from tpu_runtime.families.wan.tiny import build_tiny_lora

    models, _ = fake_comfy_folders
    folder = tiny_wan["2.2-A14B"]
    build_tiny_lora(folder / "transformer", models / "loras" / "high.safetensors", "comfy", seed=11)
    build_tiny_lora(folder / "transformer_2", models / "loras" / "low.safetensors", "comfy_ab", seed=12)
    node = pack.NODE_CLASS_MAPPINGS["TPUWanLoRA"]
    inputs = node.INPUT_TYPES()
    assert inputs["required"]["lora_name"][0] == ["high.safetensors", "low.safetensors"]
    assert inputs["optional"]["expert"][0] == ["both", "high noise", "low noise"]
    (model,) = pack.NODE_CLASS_MAPPINGS["TPUWanLoader"]().load("", "float32", model_path=str(folder))
    (with_high,) = node().apply(model, "high.safetensors", 0.8, expert="high noise")
    (with_both,) = node().apply(with_high, "low.safetensors", 0.6, expert="low noise")
    _, image = _wan_chain(pack, with_both)
    ref, _ = lora_frames(WanPipeline, folder, [(models / "loras" / "high.safetensors", 0.8)],
                         [(models / "loras" / "low.safetensors", 0.6)], prompt=PROMPT, negative_prompt=NEGATIVE,
                         height=64, width=64, num_frames=9, num_inference_steps=3, guidance_scale=5.0, seed=4)
    assert np.abs(image.numpy() - ref).max() < 1e-4
    _, plain = _wan_chain(pack, model)  # the loader's output, no LoRA node: the LoRAs come off again
    assert np.abs(plain.numpy() - wan_frames(folder, PROMPT, NEGATIVE, 64, 64, 9, 3, 5.0, 4)).max() < 1e-4

    (single,) = pack.NODE_CLASS_MAPPINGS["TPUWanLoader"]().load("", "float32", model_path=str(tiny_wan["2.1"]))
    with pytest.raises(InputError, match="one transformer"):
        node().apply(single, "high.safetensors", 1.0, expert="low noise")


def test_step_cache_node_runs_the_sampler_cached_with_progress_and_cancel(pack, tiny_wan, fake_comfy_folders,
                                                                         monkeypatch):
    """The step cache node between loader and sampler: the sampler's frames and latents equal diffusers' with the
    same MagCacheConfig; ComfyUI's progress bar still ticks every step (skipped ones too) and Cancel stops it; the
    loaded model without the node samples uncached; calibrating writes the ratios to the output folder; what the
    node cannot run is refused on the node."""
    import json
    import types

    from diffusers.hooks import MagCacheConfig
    from oracle import load_wan_pipeline, step_cached, wan_frames

    from tpu_runtime.errors import InputError

    ticks, cancel = [], {"after": None}

    class ProgressBar:
        def __init__(self, total):
            self.total = total

        def update_absolute(self, value, total=None):
            if self.total > 1:  # the sampler's bar (the decode node's has one unit)
                ticks.append(value)

    comfy, utils, mm = (types.ModuleType(n) for n in ("comfy", "comfy.utils", "comfy.model_management"))
    utils.ProgressBar = ProgressBar
    mm.processing_interrupted = lambda: cancel["after"] is not None and len(ticks) >= cancel["after"]

    def throw():
        if mm.processing_interrupted():
            raise KeyboardInterrupt("ComfyUI: processing interrupted")

    mm.throw_exception_if_processing_interrupted = throw
    comfy.utils, comfy.model_management = utils, mm
    for name, module in (("comfy", comfy), ("comfy.utils", utils), ("comfy.model_management", mm)):
        monkeypatch.setitem(sys.modules, name, module)

    m = pack.NODE_CLASS_MAPPINGS
    folder = tiny_wan["2.1"]
    (model,) = m["TPUWanLoader"]().load("", "float32", model_path=str(folder))
    node = m["TPUWanStepCache"]
    inputs = node.INPUT_TYPES()
    assert inputs["required"]["method"][0] == ["magcache", "first-block"]
    ratios = "1.0, 0.99, 0.99, 0.99, 0.99, 0.99, 0.99, 0.99"
    (cached,) = node().apply(model, "magcache", 0.06, 3, 0.2, mag_ratios=ratios)
    latent, image = _wan_chain(pack, cached, steps=8)
    assert ticks == list(range(1, 9))
    config = MagCacheConfig(num_inference_steps=8, mag_ratios=[float(r) for r in ratios.split(",")])
    pipe = load_wan_pipeline(str(folder))
    with step_cached(pipe, {"transformer": config}):
        ref = wan_frames(folder, PROMPT, NEGATIVE, 64, 64, 9, 8, 5.0, 4)
        ref_latents = wan_frames(folder, PROMPT, NEGATIVE, 64, 64, 9, 8, 5.0, 4, output_type="latent")
    assert np.abs(image.numpy() - ref).max() < 1e-4
    assert np.abs(latent["samples"][0].numpy() - ref_latents.numpy()).max() < 2e-4
    assert model.step_cache_report["skipped_steps"] == [3, 4, 5, 7, 8]
    plain, _ = _wan_chain(pack, model, steps=8)  # the loader's output, no step cache node
    assert model.step_cache_report is None
    assert (plain["samples"] - latent["samples"]).abs().max() > 1e-3

    cancel["after"], ticks[:] = 3, []
    with pytest.raises(KeyboardInterrupt):
        _wan_chain(pack, cached, steps=8)
    assert ticks == [1, 2, 3]
    cancel["after"] = None

    (calibrating,) = node().apply(model, "magcache", 0.06, 3, 0.2, calibrate=True)
    _wan_chain(pack, calibrating, steps=4)
    written = list((fake_comfy_folders[0].parent / "output").glob("mag_ratios_*.json"))
    assert len(written) == 1 and len(json.loads(written[0].read_text())) == 4

    with pytest.raises(InputError, match="no published MagCache ratios"):
        node().apply(model, "magcache", 0.06, 3, 0.2)
    with pytest.raises(InputError, match="calibrate: MagCache's"):
        node().apply(model, "first-block", 0.05, 3, 0.2, calibrate=True)
    with pytest.raises(InputError, match="mag_ratios"):
        node().apply(model, "magcache", 0.06, 3, 0.2, mag_ratios="1.0, x")


# --- image-to-video ------------------------------------------------------------------------------------------------
def _comfy_image(path):
    """A picture as ComfyUI's Load Image gives it: [1, H, W, 3] float32 in 0..1."""
    from PIL import Image

    return torch.from_numpy(np.asarray(Image.open(path).convert("RGB")).copy()).float()[None] / 255


def test_flf2v_nodes_from_comfy_images_match_diffusers(pack, i2v_models, images):
    """Wan FLF2V through the nodes: two ComfyUI IMAGEs (first, last) into Wan Image Encode, its output into the
    sampler; the frames equal diffusers' WanImageToVideoPipeline on the same picture files, run in inference mode
    as ComfyUI runs nodes."""
    from oracle import wan_i2v_frames

    m = pack.NODE_CLASS_MAPPINGS
    with torch.inference_mode():
        (model,) = m["TPUWanLoader"]().load("", "float32", model_path=str(i2v_models["wan-flf2v"]))
        cond, *_ = m["TPUWanImageEncode"]().encode(model, _comfy_image(images["first"]), 64, 64, 9,
                                                   last_image=_comfy_image(images["last"]))
        _, image = _wan_chain(pack, model, image_cond=cond)
    ref = wan_i2v_frames(i2v_models["wan-flf2v"], images["first"], images["last"], PROMPT, NEGATIVE, 64, 64, 9, 3,
                         5.0, 4)
    assert np.abs(image.numpy() - ref).max() < 1e-4


def test_image_nodes_refuse_what_does_not_fit(pack, tiny_models, i2v_models, images):
    from tpu_runtime.errors import InputError

    m = pack.NODE_CLASS_MAPPINGS
    picture = _comfy_image(images["first"])
    (t2v,) = m["TPUCogVideoXLoader"]().load("", "float32", model_path=str(tiny_models["5b"]))
    with pytest.raises(InputError, match="text-to-video model and takes no image"):
        m["TPUCogVideoXImageEncode"]().encode(t2v, picture, 64, 64, 9)
    (i2v,) = m["TPUCogVideoXLoader"]().load("", "float32", model_path=str(i2v_models["cog-5b"]))
    with pytest.raises(InputError, match="takes only a first image: drop last_image"):
        m["TPUCogVideoXImageEncode"]().encode(i2v, picture, 64, 64, 9, last_image=picture)
    (embeds,) = m["TPUCogVideoXTextEncode"]().encode(i2v, PROMPT, NEGATIVE)
    sample = dict(steps=2, cfg=6.0, seed=1, scheduler="model default", dynamic_cfg=False)
    with pytest.raises(InputError, match="image-to-video model: encode the first frame"):
        m["TPUCogVideoXSampler"]().sample(i2v, embeds, width=64, height=64, length=9, **sample)
    cond, width, height, length = m["TPUCogVideoXImageEncode"]().encode(i2v, picture, 64, 64, 9)
    assert (width, height, length) == (64, 64, 9)  # for the sampler's inputs of the same names
    with pytest.raises(InputError, match="width x height x length = 64x64x17, but the image was encoded for 64x64x9: "
                                         "connect the Image Encode's width, height and length outputs"):
        m["TPUCogVideoXSampler"]().sample(i2v, embeds, width=64, height=64, length=17, image_cond=cond, **sample)



def test_loaders_choose_the_decode_layout_and_fsdp(pack, tiny_models, tiny_wan):
    """Every loader ends with vae_sharding (auto: the width split on more than one chip) and fsdp: after every
    older input, so a workflow saved before them keeps its values in place. Each choice is its own loaded model,
    and FSDP on a mesh without dp is refused before anything loads."""
    from tpu_runtime.errors import InputError

    m = pack.NODE_CLASS_MAPPINGS
    for name in ("TPUCogVideoXLoader", "TPUWanLoader", "TPUWanModelFilesLoader"):
        optional = m[name].INPUT_TYPES()["optional"]
        assert list(optional)[-2:] == ["vae_sharding", "fsdp"], name
        assert optional["vae_sharding"][0] == ["auto", "width", "replicated"]
        assert optional["vae_sharding"][1]["default"] == "auto"
        assert optional["fsdp"][0] == "BOOLEAN" and optional["fsdp"][1]["default"] is False
    loader = m["TPUCogVideoXLoader"]()
    (auto,) = loader.load("", "float32", model_path=str(tiny_models["2b"]))
    assert auto.vae_sharding == "replicated" and auto.fsdp is False  # one device here: nothing to split over
    (width,) = loader.load("", "float32", model_path=str(tiny_models["2b"]), vae_sharding="width")
    assert width is not auto and width.vae_sharding == "width"
    (wan,) = m["TPUWanLoader"]().load("", "float32", model_path=str(tiny_wan["2.1"]), vae_sharding="replicated")
    assert wan.vae_sharding == "replicated"
    with pytest.raises(InputError, match="fsdp splits the weights over the mesh's dp axis, and mesh dp=1"):
        m["TPUWanLoader"]().load("", "float32", model_path=str(tiny_wan["2.1"]), fsdp=True)
