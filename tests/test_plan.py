"""`plan`: the real stage programs compiled for TPU slices this machine does not have (the TPU compiler that
jax[tpu] installs, abstract devices of a topology), with the numbers users decide on: per-chip memory,
collectives, Mosaic kernels, and whether it fits.

The TPU path under test without a TPU: reduced-depth, full-width CogVideoX and Wan step programs and a
full-width VAE decode compiled for v6e-8, checked for Mosaic kernels (splash really lowered for TPU, not
interpret mode or the reference path), the expected collectives, no weight all-gathers without FSDP, and
per-chip memory within a band computed from the parameter shapes and the mesh.
"""

import json
import re

import numpy as np
import pytest
import torch

from tpu_runtime.errors import InputError
from tpu_runtime.tools.plan import GIB, ModelSource, format_report, parse_topology, plan

V6E_8 = "v6e-8"


# --- topologies ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, kind, chips, layout, hosts", [
    ("v6e-8", "v6e", 8, (2, 4), 1), ("v6e-4", "v6e", 4, (2, 2), 1), ("v5e-8", "v5e", 8, (2, 4), 1),
    ("v5p-8", "v5p", 4, (2, 2, 1), 1), ("v6e-1", "v6e", 1, (1, 1), 1), ("v6e-16", "v6e", 16, (4, 4), 4),
    ("v5litepod-4", "v5e", 4, (2, 2), 1), ("v6e:2x4", "v6e", 8, (2, 4), 1),
])
def test_slice_names_as_users_write_them(name, kind, chips, layout, hosts):
    t = parse_topology(name)
    assert (t.kind, t.chips, t.layout, t.hosts) == (kind, chips, layout, hosts)
    devices = t.devices()
    assert len(devices) == chips and devices[0].platform == "tpu"
    assert len({d.process_index for d in devices}) == hosts


def test_chip_memory_per_kind():
    assert parse_topology("v5e-8").hbm_bytes == 16 * GIB
    assert parse_topology("v6e-8").hbm_bytes == 32 * GIB
    assert parse_topology("v5p-8").hbm_bytes == 95 * GIB


@pytest.mark.parametrize("bad", ["v6e-7", "h100-8", "v5p-3", ""])
def test_unknown_slice_is_refused_with_examples(bad):
    with pytest.raises(InputError, match="v6e-8"):
        parse_topology(bad)


# --- the abstract model is the runtime's model -------------------------------------------------------------------
@pytest.mark.parametrize("family_name, generation", [("cogvideox", "5b"), ("wan", "2.2-A14B"), ("wan", "2.1")])
def test_abstract_weights_have_the_loaded_shapes_and_dtypes(tiny_models, tiny_wan, runtime, family_name,
                                                            generation):
    """What plan compiles against (built on meta, never read) has exactly the names, shapes and dtypes the
    runtime places when it loads the weights, fp32-kept modules included."""
    from tpu_runtime.families.cogvideox.model import CogVideoXFamily
    from tpu_runtime.families.wan.model import WanFamily

    cls, folder = (CogVideoXFamily, tiny_models[generation]) if family_name == "cogvideox" \
        else (WanFamily, tiny_wan[generation])
    loaded = cls(folder, dtype="bfloat16", runtime=runtime)
    abstract = cls(folder, dtype="bfloat16", runtime=runtime, target_devices=parse_topology(V6E_8).devices())
    assert abstract.abstract and not loaded.abstract
    names = ["text_encoder", "transformer", "vae"] + (["transformer_2"] if generation == "2.2-A14B" else [])
    for name in names:
        loaded._component(name)
        abstract._component(name)
        real = {k: (tuple(v.shape), str(v.dtype)) for k, v in loaded._states[name].items()}
        planned = {k: (tuple(v.shape), str(v.dtype)) for k, v in abstract._states[name].items()}
        assert planned == real, name
    loaded.release()


def test_a_tpu_mesh_gets_splash_and_bfloat16(tiny_wan, runtime):
    """The family follows the mesh's platform, not this process's CPU backend."""
    from tpu_runtime.families.wan.model import WanFamily

    family = WanFamily(tiny_wan["2.1"], runtime=runtime, target_devices=parse_topology(V6E_8).devices())
    assert family.attention.impl == "splash" and family.dtype_name == "bfloat16"
    assert str(family.mesh_spec) == "dp=2,sp=2,tp=2"  # 2 heads in the tiny model: tp=2, the rest on sp
    with pytest.raises(RuntimeError, match="plan"):
        family.encode("a cat")


# --- the TPU path, compiled for v6e-8 ----------------------------------------------------------------------------
def _param_bytes_per_chip(family, name: str) -> int:
    """Bytes per chip of a component from its parameter shapes and the mesh: split tensors divided by the sizes
    of the axes their spec names, the rest whole."""
    mesh = dict(family.mesh.shape)
    total = 0
    for struct in {id(s): s for s in family._states[name].values()}.values():
        spec = struct.sharding.spec
        split = int(np.prod([mesh[a] for a in spec if a is not None], dtype=np.int64)) if spec else 1
        total += int(np.prod(struct.shape, dtype=np.int64)) * struct.dtype.itemsize // split
    return total


@pytest.mark.parametrize("model, layers, size, kernels_per_layer", [
    ("cogvideox-5b", 2, (480, 720, 49), 1),  # joint text+video attention: one splash call per block
    ("wan2.1-t2v-14b", 1, (480, 832, 81), 2),  # self-attention and cross-attention per block
], ids=["cogvideox-5b", "wan2.1-14b"])
def test_step_program_compiles_for_v6e8_with_splash_and_tensor_parallel_collectives(model, layers, size,
                                                                                     kernels_per_layer):
    height, width, frames = size
    report = plan(ModelSource(model), V6E_8, height=height, width=width, frames=frames, mesh="dp=2,sp=1,tp=4",
                  stages=("sample",), layers=layers)
    sample = report.stages["sample"]
    assert sample.compiled, sample.error
    # Splash lowered as TPU (Mosaic) kernels: interpret mode or the reference path would have none.
    assert sample.mosaic_kernels == kernels_per_layer * layers
    # Megatron tensor parallelism: an all-reduce after attention and after the feed-forward of every block; the
    # weights are already where they are used, so nothing is gathered.
    assert sample.all_reduces >= 2 * layers
    assert sample.all_gathers == 0
    # Per-chip memory: the weights the compiler counts equal the band computed from shapes and the mesh.
    from tpu_runtime.tools.plan import open_abstract

    family = open_abstract(ModelSource(model), parse_topology(V6E_8).devices(), _tmp(), mesh="dp=2,sp=1,tp=4",
                           layers=layers)
    family._component("transformer")
    expected = _param_bytes_per_chip(family, "transformer")
    assert sample.weights_bytes_per_chip == expected
    assert expected <= sample.argument_bytes_per_chip <= expected * 1.25 + 64 * 2 ** 20
    assert 0 < sample.temp_bytes_per_chip < parse_topology(V6E_8).hbm_bytes
    assert report.fits


def _tmp():
    import tempfile
    from pathlib import Path

    return Path(tempfile.mkdtemp())


def test_a_collective_cut_into_pieces_counts_once():
    """The TPU compiler for v5e cuts a large all-gather into a chain of pieces sharing one channel id (lines as it
    wrote them for CogVideoX-2b's step on v5e-8, shortened); v6e keeps it whole. Both count one all-gather."""
    from tpu_runtime.tools.plan import count_ops

    piece = ("  %all-gather.{n} = bf16[1,15,17776,64]{{3,2,1,0}} all-gather(%param_0.{n}), channel_id=13, "
             "replica_groups=[4,2]<=[2,2,2]T(0,2,1), dimensions={{2}}, frontend_attributes={{chain_id=\"0\"}}")
    v5e = "\n".join([piece.format(n=n) for n in (16, 18, 20, 22)] + [
        "  %all-gather.23 = bf16[1,17776,15,64]{3,1,2,0} all-gather(%copy-done.6), channel_id=14, dimensions={1}",
        "  %all-reduce-start.1 = bf16[2,64] all-reduce-start(%fusion.9), channel_id=15, to_apply=%add",
        "  %all-reduce-done.1 = bf16[2,64] all-reduce-done(%all-reduce-start.1)",
        "  %all-reduce.2 = f32[8] all-reduce(%x), channel_id=16, to_apply=%add",
        '  %custom-call.3 = bf16[1] custom-call(%y), custom_call_target="tpu_custom_call"',
    ])
    v6e = "\n".join([piece.format(n=16)] + v5e.splitlines()[4:])
    for hlo in (v5e, v6e):
        counts = count_ops(hlo)
        assert (counts["all_gathers"], counts["all_reduces"], counts["mosaic_kernels"]) == (2, 2, 1), counts


def test_fsdp_gathers_weights_before_use():
    """The collectives check above can fail: with FSDP the weights are split over dp and gathered (a short
    video: the gathers do not depend on its length)."""
    report = plan(ModelSource("cogvideox-5b"), V6E_8, height=240, width=352, frames=9, mesh="dp=2,sp=1,tp=4",
                  fsdp=True, stages=("sample",), layers=1)
    assert report.stages["sample"].compiled and report.stages["sample"].all_gathers > 0


def test_fsdp_candidates_all_have_dp():
    """FSDP splits over dp, and a mesh without dp is refused with fsdp: plan tries only meshes with dp then."""
    from tpu_runtime.tools.plan import candidate_meshes
    from tpu_runtime.engine.sharding import MeshSpec

    assert any(m.dp == 1 for m in candidate_meshes(8, 40, True))
    fsdp = candidate_meshes(8, 40, True, fsdp=True)
    assert fsdp[0] == MeshSpec(2, 1, 4) and len(fsdp) > 1 and all(m.dp == 2 for m in fsdp), fsdp


def test_fsdp_splits_every_transformer_matrix_over_every_chip():
    """FSDP adds dp to each matrix on a dimension tp leaves whole, keeping tp's split: Wan 14B's transformer on
    v6e-4 (dp=2, tp=2) then holds about a quarter of its bytes per chip, not half."""
    from tpu_runtime.tools.plan import open_abstract

    devices = parse_topology("v6e-4").devices()
    plain = open_abstract(ModelSource("wan2.1-t2v-14b"), devices, _tmp(), mesh="dp=2,sp=1,tp=2")
    fsdp = open_abstract(ModelSource("wan2.1-t2v-14b"), devices, _tmp(), mesh="dp=2,sp=1,tp=2", fsdp=True)
    plain._component("transformer")
    fsdp._component("transformer")
    matrices = 0
    for name, struct in fsdp._states["transformer"].items():
        spec = tuple(struct.sharding.spec) + (None,) * (len(struct.shape) - len(struct.sharding.spec))
        tp_only = tuple(plain._states["transformer"][name].sharding.spec)
        assert tuple(a if a != "dp" else None for a in spec)[:len(tp_only)] == tp_only, name  # tp's split kept
        if len(struct.shape) >= 2 and max(struct.shape) > 1:
            matrices += 1
            assert "dp" in spec, (name, struct.shape, spec)
    assert matrices > 400  # 40 blocks of attention and feed-forward matrices
    total = sum(int(np.prod(s.shape, dtype=np.int64)) * s.dtype.itemsize
                for s in fsdp._states["transformer"].values())
    per_chip = _param_bytes_per_chip(fsdp, "transformer")
    # The blocks' matrices are split 4 ways; the embedders outside them (about 2% of the bytes, no tp rule) 2 ways.
    assert total / 4 <= per_chip < total / 4 * 1.03
    assert _param_bytes_per_chip(plain, "transformer") > total / 2 * 0.97
    # The VAE is left whole: FSDP's saving there would be a fraction of 0.25 GiB, and its weights split over dp
    # with the frames split over the width gave wrong Wan frames on a CPU mesh.
    fsdp._component("vae")
    assert not any("dp" in str(s.sharding.spec) for s in fsdp._states["vae"].values())


def test_two_experts_on_a_slice_too_small_are_told_fsdp_fits():
    """Wan 2.2 A14B on v6e-4: both experts resident do not fit 32 GiB with the default mesh (40.7 GiB compiled
    at full size); split over dp as well they do, and the suggestion says so. The step's activations are the
    compiled full-size figure; the weights are the model's own (full depth, abstract)."""
    from tpu_runtime.tools.plan import MeshReport, StageReport, open_abstract, suggestions

    source = ModelSource("wan2.2-t2v-a14b")
    family = open_abstract(source, parse_topology("v6e-4").devices(), _tmp(), mesh="dp=2,sp=1,tp=2")
    names = ("text_encoder", "transformer", "transformer_2", "vae")
    for name in names:
        family._component(name)
    resident = sum(_param_bytes_per_chip(family, n) for n in names)
    step_weights = _param_bytes_per_chip(family, "transformer")
    activations = int(5.1 * GIB)
    report = MeshReport("dp=2,sp=1,tp=2", False, resident, resident + activations, {
        "sample": StageReport(compiled=True, weights_bytes_per_chip=step_weights,
                              total_bytes_per_chip=step_weights + activations)})
    assert resident + activations > 32 * GIB
    advice = suggestions(source, family, report, parse_topology("v6e-4"), None, ("sample",))
    assert advice[0].startswith("--fsdp on this slice"), advice
    estimate = float(re.search(r"about ([\d.]+) GiB", advice[0]).group(1))
    assert estimate * GIB < 32 * GIB and estimate * GIB < resident * 0.6 + activations


def test_a_decode_that_fits_alone_but_not_beside_the_weights_is_told_to_split():
    """The Wan VAE's later-frame decode at 720x1280 compiled for v6e-8 (17.74 GiB per chip replicated, of it 0.24
    weights) fits a chip alone, but not beside Wan 2.2 A14B's resident weights: the decode, not the weights, is
    what to change, so the advice is the width split and nothing about FSDP or a larger slice."""
    from tpu_runtime.tools.plan import MeshReport, StageReport, open_abstract, suggestions

    source = ModelSource("wan2.2-t2v-a14b")
    family = open_abstract(source, parse_topology(V6E_8).devices(), _tmp(), mesh="dp=2,sp=1,tp=4",
                           vae_sharding="replicated")
    names = ("text_encoder", "transformer", "transformer_2", "vae")
    for name in names:
        family._component(name)
    resident = sum(_param_bytes_per_chip(family, n) for n in names)
    step = _param_bytes_per_chip(family, "transformer")
    vae = _param_bytes_per_chip(family, "vae")
    stages = {"sample": StageReport(compiled=True, weights_bytes_per_chip=step,
                                    total_bytes_per_chip=step + int(3.9 * GIB)),
              "decode_frame": StageReport(compiled=True, weights_bytes_per_chip=vae,
                                          total_bytes_per_chip=vae + int(17.5 * GIB))}
    report = MeshReport("dp=2,sp=1,tp=4", False, resident, resident + int(17.5 * GIB), stages)
    assert stages["decode_frame"].total_bytes_per_chip < 32 * GIB < report.peak_bytes_per_chip
    advice = suggestions(source, family, report, parse_topology(V6E_8), None, ("sample", "decode"))
    assert advice == ["--vae-sharding width: splits the decode's activations over every chip"], advice


def test_a_decode_short_of_memory_with_the_split_already_on_is_told_what_else_fits():
    """CogVideoX1.5-5B's decode at 1360x768x81 compiled for v6e-8 with the width split over dp alone: its first
    two latent batches took 26.60 GiB per chip (0.4 of it the VAE), 32.98 of 32 with the resident weights. The split
    is on already, so it is not suggested again; fewer resident weights (FSDP) or a larger slice to split the
    decode over are, each with an estimate under the chip's memory (the advice was empty before)."""
    from tpu_runtime.tools.plan import MeshReport, StageReport, open_abstract, suggestions

    source = ModelSource("cogvideox1.5-5b")
    family = open_abstract(source, parse_topology(V6E_8).devices(), _tmp(), mesh="dp=2,sp=1,tp=4")
    assert family.vae_sharding == "width"
    names = ("text_encoder", "transformer", "vae")
    for name in names:
        family._component(name)
    resident = sum(_param_bytes_per_chip(family, n) for n in names)
    step, vae = _param_bytes_per_chip(family, "transformer"), _param_bytes_per_chip(family, "vae")
    decode_extra = int(26.2 * GIB)
    stages = {"sample": StageReport(compiled=True, weights_bytes_per_chip=step,
                                    total_bytes_per_chip=step + int(3.1 * GIB)),
              "decode_start": StageReport(compiled=True, weights_bytes_per_chip=vae,
                                          total_bytes_per_chip=vae + decode_extra)}
    report = MeshReport("dp=2,sp=1,tp=4", False, resident, resident + decode_extra, stages)
    assert resident + decode_extra > 32 * GIB
    advice = suggestions(source, family, report, parse_topology(V6E_8), None, ("sample", "decode"))
    assert not any(a.startswith("--vae-sharding") for a in advice), advice
    fsdp = [a for a in advice if a.startswith("--fsdp on this slice")]
    larger = [a for a in advice if a.startswith("a larger slice: v6e-16")]
    assert fsdp and larger, advice
    for line in fsdp + larger:
        assert float(re.search(r"about ([\d.]+) GiB", line).group(1)) < 32, line


def test_a_decode_the_compiler_refuses_for_want_of_hbm_is_not_told_fsdp():
    """CogVideoX1.5-5B's decode at 1360x768x81 planned for v5e-8 (split 8 ways): the compiler refused both
    programs for want of HBM (errors below, as it gave them). FSDP leaves the VAE whole, so it cannot help and is
    not suggested (it was, "about 3.6 GiB", from the weights alone); a larger slice is, estimated from what the
    compiler said the program needs; the verdict names the stages that did not compile instead of a peak."""
    from tpu_runtime.tools.plan import MeshReport, PlanReport, StageReport, format_report, open_abstract, suggestions

    source = ModelSource("cogvideox1.5-5b")
    topo = parse_topology("v5e-8")
    family = open_abstract(source, topo.devices(), _tmp(), mesh="dp=2,sp=1,tp=4")
    for name in ("text_encoder", "transformer", "vae"):
        family._component(name)
    resident = sum(_param_bytes_per_chip(family, n) for n in ("text_encoder", "transformer", "vae"))
    vae = _param_bytes_per_chip(family, "vae")
    stages = {
        "decode_start": StageReport(compiled=False, weights_bytes_per_chip=vae, error=(
            "JaxRuntimeError: RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
            "temporaries (17.12G) exceeds available HBM (15.75G).")),
        "decode_batch": StageReport(compiled=False, weights_bytes_per_chip=vae, error=(
            "JaxRuntimeError: RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent error. Ran "
            "out of memory in memory space hbm. Used 15.77G of 15.75G hbm. Exceeded hbm capacity by 19.23M.")),
    }
    report = MeshReport("dp=2,sp=1,tp=4", False, resident, resident, stages)
    advice = suggestions(source, family, report, topo, None, ("decode",))
    assert not any("fsdp" in a for a in advice), advice
    larger = [a for a in advice if a.startswith("a larger slice: v5e-")]
    assert larger, advice
    chips = int(re.search(r"v5e-(\d+)", larger[0]).group(1))
    estimate = float(re.search(r"about ([\d.]+) GiB", larger[0]).group(1))
    assert estimate >= 17.12 * 8 / chips  # the refused program's own need, shared by more chips
    text = format_report(PlanReport(
        model="cogvideox1.5-5b", topology="v5e-8", chips=8, hosts=1, chip_hbm_bytes=topo.hbm_bytes, height=768,
        width=1360, frames=81, cfg=True, dtype="bfloat16", attention="splash", fsdp=False, vae_sharding="width",
        layers=None, mesh="dp=2,sp=1,tp=4", fits=False, peak_bytes_per_chip=resident,
        resident_weights_bytes_per_chip=resident, stages=stages, suggestions=advice))
    assert "verdict: DOES NOT FIT: decode_start, decode_batch did not compile" in text, text


def test_the_decode_splits_over_the_width_by_default_on_a_slice_not_on_one_chip():
    """auto (the default of plan, generate and the loaders): the width split wherever there is more than one
    chip, so the 720p Wan decode that does not fit replicated beside A14B's experts on a v6e-8 is split unasked."""
    from tpu_runtime.tools.plan import open_abstract

    source = ModelSource("wan2.2-t2v-a14b")
    slice_ = open_abstract(source, parse_topology(V6E_8).devices(), _tmp())
    assert slice_.vae_sharding == "width"
    latents = (1, 16, 21, 90, 160)  # 1280x720x81
    assert slice_._vae_input_spec(latents) == (None, None, None, None, ("dp", "tp"))
    slice_._component("vae")
    first = slice_.decode_programs(latents)[0]  # the program the decode starts with takes the split latents
    assert tuple(first.example[1].sharding.spec)[-1] == ("dp", "tp"), first.example[1].sharding
    chip = open_abstract(source, parse_topology("v6e-1").devices(), _tmp())
    assert chip.vae_sharding == "replicated" and chip._vae_input_spec(latents) == ()
    asked = open_abstract(source, parse_topology(V6E_8).devices(), _tmp(), vae_sharding="replicated")
    assert asked.vae_sharding == "replicated" and asked._vae_input_spec(latents) == ()


def test_vae_decode_compiles_for_v6e8_full_width():
    """The real Wan 2.1 VAE (every channel width), its decode split over the frame width of 8 chips, frame by
    frame as on TPU: of the two programs plan compiles, the one every latent frame after the first two runs (the
    first two frames' program has the same layers and took longer still: 190 s here against 140). A small frame
    keeps the compile to about two minutes."""
    from tpu_runtime.engine.stages import SampleSettings
    from tpu_runtime.tools.plan import _no_persistent_cache, compile_program, open_abstract
    from tpu_runtime.engine.runtime import get_runtime

    get_runtime()
    topo = parse_topology(V6E_8)
    family = open_abstract(ModelSource("wan2.1-t2v-1.3b"), topo.devices(), _tmp(), mesh="dp=2,sp=1,tp=4",
                           vae_sharding="width")
    programs = {p.name: p for p in family.plan_programs(SampleSettings(128, 128, 9)) if p.stage == "decode"}
    assert set(programs) == {"decode_start", "decode_frame"}
    with _no_persistent_cache():
        decode = compile_program(programs["decode_frame"], topo)
    assert decode.compiled, decode.error
    assert decode.mosaic_kernels >= 1  # the mid-block attention runs as a splash kernel on TPU
    # The Wan 2.1 VAE (about 127M parameters, replicated) at bfloat16.
    assert 0.2 * GIB < decode.weights_bytes_per_chip < 0.3 * GIB
    assert decode.total_bytes_per_chip < topo.hbm_bytes
    assert decode.collective_permutes > 0  # the width split exchanges the convolutions' edge columns


# --- verdicts ----------------------------------------------------------------------------------------------------
def test_a_14b_model_on_one_16gb_chip_does_not_fit_and_a_larger_slice_is_suggested():
    report = plan(ModelSource("wan2.1-t2v-14b"), "v5e-1", stages=("sample",))
    assert not report.fits
    assert "weights alone" in report.stages["sample"].error
    assert report.stages["sample"].weights_bytes_per_chip > 26 * GIB  # 14B parameters in bfloat16
    larger = [s for s in report.suggestions if s.startswith("a larger slice")]
    assert larger, report.suggestions
    # Nothing compiled, so the estimate is the weights alone, with a quarter of the chip left for activations:
    # v5e-8's weights, 11.4 GiB a chip, leave enough (planned at full size, its step needs 15.35 of 16 GiB: see
    # docs/plan.md). Before umT5's tied token embedding was placed once, they were 13.3 GiB (its 2.0 GiB embedding
    # counted, and placed, twice), the step needed 17.3 GiB and the suggestion was a v5e-16.
    assert larger[0].startswith("a larger slice: v5e-8 with mesh dp=2,sp=1,tp=4"), larger
    assert "weights alone" in larger[0]
    estimate = float(re.search(r"about ([\d.]+) GiB", larger[0]).group(1))
    assert estimate < 0.75 * 16


def test_a_tied_embedding_counts_once():
    """umT5-XXL's token embedding (256384 x 4096) is one tensor under two names: planned once, not twice."""
    from tpu_runtime.tools.plan import open_abstract, shard_bytes

    family = open_abstract(ModelSource("wan2.1-t2v-14b"), parse_topology("v5e-1").devices(), _tmp())
    family._component("text_encoder")
    state = family._states["text_encoder"]
    assert state["shared.weight"] is state["encoder.embed_tokens.weight"]
    unique = {id(s): s for s in state.values()}.values()
    assert shard_bytes(state) == sum(int(np.prod(s.shape)) * s.dtype.itemsize for s in unique)
    embedding = 256384 * 4096 * 2  # bfloat16: 1.96 GiB, once
    assert shard_bytes(state) == sum(int(np.prod(s.shape)) * s.dtype.itemsize for s in state.values()) - embedding


def test_two_expert_models_count_both_experts_resident():
    """Wan 2.2 A14B: one step program serves both experts; both stay on the chips, so both count."""
    from tpu_runtime.tools.plan import open_abstract

    mesh = "dp=2,sp=1,tp=4"
    report = plan(ModelSource("wan2.2-t2v-a14b"), V6E_8, mesh=mesh, height=64, width=64, frames=5,
                  stages=("sample",), layers=1)
    assert report.stages["sample"].compiled and report.fits
    family = open_abstract(ModelSource("wan2.2-t2v-a14b"), parse_topology(V6E_8).devices(), _tmp(), mesh=mesh,
                           layers=1)
    names = ("text_encoder", "transformer", "transformer_2", "vae")
    for name in names:
        family._component(name)
    parts = {c: _param_bytes_per_chip(family, c) for c in names}
    assert parts["transformer_2"] == parts["transformer"] == report.stages["sample"].weights_bytes_per_chip
    assert report.resident_weights_bytes_per_chip == sum(parts.values())


def test_a_step_cache_plans_its_programs_and_counts_its_residuals():
    """plan --cache compiles the step cache's programs in place of the sampler's and counts what it keeps between
    steps with the weights, once per expert (MagCache: the blocks' residual; FirstBlockCache: the first block's
    and the other blocks' residuals): here [2 (CFG), 2 x 4 x 4 tokens, 5120] in bfloat16 split over all 8 chips."""
    from tpu_runtime.engine.stages import SampleSettings
    from tpu_runtime.tools.plan import _with_step_cache, open_abstract

    mesh = "dp=2,sp=1,tp=4"
    report = plan(ModelSource("wan2.2-t2v-a14b"), V6E_8, mesh=mesh, height=64, width=64, frames=5,
                  stages=("sample",), layers=1, cache="magcache")
    assert set(report.stages) == {"sample_mag_full", "sample_mag_skip"}
    assert all(s.compiled for s in report.stages.values()) and report.fits
    one = 2 * (2 * 4 * 4) * 5120 * 2 // 8
    assert report.step_cache_bytes_per_chip == one * 2  # two experts, each its own
    family = open_abstract(ModelSource("wan2.2-t2v-a14b"), parse_topology(V6E_8).devices(), _tmp(), mesh=mesh,
                           layers=1)
    names = ("text_encoder", "transformer", "transformer_2", "vae")
    for name in names:
        family._component(name)
    weights = sum(_param_bytes_per_chip(family, c) for c in names)
    assert report.resident_weights_bytes_per_chip == weights + report.step_cache_bytes_per_chip
    text = format_report(report)
    assert "step cache magcache" in text and "step cache resident" in text
    programs, held, _ = _with_step_cache(family, family.plan_programs(SampleSettings(64, 64, 5, guidance=4.0)),
                                         "first-block", cfg=True)
    assert [p.name for p in programs if p.stage == "sample"] == ["sample_fbc_first", "sample_fbc_rest",
                                                                 "sample_fbc_skip"]
    assert held == 2 * one * 2


def test_a_kernel_out_of_scoped_vmem_is_reported_with_smaller_blocks():
    """Blocks too long for the chip's scoped VMEM (here twice the defaults, which v5e halves back to the v6e
    sizes it cannot hold) are the compiler's error, not the HBM's: plan names it and suggests smaller blocks."""
    from tpu_runtime.engine.attention import AttentionConfig

    big = AttentionConfig(impl="splash", block_q=6656, block_kv=5632)
    report = plan(ModelSource("wan2.1-t2v-1.3b"), "v5e-4", mesh="dp=2,sp=1,tp=2", stages=("sample",), layers=1,
                  attention=big, frames=13)  # 6240 tokens: longer than the blocks
    sample = report.stages["sample"]
    assert not report.fits and not sample.compiled
    assert "CompileTimeScopedVmemOom" in sample.error
    assert report.suggestions[0].startswith("smaller splash blocks: --block-q 3328 --block-kv 2816"), report.suggestions


def test_bad_input_is_refused_before_compiling():
    with pytest.raises(InputError, match="4\\*N\\+1"):
        plan(ModelSource("wan2.1-t2v-1.3b"), V6E_8, frames=80)
    with pytest.raises(InputError, match="tp=8 does not divide the model's 12 attention heads"):
        plan(ModelSource("wan2.1-t2v-1.3b"), V6E_8, mesh="dp=1,sp=1,tp=8")
    with pytest.raises(InputError, match="known model"):
        plan(ModelSource("wan9-huge"), V6E_8)
    with pytest.raises(InputError, match="stages"):
        plan(ModelSource("wan2.1-t2v-1.3b"), V6E_8, stages=("render",))


def test_cli_plans_a_folder_tries_meshes_and_writes_json(tiny_wan, tmp_path, capsys):
    """A diffusers folder, every stage, no --mesh: candidate meshes compiled, the smallest fit chosen."""
    from tpu_runtime.tools.cli import main

    out = tmp_path / "plan.json"
    code = main(["plan", "--model", str(tiny_wan["2.1"]), "--topology", "v6e-4", "--height", "64", "--width", "64",
                 "--frames", "9", "--steps", "4", "--stages", "encode,sample", "--candidates", "2",
                 "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "verdict: FITS" in text and "meshes tried" in text
    data = json.loads(out.read_text())
    for key in ("topology", "chips", "chip_hbm_bytes", "mesh", "fits", "stages"):
        assert key in data
    assert set(data["stages"]) == {"encode", "sample"}
    for stage in data["stages"].values():
        for key in ("compiled", "error", "weights_bytes_per_chip", "temp_bytes_per_chip", "total_bytes_per_chip",
                    "all_reduces", "all_gathers", "compile_seconds"):
            assert key in stage
        assert stage["compiled"]
    assert data["stages"]["sample"]["mosaic_kernels"] >= 1
    fitting = [c for c in data["candidates"] if c["fits"]]
    assert len(data["candidates"]) > 1
    assert data["peak_bytes_per_chip"] == min(c["peak_bytes_per_chip"] for c in fitting)
    # the peak is every component's weights resident plus the largest stage's own inputs, outputs and temporaries
    extra = max(s["total_bytes_per_chip"] - s["weights_bytes_per_chip"] for s in data["stages"].values())
    assert data["peak_bytes_per_chip"] == data["resident_weights_bytes_per_chip"] + extra
    assert data["resident_weights_bytes_per_chip"] >= max(s["weights_bytes_per_chip"] for s in data["stages"].values())


def test_cli_reports_bad_topology_as_an_error(capsys):
    from tpu_runtime.tools.cli import main

    assert main(["plan", "--model", "cogvideox-2b", "--topology", "v6e-7"]) == 2
    assert "v6e-7" in capsys.readouterr().err


def test_planned_programs_do_not_touch_the_runtime_program_table_or_cache(runtime, monkeypatch):
    """Programs for another machine stay out of the runtime's table and out of the persistent compilation cache
    (a TPU step executable is 100-200 MB); the cache works again for the runtime afterwards. What this process puts
    into the cache is counted where JAX writes it (the test workers share one cache folder: another worker's
    programs may land in it meanwhile)."""
    import jax
    import jax.numpy as jnp
    from jax._src import compilation_cache

    written = []
    put = compilation_cache.put_executable_and_time

    def counted_put(cache_key, module_name, *args, **kwargs):
        written.append(module_name)
        return put(cache_key, module_name, *args, **kwargs)

    monkeypatch.setattr(compilation_cache, "put_executable_and_time", counted_put)
    before, files = runtime.program_count, set(runtime.cache_dir.iterdir())
    plan(ModelSource("wan2.1-t2v-1.3b"), "v6e-4", height=64, width=64, frames=5, stages=("sample",), layers=1,
         mesh="dp=2,sp=1,tp=2")
    assert runtime.program_count == before
    assert written == []
    assert torch.is_grad_enabled()
    jax.jit(lambda x: x * 3.25 + 1.0).lower(jnp.ones((7, 3))).compile()  # a CPU program of this process: cached
    assert "jit__lambda" in written
    assert len(set(runtime.cache_dir.iterdir()) - files) >= 1


def test_a_multi_host_slice_is_planned_per_chip():
    """v6e-16 is four hosts of four chips: one mesh over all 16 (tp=8 across hosts), per-chip memory reported and
    equal to the band from the parameter shapes on that mesh."""
    from tpu_runtime.tools.plan import open_abstract

    mesh = "dp=2,sp=1,tp=8"
    report = plan(ModelSource("wan2.1-t2v-14b"), "v6e-16", mesh=mesh, height=64, width=64, frames=5,
                  stages=("sample",), layers=1)
    assert (report.chips, report.hosts, report.chip_hbm_bytes) == (16, 4, 32 * GIB)
    sample = report.stages["sample"]
    assert sample.compiled and report.fits
    family = open_abstract(ModelSource("wan2.1-t2v-14b"), parse_topology("v6e-16").devices(), _tmp(), mesh=mesh,
                           layers=1)
    family._component("transformer")
    assert len(family.devices) == 16
    assert sample.weights_bytes_per_chip == _param_bytes_per_chip(family, "transformer")
    assert 0 < sample.total_bytes_per_chip < report.chip_hbm_bytes
    assert sample.all_reduces >= 2 and sample.all_gathers == 0 and sample.mosaic_kernels == 2


# --- answers fast, stops cleanly, TPU v7x ------------------------------------------------------------------------
def test_a_model_that_cannot_fit_is_answered_in_seconds_with_advice(capsys):
    """The resident weights alone exceed the chip: no stage is compiled (the VAE decode alone took minutes), the
    verdict and the advice come at once."""
    import time

    from tpu_runtime.tools.cli import main

    start = time.monotonic()
    code = main(["plan", "--model", "wan2.1-t2v-14b", "--topology", "v5e-1"])
    seconds = time.monotonic() - start
    out = capsys.readouterr().out
    assert code == 3 and seconds < 30, (seconds, out)
    assert "verdict: DOES NOT FIT: the weights resident on every chip alone need 37.5 GiB" in out
    assert re.search(r"decode_frame +skipped", out) and "--every-stage" in out
    assert "try: a larger slice: v5e-8" in out


def test_sigterm_during_a_long_compile_stops_the_plan_cleanly(tmp_path):
    """The compile runs in a thread; the signal is handled at once, the partial plan printed, no traceback."""
    import signal
    import subprocess
    import sys
    import threading
    import time

    from conftest import subprocess_env

    proc = subprocess.Popen([sys.executable, "-m", "tpu_runtime", "plan", "--model", "wan2.1-t2v-1.3b", "--topology",
                             "v6e-8", "--candidates", "1", "--stages", "sample,decode"], cwd=tmp_path,
                            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err_lines = []
    reader = threading.Thread(target=lambda: err_lines.extend(proc.stderr), daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    while not any("compiling Wan sampler step" in line for line in err_lines) and time.monotonic() < deadline \
            and proc.poll() is None:
        time.sleep(0.5)
    assert any("compiling Wan sampler step" in line for line in err_lines), "".join(err_lines)[-3000:]
    time.sleep(2)  # inside the compiler now
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out = proc.stdout.read()
    proc.wait(timeout=60)
    reader.join(timeout=10)
    err = "".join(err_lines)
    assert time.monotonic() - sent < 15
    assert proc.returncode == 128 + signal.SIGTERM, (out, err[-3000:])
    assert "plan stopped by SIGTERM" in out and "it was compiling Wan sampler step" in out
    assert "Traceback" not in err


def test_v7x_counts_two_devices_a_chip_and_reports_per_device(capsys):
    """TPU v7x (Ironwood): v7x-8 is 4 chips, each two TensorCores that JAX counts as two devices with half the
    chip's HBM; the plan compiles a Wan 1.3B step on the 8 devices and reports memory per device and per chip."""
    topo = parse_topology("v7x-8")
    assert (topo.chips, topo.device_count, topo.devices_per_chip, topo.hosts) == (4, 8, 2, 1)
    assert topo.hbm_bytes == 96 * GIB and topo.chip_hbm_bytes == 192 * GIB
    devices = topo.devices()
    assert len(devices) == 8 and devices[0].device_kind == "TPU7x"
    assert len({tuple(d.coords) for d in devices}) == 4  # two devices on each of the 4 chips
    from tpu_runtime.tools.plan import format_report

    report = plan(ModelSource("wan2.1-t2v-1.3b"), "v7x-8", height=128, width=128, frames=9, stages=("sample",),
                  layers=1, max_candidates=1)
    sample = report.stages["sample"]
    assert sample.compiled and sample.mosaic_kernels == 2 and report.fits  # splash for v7x: self + cross attention
    assert report.devices_per_chip == 2 and report.mesh == "dp=2,sp=1,tp=4"
    assert 0 < report.peak_bytes_per_chip < 96 * GIB  # per device
    text = format_report(report)
    assert "4 chip(s) = 8 devices (2 TensorCores a chip)" in text and "= 96.00 GiB per device" in text
    verdict = next(line for line in text.splitlines() if "verdict" in line)
    assert "of 96.00 GiB per device" in verdict
    assert f"{report.peak_bytes_per_chip * 2 / GIB:.2f} GiB per chip" in verdict
