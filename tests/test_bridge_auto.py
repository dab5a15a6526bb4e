"""The automatic mode (TPU_VIDEO_AUTO, the settings dialog's TPUVideo.AutomaticMode) and TPU CLIP Vision, inside one
process with ComfyUI's own code: loaders are recognised by their declared types (any pack's), their outputs go to
the runtime as the TPU nodes' defaults put them and sample equal to ComfyUI's native CPU run (float32, 1e-4), a
model whose code cannot be compiled runs on the host (named once in the log) and still equals the native run, bad
values of the variable and of the setting are errors naming them and the valid values. ComfyUI's CLIP vision model
on the runtime equals its native run. The whole graph in a real server: tests/test_templates.py."""

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from comfy_native import ROOT, comfyui_session, load, load_pack, relative, sample, save_diffusion_model, tiny_wan, \
    versions_param

TOL = 1e-4
LATENT = torch.zeros(1, 16, 2, 8, 8)


@pytest.fixture(scope="module", params=versions_param())
def pack(request):
    with comfyui_session(request.param):
        yield load_pack()


@pytest.fixture
def auto(pack):
    """The automatic mode's module with every part on (as TPU_VIDEO_AUTO=1), off again afterwards."""
    from tpu_runtime.bridge import auto

    auto._state.started = frozenset(auto.PARTS)
    yield auto
    auto._state.started = frozenset()


def conds(seed=1, width=4096):
    g = torch.Generator().manual_seed(seed)
    return ([[torch.randn(1, 6, width, generator=g), {}]], [[torch.randn(1, 6, width, generator=g), {}]])


def test_values_of_the_variable_and_the_setting(pack, tmp_path, monkeypatch):
    from tpu_runtime.bridge import auto

    assert auto.parse_parts("1") == auto.parse_parts("all") == frozenset(auto.PARTS)
    assert auto.parse_parts("0") == auto.parse_parts("") == auto.parse_parts("off") == frozenset()
    assert auto.parse_parts(" model, VAE ") == {"model", "vae"}
    with pytest.raises(auto.AutoModeError, match=r"TPU_VIDEO_AUTO='model,unet'.*'unet'.*model, text, vae"):
        auto.parse_parts("model,unet")
    # the settings dialog's value wins over the variable, "as started" keeps the variable's
    import folder_paths

    monkeypatch.setattr(folder_paths, "get_user_directory", lambda: str(tmp_path))
    monkeypatch.setattr(auto._state, "started", frozenset({"model"}))
    store = tmp_path / "default" / "comfy.settings.json"
    store.parent.mkdir()
    for value, parts in (("as started", {"model"}), ("off", set()), ("model,text,vae", {"model", "text", "vae"})):
        store.write_text(json.dumps({auto.SETTING: value, "Comfy.Other": 1}))
        os.utime(store, ns=(len(value), len(value)))  # a new stamp even within the file system's time resolution
        assert auto.active_parts() == parts, value
    store.write_text(json.dumps({auto.SETTING: "everything"}))
    with pytest.raises(auto.AutoModeError, match=r"setting TPUVideo.AutomaticMode='everything'"):
        auto.active_parts()


def test_a_bad_variable_stops_comfyui_at_start_up():
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('pack', sys.argv[1], "
            "submodule_search_locations=[sys.argv[2]]); m = importlib.util.module_from_spec(spec); "
            "sys.modules['pack'] = m; spec.loader.exec_module(m)")
    env = dict(os.environ, TPU_VIDEO_AUTO="gpu", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", code, str(ROOT / "__init__.py"), str(ROOT)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr[-2000:]
    assert "TPU_VIDEO_AUTO='gpu' is not a valid value" in run.stderr and "model, text, vae" in run.stderr


def test_loaders_of_any_pack_are_found_by_their_declared_types(pack):
    import nodes
    from tpu_runtime.bridge.auto import loader_slots

    assert loader_slots(nodes.UNETLoader) == {0: "model"}
    assert loader_slots(nodes.CheckpointLoaderSimple) == {0: "model", 1: "text", 2: "vae"}
    assert loader_slots(nodes.CLIPLoader) == loader_slots(nodes.DualCLIPLoader) == {0: "text"}
    assert loader_slots(nodes.VAELoader) == {0: "vae"}
    assert loader_slots(nodes.CLIPVisionLoader) == {0: "clip_vision"}
    from comfy_extras.nodes_video_model import ImageOnlyCheckpointLoader

    assert loader_slots(ImageOnlyCheckpointLoader) == {0: "model", 1: "clip_vision", 2: "vae"}

    class OtherPacksLoader:  # a custom pack's loader: no model input, ComfyUI's types out
        RETURN_TYPES = ("STRING", "MODEL", "VAE")

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"path": ("STRING", {})}}

    assert loader_slots(OtherPacksLoader) == {1: "model", 2: "vae"}
    # nodes that take a model are not loaders: LoRA loaders, model patches, the TPU nodes themselves
    for cls in (nodes.LoraLoader, nodes.LoraLoaderModelOnly, nodes.CLIPSetLastLayer,
                pack.NODE_CLASS_MAPPINGS["TPUDiffusionModel"], pack.NODE_CLASS_MAPPINGS["TPUCLIPVision"]):
        assert loader_slots(cls) == {}, cls


def test_a_loaded_model_runs_on_the_runtime_and_equals_native(pack, auto, tmp_path, caplog):
    import execution
    import nodes

    assert auto.install(execution) and auto.install(execution)  # idempotent
    model = load(save_diffusion_model(tiny_wan("t2v", layers=1), tmp_path / "wan.safetensors", seed=2))
    positive, negative = conds()
    native = sample(model, LATENT, positive, negative, steps=2)
    with caplog.at_level(logging.INFO, logger="tpu_runtime.bridge.auto"):
        output, _, _ = execution.get_output_from_returns([(model,)], nodes.UNETLoader())
    on_runtime = output[0][0]
    forward = on_runtime.object_patches["diffusion_model._forward"]
    assert isinstance(forward, auto.HostFallback)
    assert "WanModel from UNETLoader runs on the TPU runtime (model, mesh dp=1,sp=1,tp=1)" in caplog.text
    out = sample(on_runtime, LATENT, positive, negative, steps=2)
    assert relative(out, native) < TOL
    assert forward.bridged.stats.programs == 1 and forward.bridged.stats.calls == 2
    # the mode off: the loader's output is ComfyUI's own
    auto._state.started = frozenset()
    output, _, _ = execution.get_output_from_returns([(model,)], nodes.UNETLoader())
    assert output[0][0] is model


def _untraceable_block(args, extra):
    """A block replacement (as a custom node's patch sets one) that branches in Python on a computed value."""
    out = extra["original_block"](args)
    if out["img"].abs().sum() > 0:  # data-dependent Python control flow: cannot be compiled
        return out
    return out


def test_a_model_that_cannot_be_compiled_runs_on_the_host(pack, auto, tmp_path, caplog):
    model = load(save_diffusion_model(tiny_wan("t2v", layers=1), tmp_path / "wan.safetensors", seed=3))
    model.set_model_patch_replace(_untraceable_block, "dit", "double_block", 0)
    positive, negative = conds(seed=2)
    native = sample(model, LATENT, positive, negative, steps=2)
    on_runtime = auto.on_runtime("model", model, "UNETLoader")
    with caplog.at_level(logging.WARNING, logger="tpu_runtime.bridge.auto"):
        out = sample(on_runtime, LATENT, positive, negative, steps=2)
        again = sample(on_runtime, LATENT, positive, negative, steps=2)
    assert relative(out, native) < TOL and relative(again, native) < TOL
    warnings = [r.getMessage() for r in caplog.records if "runs on the host" in r.getMessage()]
    assert len(warnings) == 1 and "WanModel cannot run on the TPU runtime" in warnings[0], warnings
    assert "data-dependent Python control flow" in warnings[0]


def test_tpu_clip_vision_equals_native_and_compiles_once_per_batch(pack):
    from pathlib import Path

    import comfy.clip_vision
    from tpu_runtime.bridge.tiny import CLIP_VISION_H_FILE_CONFIG, clip_vision_h_config, tiny_clip_vision
    from tpu_runtime.bridge.vision import bridged_vision_models

    tree = Path(comfy.clip_vision.__file__).resolve().parents[1]
    config = clip_vision_h_config(tree, **{**CLIP_VISION_H_FILE_CONFIG, "num_hidden_layers": 3})
    clip_vision = tiny_clip_vision(config, seed=4)
    on_tpu = pack.NODE_CLASS_MAPPINGS["TPUCLIPVision"]().apply(clip_vision)[0]
    (bridged,) = bridged_vision_models(on_tpu).values()
    g = torch.Generator().manual_seed(0)
    for seed in range(2):  # an image of another size and content: ComfyUI resizes it to 224, nothing compiles again
        image = torch.rand(1, 40 + 8 * seed, 56, 3, generator=g)
        with torch.inference_mode():  # as ComfyUI runs its nodes
            native, out = clip_vision.encode_image(image), on_tpu.encode_image(image)
        for key in ("last_hidden_state", "image_embeds", "penultimate_hidden_states"):
            assert out[key].shape == native[key].shape
            assert relative(out[key], native[key]) < TOL, key
    assert bridged.stats.programs == 1 and bridged.stats.calls == 2
    with pytest.raises(Exception, match="not a loaded CLIP vision model"):
        pack.NODE_CLASS_MAPPINGS["TPUCLIPVision"]().apply("clip_vision_h.safetensors")


def _later_chunks_untraceable(decoder):
    """The decoder of a Wan VAE changed so that only its calls after the first chunk cannot be compiled (a Python
    branch on a computed value once the caches hold frames); natively it computes what it did."""
    base = type(decoder)

    class LaterChunksBranch(base):
        def forward(self, x, feat_cache=None, feat_idx=[0], **kwargs):  # noqa: B006 - ComfyUI's own signature
            if feat_cache is not None and any(v is not None for v in feat_cache) and float(x.abs().max()) < 0:
                x = -x  # never taken: the branch is what a trace cannot do
            return base.forward(self, x, feat_cache=feat_cache, feat_idx=feat_idx, **kwargs)

    decoder.__class__ = LaterChunksBranch


def test_a_vae_found_untraceable_midway_decodes_again_on_the_host(pack, auto, caplog):
    """A causal VAE whose decoder traces on the first chunk and fails on the second (its caches already on the
    devices): the automatic mode decodes the whole video again on the host, equal to the native run, and the next
    decode runs on the host from its start; the encoder stays on the runtime."""
    import nodes
    from tpu_runtime.bridge.tiny import tiny_vae

    vae = tiny_vae("wan2.1", seed=5)
    _later_chunks_untraceable(vae.first_stage_model.decoder)
    g = torch.Generator().manual_seed(3)
    samples = torch.randn(1, 16, 3, 4, 4, generator=g)
    pixels = torch.rand(5, 32, 32, 3, generator=g)
    with torch.inference_mode():
        native = nodes.VAEDecode().decode(vae, {"samples": samples})[0]
        native_latents = nodes.VAEEncode().encode(vae, pixels)[0]["samples"]
        on_runtime = auto.on_runtime("vae", vae, "VAELoader")
        with caplog.at_level(logging.WARNING, logger="tpu_runtime.bridge.auto"):
            out = nodes.VAEDecode().decode(on_runtime, {"samples": samples})[0]
            again = nodes.VAEDecode().decode(on_runtime, {"samples": samples})[0]
        latents = nodes.VAEEncode().encode(on_runtime, pixels)[0]["samples"]
    assert relative(out, native) < TOL and relative(again, native) < TOL
    messages = [r.getMessage() for r in caplog.records]
    assert sum("WanVAE.decoder runs on the host" in m for m in messages) == 1, messages
    assert sum("WanVAE.decode starts again on the host" in m for m in messages) == 1, messages
    assert relative(latents, native_latents) < TOL
    encoder = on_runtime.patcher.object_patches["encoder.forward"]
    assert encoder.bridged.stats.calls > 0 and encoder.bridged.stats.programs > 0


class _HalfWay(torch.nn.Module):
    """A model that changes its own state while it runs, then (traced) fails half way on a Python branch on a
    computed value; on the host it runs to the end."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.table = [1, 2]
        self.memo = {"kept": 1}
        self.cache = None

    def forward(self, x):
        self.cache = x  # a computed value kept on the module
        self.table.append(x)  # items put into a list and a dict it holds
        self.memo["x"] = x
        self.table = [x]  # a new list in place of the one the caller may hold
        self.linear.seen = x  # an attribute added to a submodule
        y = self.linear(x)
        if float(y.sum()) > -1e9:  # data-dependent: where a trace stops
            y = y * 2
        return y


def test_a_failed_trace_leaves_the_model_as_it_was(pack):
    """Whatever the model's code did to its modules before the trace failed is undone: every attribute holds the
    object it held (added ones are gone), lists and dicts hold their items, no traced value is left; the model then
    runs on the host as a fresh copy does. A successful trace leaves no traced value either."""
    from tpu_runtime.bridge.program import BridgedModule, UntraceableModel
    from tpu_runtime.bridge.rules import ArchRules

    torch.manual_seed(0)
    model = _HalfWay()
    table, memo = model.table, model.memo
    before = {id(m): dict(vars(m)) for m in model.modules()}
    bridged = BridgedModule(module=model, method=_HalfWay.forward, rules=ArchRules(name="toy"), options_arg=None)
    x = torch.randn(2, 4)
    with pytest.raises(UntraceableModel, match="data-dependent Python control flow"):
        bridged(x)
    for m in model.modules():
        assert dict(vars(m)) == before[id(m)], type(m).__name__
    assert model.table is table and table == [1, 2] and model.memo is memo and memo == {"kept": 1}
    assert model.cache is None and not hasattr(model.linear, "seen")
    fresh = _HalfWay()
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(model(x), fresh(x))

    class Remembers(torch.nn.Module):  # traceable, and keeps what it computed
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)
            self.last = None

        def forward(self, x):
            self.last = self.linear(x)
            return self.last * 2

    model = Remembers()
    bridged = BridgedModule(module=model, method=Remembers.forward, rules=ArchRules(name="toy"), options_arg=None)
    out = bridged(x)
    assert model.last is None and torch.allclose(out, model(x), atol=1e-6)
