"""A family is a package and one registry entry: a minimal extra family declared in the tests folder only
(``toy_family``: its own recognition rule, modules and stage programs) is picked up by ``generate``, ``plan`` (with
``--layers``), the ComfyUI node registration and the multi-host codec, with no edit outside its own files."""

import importlib.util
import sys
from collections import OrderedDict

import pytest
import torch
from conftest import ROOT

from tpu_runtime.engine.runtime import compile_stats
from tpu_runtime.errors import InputError
from tpu_runtime.families import registry
from tpu_runtime.tools import stage_files
from tpu_runtime.tools.generate import GenerateRequest, generate


@pytest.fixture
def toy():
    from toy_family import SPEC

    registry.register(SPEC)
    yield SPEC
    registry.unregister(SPEC.name)


@pytest.fixture
def toy_model(tmp_path):
    from toy_family.model import build_tiny_toy

    return build_tiny_toy(tmp_path / "toy_model")


def _generate(folder, out, **kw):
    settings = dict(prompt="a cat walks on the grass", steps=3, seed=1, dtype="float32")
    settings.update(kw)
    return generate(GenerateRequest(model=str(folder), output_dir=str(out), **settings))


def test_generate_opens_the_toy_by_its_folder_and_runs_every_stage(toy, toy_model, tmp_path):
    config = _generate(toy_model, tmp_path / "a")
    assert config["family"] == "toy" and (config["height"], config["width"], config["frames"]) == (16, 16, 5)
    frames = stage_files.load_frames(tmp_path / "a")
    assert frames.shape == (5, 16, 16, 3) and float(frames.std()) > 0.01
    before = compile_stats()
    _generate(toy_model, tmp_path / "b", seed=2, prompt="a red car")
    other = stage_files.load_frames(tmp_path / "b")
    assert not torch.equal(other, frames)  # the seed and prompt reached the stages
    # The program table serves a new seed and prompt in the same process: nothing compiles.
    assert compile_stats().since(before).xla_compiles == 0


def test_without_its_registry_entry_the_toy_is_refused(toy_model, tmp_path):
    with pytest.raises(InputError, match="holds a ToyVideoPipeline model: this pack runs CogVideoX, Wan"):
        _generate(toy_model, tmp_path / "out")


def test_plan_compiles_the_toy_for_a_tpu_slice_at_reduced_depth(toy):
    from tpu_runtime.tools.plan import ModelSource, plan

    assert "toy-1" in registry.known_models()
    reports = {layers: plan(ModelSource("toy-1"), "v6e-8", mesh="dp=1,sp=1,tp=8", steps=4, layers=layers)
               for layers in (1, 3)}
    for report in reports.values():
        assert report.fits and set(report.stages) == {"encode", "sample", "decode"}
        assert all(s.compiled for s in report.stages.values())
    # Each layer is a 1024x1024 matrix and its bias, split 8 ways by the toy's rule table (bfloat16, plan's dtype).
    per_layer = (1024 * 1024 + 1024) * 2 // 8
    grown = reports[3].stages["sample"].weights_bytes_per_chip - reports[1].stages["sample"].weights_bytes_per_chip
    assert grown == 2 * per_layer


def test_the_nodes_come_from_the_toy_declaration(toy, toy_model):
    name = "tpu_video_nodes_with_toy"
    spec = importlib.util.spec_from_file_location(name, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
    pack = importlib.util.module_from_spec(spec)
    sys.modules[name] = pack
    spec.loader.exec_module(pack)
    m = pack.NODE_CLASS_MAPPINGS
    toy_nodes = sorted(k for k in m if k.startswith("TPUToy"))
    assert toy_nodes == sorted(f"TPUToy{kind}" for kind in ("Loader", "TextEncode", "ImageEncode", "LoRA",
                                                            "Sampler", "Decode"))
    assert pack.NODE_DISPLAY_NAME_MAPPINGS["TPUToySampler"] == "Toy Sampler (TPU)"
    assert m["TPUToyLoader"].RETURN_TYPES == ("TPU_TOY_MODEL",) and m["TPUToyLoader"].CATEGORY == "TPU video/Toy"
    (model,) = m["TPUToyLoader"]().load("", "float32", model_path=str(toy_model))
    (embeds,) = m["TPUToyTextEncode"]().encode(model, "a cat walks on the grass", "")
    (latent,) = m["TPUToySampler"]().sample(model, embeds, width=16, height=16, frames=5, steps=3, guidance=1.0,
                                            seed=1, scheduler="model default")
    (image,) = m["TPUToyDecode"]().decode(model, latent)
    assert image.shape == (5, 16, 16, 3)


def test_the_multihost_codec_and_worker_know_the_toy(toy, toy_model):
    from toy_family.model import ToyFamily, ToyOptions

    from tpu_runtime.multihost.codec import Encoder, decode

    message = Encoder(OrderedDict(), {})({"path": toy_model, "options": ToyOptions(noise_scale=0.5)})
    assert decode(message, None) == {"path": toy_model, "options": ToyOptions(noise_scale=0.5)}
    assert registry.family_class_named("ToyFamily") is ToyFamily
    family = registry.open_model(str(toy_model), dtype="float32", options=ToyOptions(noise_scale=0.5))
    assert isinstance(family, ToyFamily) and family.options.noise_scale == 0.5
