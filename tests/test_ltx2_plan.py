"""``plan`` on the released LTX-2.3 (``ltx2.3-22b``): its config-only architecture opens as the family's 2.3, is
the release's size, and its sampler step compiles for a real TPU slice with 2.3's guidance passes."""

from __future__ import annotations

import inspect
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest

MESH = "dp=2,sp=1,tp=4"


def _classes() -> dict:
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE

    return {c.__name__: c for c in (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel,
                                    LTX2TextConnectors, LTX2LatentUpsamplerModel, LTX2Vocoder, LTX2VocoderWithBWE)}


def _abstract(model: str, mesh: str = MESH, **options):
    from tpu_runtime.tools.plan import ModelSource, open_abstract, parse_topology

    topo = parse_topology("v6e-8")
    return open_abstract(ModelSource(model), topo.devices(), Path(tempfile.mkdtemp()), mesh=mesh, **options)


def _parameters(family, component: str) -> int:
    """Parameters of ``component`` counted from its abstract weights (shape structs; a tied one once)."""
    family._component(component)
    return sum(int(np.prod(s.shape)) for s in {id(s): s for s in family._states[component].values()}.values())


@pytest.mark.parametrize("model", ["ltx2.3-22b", "ltx2-19b"])
def test_the_ltx2_architectures_build_the_diffusers_classes_with_no_unknown_key(model):
    """Every component config of the architecture names a keyword of its diffusers class's ``__init__`` (nothing
    ``from_config`` would drop with a warning) and builds that class (on ``meta``: no memory); the model index
    names the classes the family loads (2.3: the band-extending vocoder)."""
    import torch

    from tpu_runtime.families.ltx2.architectures import ARCHITECTURES

    entry = ARCHITECTURES[model]
    classes = _classes()
    index = entry["model_index.json"]
    for component in ("transformer", "connectors", "vae", "audio_vae", "vocoder", "latent_upsampler"):
        config = dict(entry[f"{component}/config.json"])
        cls = classes[config.pop("_class_name")]
        if component in index:
            assert index[component][1] == cls.__name__
        keywords = set(inspect.signature(cls.__init__).parameters) - {"self"}
        assert set(config) <= keywords, f"{component}: {sorted(set(config) - keywords)} unknown to {cls.__name__}"
        if component == "transformer":
            config["num_layers"] = 1  # the block is what is checked; 48 of them only take longer
        with torch.device("meta"):
            cls(**config)
    assert index["vocoder"][1] == ("LTX2VocoderWithBWE" if model == "ltx2.3-22b" else "LTX2Vocoder")
    for component in ("transformer", "connectors"):  # the releases' RoPE, where the classes default otherwise
        assert entry[f"{component}/config.json"]["rope_type"] == "split"
        assert entry[f"{component}/config.json"]["rope_double_precision"] is True


def test_ltx2_3_is_the_22b_release_with_three_guidance_passes():
    """Opened abstractly, ``ltx2.3-22b`` is the family's 2.3 and the release's size: its transformer (48 blocks of
    video, 32x128 channels, and sound, 32x64, with 2.3's attention gates and prompt modulation) has 18.99B
    parameters, 0.11B more than 2.0's 18.88B; the connectors, eight blocks a modality as wide as the transformer's
    streams plus one text projection each from Gemma's 49x3840 stacked states, 3.17B (2.0's: 1.43B). The 22B of the
    release's name is the two together, 22.16B (as the original checkpoint holds them): asserted within 22.0-22.3B
    and the transformer alone within 18.9-19.1B, a range the release's names allow and a wrong width, depth or
    feature flag would leave. By default a 2.3 step runs three transformer passes: the CFG batch, STG (self-
    attention perturbed in block 28) and modality isolation; 2.0's has no perturbed attention, so no STG pass."""
    from tpu_runtime.engine.stages import SampleSettings

    family = _abstract("ltx2.3-22b")
    assert family.generation == "2.3"
    transformer, connectors = _parameters(family, "transformer"), _parameters(family, "connectors")
    assert 18.9e9 < transformer < 19.1e9, transformer
    assert 3.1e9 < connectors < 3.2e9, connectors
    assert 22.0e9 < transformer + connectors < 22.3e9, transformer + connectors
    settings = SampleSettings(512, 768, 121, guidance=family.DEFAULT_GUIDANCE)
    passes, _ = family.guidance(settings)
    assert (passes.cfg, passes.stg_blocks, passes.modality, passes.count) == (True, (28,), True, 3)
    passes_20, _ = _abstract("ltx2-19b").guidance(settings)
    assert (passes_20.cfg, passes_20.stg_blocks, passes_20.modality, passes_20.count) == (True, (), True, 2)


def test_plan_compiles_the_ltx2_3_step_for_v6e8_with_its_stg_pass():
    """LTX-2.3 (one of its 48 blocks, a small video) for v6e-8: the step with the default guidance is one program
    of three transformer calls. Splash kernels a block: six in the CFG call (video and sound self-attention, their
    text attention, both cross-modal ones), four in the STG call (the perturbed block's two self-attentions are
    skipped: diffusers takes the value projection for the attention's output when every batch element is
    perturbed), four in the isolated call (the cross-modal ones off): 14, where 2.0's step has 6 + 4 = 10. The STG
    pass perturbs block 0 here (the default block, 28, is past a one-block transformer, which would drop the pass).
    Megatron tensor parallelism gathers no weight, and the weights the compiler is given equal the shapes split
    over the mesh."""
    from tpu_runtime.engine.stages import SampleSettings
    from tpu_runtime.tools.plan import compile_program, parse_topology

    layers = 1
    family = _abstract("ltx2.3-22b", layers=layers)
    settings = SampleSettings(128, 192, 9, guidance=family.DEFAULT_GUIDANCE, stg_blocks=(0,))
    passes, _ = family.guidance(settings)
    assert passes.count == 3 and passes.stg_blocks == (0,)
    (program,) = [p for p in family.plan_programs(settings) if p.stage == "sample"]
    sample = compile_program(program, parse_topology("v6e-8"))
    assert sample.compiled, sample.error
    assert sample.mosaic_kernels == (6 + 4 + 4) * layers
    assert sample.all_reduces >= 3 * layers and sample.all_gathers == 0
    mesh = dict(family.mesh.shape)
    expected = 0
    for struct in {id(s): s for s in family._states["transformer"].values()}.values():
        spec = struct.sharding.spec
        split = int(np.prod([mesh[a] for a in spec if a is not None])) if spec else 1
        expected += int(np.prod(struct.shape)) * struct.dtype.itemsize // split
    assert sample.weights_bytes_per_chip == expected


def test_plan_takes_the_distilled_release_as_one_pass_a_step():
    """``ltx2-19b-distilled`` is planned as Lightricks' distilled recipe runs it: the dev transformer's shapes, one
    transformer pass a step (positive prompt only: batch 1, so no CFG half of the mesh; six splash kernels a block
    where the dev step's two passes have ten), diffusers' eight distilled sigmas; the report says so. A step count
    given to plan replaces the release's and is checked like any other (the distilled sigmas are eight)."""
    from diffusers.pipelines.ltx2.utils import DISTILLED_SIGMA_VALUES

    from tpu_runtime.errors import InputError
    from tpu_runtime.tools.plan import ModelSource, format_report, plan

    size = dict(height=128, width=192, frames=9, layers=1, stages=("sample",), max_candidates=1)
    report = plan(ModelSource("ltx2-19b-distilled"), "v6e-8", **size)
    assert report.sampling == {"guidance": 1.0, "audio_guidance": 1.0, "stg_scale": 0.0, "modality_scale": 1.0,
                               "sigmas": "distilled", "steps": len(DISTILLED_SIGMA_VALUES)}
    assert not report.cfg and report.mesh == "dp=1,sp=1,tp=8", (report.cfg, report.mesh)
    sample = report.stages["sample"]
    assert sample.compiled and sample.mosaic_kernels == 6, sample
    assert "sampling (the release's settings; --guidance, --steps replace them): guidance 1, audio_guidance 1, stg_scale 0" in format_report(report)
    with pytest.raises(InputError, match="8 steps"):
        plan(ModelSource("ltx2-19b-distilled"), "v6e-8", steps=4, **size)


def test_a_larger_slice_for_the_distilled_step_keeps_its_batch_of_one_whole():
    """Without CFG there is no batch of two to put on dp: the larger slice plan suggests for the distilled 19B on
    v5e-8 (its step as compiled at full size, 6.83 GiB of temporaries beside 14.49 GiB resident) is all tensor
    parallel, a mesh the model accepts for one pass; it used to be dp=2, which that model refuses."""
    from tpu_runtime.engine.sharding import parse_mesh, validate_mesh
    from tpu_runtime.tools.plan import (GIB, MeshReport, ModelSource, StageReport, open_abstract, parse_topology,
                                        suggestions)
    from tpu_runtime.tools.plan_compile import shard_bytes

    topo = parse_topology("v5e-8")
    source = ModelSource("ltx2-19b-distilled")
    family = open_abstract(source, topo.devices(), Path(tempfile.mkdtemp()), mesh="dp=1,sp=1,tp=8")
    names = ("text_encoder", "connectors", "transformer", "vae", "audio_vae", "vocoder")
    for name in names:
        family._component(name)
    resident = sum(shard_bytes(family._states[n]) for n in names)
    step_weights, temp = shard_bytes(family._states["transformer"]), int(6.83 * GIB)
    report = MeshReport("dp=1,sp=1,tp=8", False, resident, resident + temp, {
        "sample": StageReport(compiled=True, weights_bytes_per_chip=step_weights,
                              total_bytes_per_chip=step_weights + temp)})
    (advice,) = [a for a in suggestions(source, family, report, topo, None, ("sample",), cfg=False)
                 if a.startswith("a larger slice")]
    name, mesh = re.search(r"a larger slice: (\S+) with mesh (\S+),", advice).groups()
    spec = parse_mesh(mesh)
    assert spec.dp == 1, advice
    validate_mesh(spec, parse_topology(name).device_count, family.heads, batch=1)
    with_cfg = [a for a in suggestions(source, family, report, topo, None, ("sample",), cfg=True)
                if a.startswith("a larger slice")]
    assert with_cfg and "mesh dp=2," in with_cfg[0], with_cfg  # the CFG batch's halves on dp, as before


def test_a_slice_too_small_is_answered_in_seconds_with_every_stage():
    """``plan --model ltx2.3-22b --topology v5e-4`` (every stage, the default): the resident weights alone exceed a
    v5e chip (18.1 GiB on tp=4), so no stage is compiled and the answer comes in seconds. Each skipped stage still
    reports the weights it takes: the sound's decode takes two components' (audio VAE and vocoder, one nested
    state), which used to end the plan with a traceback instead of the answer."""
    from tpu_runtime.tools.plan import ModelSource, format_report, open_abstract, parse_topology, plan
    from tpu_runtime.tools.plan_compile import shard_bytes

    report = plan(ModelSource("ltx2.3-22b"), "v5e-4", mesh="dp=1,sp=1,tp=4")
    assert not report.fits and "alone need 18.1 GiB" in report.why, report.why
    assert set(report.stages) == {"encode", "sample", "decode", "decode_audio"}
    assert all(s.skipped and not s.compiled for s in report.stages.values())
    family = open_abstract(ModelSource("ltx2.3-22b"), parse_topology("v5e-4").devices(), Path(tempfile.mkdtemp()),
                           mesh="dp=1,sp=1,tp=4")
    for name in ("audio_vae", "vocoder"):
        family._component(name)
    expected = shard_bytes(family._states["audio_vae"]) + shard_bytes(family._states["vocoder"])
    assert report.stages["decode_audio"].weights_bytes_per_chip == expected > 0
    assert report.seconds < 60 and "were not compiled" in format_report(report)


@pytest.mark.parametrize("model, heads", [("ltx2.3-22b", 32), ("ltx2-19b", 30)])
def test_the_text_encode_is_split_over_the_chips(model, heads):
    """The encode stage's weights per chip on v6e-8 (tp=8): Gemma 3 12B, its token embedding included, and the
    text connectors each an eighth of their size (2.3: 10.29 GiB a chip before, 5.9 of it the connectors held
    whole; now 3.48), whether tp divides the connectors' heads (2.3's 32) or not (2.0's 30: their attention split
    by input); and ``plan`` prints every stage's weights per chip."""
    from tpu_runtime.engine.stages import SampleSettings
    from tpu_runtime.tools.plan import GIB, PlanReport, format_report, stage_weights

    family = _abstract(model, mesh="dp=1,sp=1,tp=8")
    assert int(family.configs["connectors"]["video_connector_num_attention_heads"]) == heads
    programs = family.plan_programs(SampleSettings(512, 768, 121, guidance=family.DEFAULT_GUIDANCE))
    weights = stage_weights(family, programs)
    for component in ("text_encoder", "connectors"):
        whole = sum(int(np.prod(s.shape)) * s.dtype.itemsize
                    for s in {id(s): s for s in family._states[component].values()}.values())
        assert weights["encode"][component] < whole / 8 * 1.01, (component, weights["encode"][component], whole)
    assert sum(weights["encode"].values()) < 3.5 * GIB, weights["encode"]
    report = PlanReport(model=model, topology="v6e-8", chips=8, hosts=2, chip_hbm_bytes=32 * GIB, height=512,
                        width=768, frames=121, cfg=True, dtype="bfloat16", attention="splash", fsdp=False,
                        vae_sharding="width", layers=None, mesh="dp=1,sp=1,tp=8", fits=True, peak_bytes_per_chip=0,
                        stages={}, stage_weights=weights)
    encode = weights["encode"]
    line = (f"encode {sum(encode.values()) / GIB:.2f} (text_encoder {encode['text_encoder'] / GIB:.2f}, "
            f"connectors {encode['connectors'] / GIB:.2f}); sample {weights['sample']['transformer'] / GIB:.2f}")
    assert line in format_report(report), format_report(report)
