"""A family is a package and one registry entry: a minimal extra family declared in the tests folder only
(``toy_family``: its own recognition rule, modules and stage programs) is picked up by ``generate``, ``plan`` (with
``--layers``), the ComfyUI node registration and the multi-host codec, with no edit outside its own files."""

import importlib.util
import json
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
    assert compile_stats().since(before).backend_compiles == 0


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
    (latent,) = m["TPUToySampler"]().sample(model, embeds, width=16, height=16, length=5, steps=3, cfg=1.0,
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


def test_the_toy_option_and_stage_reach_every_place_from_its_declaration(toy, toy_model, tmp_path):
    """The toy declares a sampler option (``toy_noise``), a stage (``sharpen``) and a recipe that runs it
    (``toy_sharpened``) in its spec alone: the command line has their options, with the declared help and default;
    the sampler node has the option's input; ``plan`` compiles the stage and plans with the option's default; a
    multi-host slice replays the stage; and no module outside the toy's files names any of them."""
    from toy_family.model import ToyFamily

    from tpu_runtime.engine.stages import SampleSettings
    from tpu_runtime.multihost.codec import Encoder, decode
    from tpu_runtime.tools.cli import build_parser
    from tpu_runtime.tools.plan import ModelSource, open_abstract, parse_topology, plan, planned_settings

    # the command line: the option and the recipe, with the declaration's words
    generate_parser = build_parser()._subparsers._group_actions[0].choices["generate"]
    helps = {o: a.help for a in generate_parser._actions for o in a.option_strings}
    assert helps["--toy-noise"] == "how much of the seeded noise the toy starts from (default: 1)"
    assert helps["--toy-sharpened"] == "the toy's recipe: sample, then sharpen the latents"
    args = ["generate", "--model", str(toy_model), "--prompt", "a cat", "--dtype", "float32"]
    from tpu_runtime.tools.cli import main

    assert main(args + ["--output-dir", str(tmp_path / "plain")]) == 0
    assert main(args + ["--toy-noise", "0.5", "--toy-sharpened", "--output-dir", str(tmp_path / "sharp")]) == 0
    plain, sharp = (stage_files.load_latents(tmp_path / n).latents for n in ("plain", "sharp"))
    config = json.loads((tmp_path / "sharp" / "generation_config.json").read_text())
    assert config["toy_noise"] == 0.5 and config["toy_sharpened"]["stages"] == ["sample", "sharpen"]
    assert config["steps"] == 3  # the toy's own default steps
    assert not torch.allclose(plain, sharp)
    assert main(args + ["--toy-noise", "0", "--output-dir", str(tmp_path / "zero")]) == 2  # the declared rule

    # the node: the option's input, its default and range from the declaration
    from nodes.kinds import family_nodes

    sampler = family_nodes(toy)[0]["TPUToySampler"]
    kind, options = sampler.INPUT_TYPES()["required"]["toy_noise"]
    assert (kind, options["default"], options["max"]) == ("FLOAT", 1.0, 4.0)
    assert options["tooltip"].startswith("how much of the seeded noise")

    # plan: the stage compiled, the option at its default
    report = plan(ModelSource("toy-1"), "v6e-8", mesh="dp=1,sp=1,tp=8", layers=1, stages=("sample", "sharpen"))
    assert set(report.stages) == {"sample", "sharpen"} and report.stages["sharpen"].compiled
    with pytest.raises(InputError, match="stages"):
        plan(ModelSource("toy-1"), "v6e-8", mesh="dp=1,sp=1,tp=8", layers=1, stages=("upsample",))
    devices = parse_topology("v6e-8").devices()
    abstract = open_abstract(ModelSource("toy-1"), devices, tmp_path, mesh="dp=1,sp=1,tp=8", layers=1)
    assert abstract.option(planned_settings(abstract, ModelSource("toy-1")), "toy_noise") == 1.0

    # a multi-host slice: the stage replayed like every family's, the option carried by value
    assert "sharpen" in ToyFamily.stage_calls() and ToyFamily.sharpen.replayed
    settings = SampleSettings(16, 16, 5, toy_noise=0.5)
    assert decode(Encoder(OrderedDict(), {})(settings), None) == settings and settings.toy_noise == 0.5

    # no shared module had to name them
    for folder in ("tpu_runtime", "nodes"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            assert not any(word in text for word in ("toy_noise", "sharpen", "toy_sharpened")), path
