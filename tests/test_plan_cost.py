"""`plan`'s cost estimate: every planned program's cost as the TPU compiler's cost model counts it, the splash
attention kernels it cannot see added from their shapes, and the lower bound on seconds a step and a video's
sampling take that they give, in the text and the JSON of `plan` and `plan --comfy-model`.

The oracle for the added attention term is the compiler itself: the same two matrix products written as XLA's own
einsums, compiled for the same device, count exactly the flops added for the kernel. Reduced configs throughout
(one or two blocks of Wan 2.1 1.3B, 128 video tokens), compiled for a v6e-4 with the heads split four ways.
"""

import json

import numpy as np
import pytest
from comfy_native import comfyui_session, versions_param

from tpu_runtime.tools.plan import ModelSource, format_report, plan
from tpu_runtime.tools.plan_compile import ROOFLINE, program_cost
from tpu_runtime.tools.topology import CHIP_HBM_BYTES_PER_SECOND, CHIP_PEAK_BF16_FLOPS, parse_topology

SLICE = "v6e-4"
MESH = "dp=1,sp=1,tp=4"
MODEL = "wan2.1-t2v-1.3b"
SIZE = dict(height=128, width=256, frames=1)  # one latent frame of 16 x 32: 8 x 16 = 128 tokens (patch 2x2)
TOKENS, TEXT_TOKENS = 128, 512  # the video's tokens, and the umT5 prompt Wan's cross-attention reads
TP = 4


def _plan(**options):
    return plan(ModelSource(MODEL), SLICE, **SIZE, mesh=MESH, stages=("sample",), **options)


@pytest.fixture(scope="module")
def one_block():
    """Wan 2.1 1.3B's sampler step with one transformer block, CFG (the batch of 2), the release's 50 steps."""
    return _plan(layers=1)


@pytest.fixture(scope="module")
def wan_config():
    from tpu_runtime.families import registry

    return json.loads((registry.write_architecture(MODEL, _tmp()) / "transformer" / "config.json").read_text())


def _tmp():
    import tempfile
    from pathlib import Path

    return Path(tempfile.mkdtemp())


def _attention_flops(config: dict, batch: int, layers: int) -> int:
    """4·B·H·Lq·Lk·D per device for Wan's self-attention (video tokens over themselves) and cross-attention (video
    tokens over the prompt's) in every block, the heads split over tp."""
    heads, d = config["num_attention_heads"] // TP, config["attention_head_dim"]
    return layers * sum(4 * batch * heads * TOKENS * keys * d for keys in (TOKENS, TEXT_TOKENS))


# --- the kernel's part, against the compiler's own count of the same work ------------------------------------------
def test_the_compiler_counts_no_splash_work_and_the_added_term_is_its_matrix_products():
    """A program of two splash calls (one of aligned lengths, one padded to the kernel's blocks) on v6e-4 with the
    heads split 4 ways: the compiler's flops leave the kernels out; the added term is 4·B·H·Lq·Lk·D per device at
    the padded lengths the kernel computes, and equals the compiler's count of q·kᵀ and p·v as XLA einsums."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpu_runtime.engine.attention import AttentionConfig, attention, splash_block_sizes

    topo = parse_topology(SLICE)
    devices = topo.devices()
    mesh = Mesh(np.array(devices).reshape(1, 1, TP), ("dp", "sp", "tp"))
    config = AttentionConfig(impl="splash")
    b, h, d = 2, 8, 128
    shapes = [(1024, 512), (1000, 300)]  # (Lq, Lk): the second padded to the kernel's blocks

    def two_calls(q1, k1, q2, k2):
        return [attention(q, k, k, d ** -0.5, config, "tpu", mesh=mesh) for q, k in ((q1, k1), (q2, k2))]

    split = NamedSharding(mesh, P(None, "tp", None, None))
    structs = [jax.ShapeDtypeStruct((b, h, n, d), jnp.bfloat16, sharding=split) for lq, lk in shapes for n in (lq, lk)]
    compiled = jax.jit(two_calls).lower(*structs).compile()
    cost = program_cost(compiled, compiled.as_text(), topo)

    padded = [splash_block_sizes(config, lq, lk, d)[3:] for lq, lk in shapes]
    assert padded[0] == (1024, 512) and padded[1] == (1024, 512)
    expected = sum(4 * b * (h // TP) * lq * lk * d for lq, lk in padded)
    assert cost.attention_kernels == 2 and cost.other_kernels == 0
    assert cost.attention_flops == expected
    assert cost.compiler_flops < 0.01 * expected  # the kernels' work is not in the compiler's count
    assert cost.attention_bytes == sum(2 * b * (h // TP) * d * (2 * lq + 2 * lk) for lq, lk in padded)

    # The oracle: XLA's own count of the kernel's two matrix products, at the shapes one device computes.
    one = NamedSharding(Mesh(np.array(devices[:1]).reshape(1, 1, 1), ("dp", "sp", "tp")), P())

    def products(q, k, p, v):
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32)
        return scores, jnp.einsum("bhqk,bhkd->bhqd", p, v, preferred_element_type=jnp.float32)

    counted = 0
    for lq, lk in padded:
        args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=one)
                for s in ((b, h // TP, lq, d), (b, h // TP, lk, d), (b, h // TP, lq, lk), (b, h // TP, lk, d))]
        counted += jax.jit(products).lower(*args).compile().cost_analysis()["flops"]
    assert cost.attention_flops == counted

    # No custom call the cost model cannot cost: its optimal_seconds is the compiler's part of the bound.
    assert not cost.custom_calls and cost.compiler_seconds_from == "optimal_seconds"
    assert cost.compiler_seconds == cost.compiler_optimal_seconds > 0
    assert cost.attention_seconds == max(expected / topo.peak_flops, cost.attention_bytes / topo.hbm_bytes_per_second)
    assert cost.seconds == cost.compiler_seconds + cost.attention_seconds


def test_kernels_are_read_by_their_operands_wherever_they_sit():
    """HLO as the TPU compiler writes it, shortened: a kernel without operand layout constraints is read by its
    operands' definitions; one inside a loop body is counted once and said to be; a Mosaic kernel that does not
    take queries, keys and values is not taken for attention."""
    from tpu_runtime.tools.plan_compile import mosaic_kernels

    hlo = "\n".join([
        "%body.1 (p: (s32[], bf16[2,256,64])) -> (s32[], bf16[2,256,64]) {",
        "  %q.1 = bf16[2,256,64]{2,1,0} get-tuple-element(%p), index=1",
        "  %k.1 = bf16[2,128,64]{2,1,0} parameter(1)",
        "  %s.1 = s32[256,128]{1,0} broadcast(%c), dimensions={0}",
        '  %kernel.1 = bf16[2,256,64]{2,1,0} custom-call(%q.1, %k.1, /*index=2*/%k.1, %s.1), '
        'custom_call_target="tpu_custom_call", backend_config={}',
        "}",
        "ENTRY %main.2 (a: bf16[4,1024,128]) -> bf16[4,1024,128] {",
        '  %kernel.2 = (f32[1024,128], bf16[4,1024,128]{2,1,0}) custom-call(%m, %m, %a, %b, %c, %seg), '
        'custom_call_target="tpu_custom_call", operand_layout_constraints={s8[1,1,1]{2,1,0}, s8[1,1,1]{2,1,0}, '
        'bf16[4,1024,128]{2,1,0}, bf16[4,512,128]{2,1,0}, bf16[4,512,128]{2,1,0}, s32[1024,128]{1,0}}',
        '  %norm.3 = bf16[4,1024,128]{2,1,0} custom-call(%a, %w), custom_call_target="tpu_custom_call", '
        "operand_layout_constraints={bf16[4,1024,128]{2,1,0}, f32[128]{0}}",
        "  %while.4 = (s32[], bf16[2,256,64]) while(%t), condition=%cond.1, body=%body.1",
        "}",
    ])
    kernels, others, looped = mosaic_kernels(hlo)
    assert [(k.lead, k.lq, k.lk, k.d, k.dv) for k in kernels] == [(2, 256, 128, 64, 64), (4, 1024, 512, 128, 128)]
    assert kernels[1].flops == 4 * 4 * 1024 * 512 * 128 and others == 1 and looped == 1


def test_published_peaks_per_device():
    """The named per-chip constants become per-device rates: a v7x chip's two TensorCores are two devices."""
    v6e, v7x = parse_topology("v6e-8"), parse_topology("v7x-8")
    assert (v6e.peak_flops, v6e.hbm_bytes_per_second) == (918e12, 1638e9)
    assert v7x.peak_flops == CHIP_PEAK_BF16_FLOPS["v7x"] / 2 and v7x.hbm_bytes_per_second == 7380e9 / 2
    assert set(CHIP_PEAK_BF16_FLOPS) == set(CHIP_HBM_BYTES_PER_SECOND) == {"v4", "v5e", "v5p", "v6e", "v7x"}


# --- a family's step: the numbers, how they scale ---------------------------------------------------------------
def test_the_step_row_gives_the_compilers_cost_the_attention_added_and_a_lower_bound(one_block, wan_config):
    topo = parse_topology(SLICE)
    step = one_block.stages["sample"]
    cost = step.cost
    assert step.compiled and cost is not None
    assert cost.compiler_flops > 0 and cost.compiler_bytes > 0 and cost.attention_bytes > 0
    assert cost.attention_kernels == step.mosaic_kernels == 2  # self- and cross-attention of the one block
    assert cost.attention_flops == _attention_flops(wan_config, batch=2, layers=1)
    # The compiler's part: its optimal_seconds only without custom calls it cannot cost, else the roofline.
    if cost.custom_calls:
        assert cost.compiler_seconds_from == ROOFLINE
        assert cost.compiler_seconds == max(cost.compiler_flops / topo.peak_flops,
                                            cost.compiler_bytes / topo.hbm_bytes_per_second)
    # A lower bound is at least the work at the peak.
    assert cost.seconds >= (cost.compiler_flops + cost.attention_flops) / topo.peak_flops
    bound = one_block.time_bound
    assert one_block.steps == bound.steps == 50  # the family's default steps
    assert bound.step_seconds == cost.seconds and bound.calls_per_step == 1
    assert bound.video_seconds == pytest.approx(50 * cost.seconds)
    assert bound.compiler_seconds + bound.attention_seconds == pytest.approx(bound.step_seconds)


def test_twice_the_blocks_twice_the_flops(one_block, wan_config):
    two = _plan(layers=2).stages["sample"].cost
    one = one_block.stages["sample"].cost
    assert two.attention_kernels == 4
    assert two.attention_flops == 2 * one.attention_flops == _attention_flops(wan_config, batch=2, layers=2)
    # The compiler's count grows by one block's matrix products: q, k, v, o and the cross-attention's q and o on
    # the video tokens, its k and v on the prompt's, the feed-forward; per device a quarter of them (tp=4).
    dim, ffn = wan_config["num_attention_heads"] * wan_config["attention_head_dim"], wan_config["ffn_dim"]
    block = 2 * 2 * (TOKENS * (6 * dim * dim + 2 * dim * ffn) + TEXT_TOKENS * 2 * dim * dim) / TP
    assert two.compiler_flops - one.compiler_flops == pytest.approx(block, rel=0.1)
    assert one.compiler_flops < two.compiler_flops < 2 * one.compiler_flops  # the embeddings and head: once


def test_cfg_doubles_the_work_of_a_step(one_block, wan_config):
    """With CFG the step program runs the batch of 2 (cond and uncond) in its one call a step; without, batch 1."""
    no_cfg = _plan(layers=1, guidance=1.0)
    assert not no_cfg.cfg and one_block.cfg
    single, double = no_cfg.stages["sample"].cost, one_block.stages["sample"].cost
    assert single.attention_flops == _attention_flops(wan_config, batch=1, layers=1)
    assert double.attention_flops == 2 * single.attention_flops
    assert double.compiler_flops == pytest.approx(2 * single.compiler_flops, rel=0.05)
    assert no_cfg.time_bound.calls_per_step == one_block.time_bound.calls_per_step == 1


def test_the_cost_and_the_bound_in_plans_text_and_json(one_block, tmp_path, capsys, monkeypatch):
    """`plan` prints the compiler's part, the part added and the bound, and `--json` writes the same numbers (the
    command runs on the plan compiled above: compiled again, the same program would only take time)."""
    import tpu_runtime.tools.plan as plan_module
    from tpu_runtime.tools.cli import main

    asked = {}

    def planned(source, topology, **options):
        asked.update(options, model=source.model, topology=topology.name)
        return one_block

    monkeypatch.setattr(plan_module, "plan", planned)
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", MODEL, "--topology", SLICE, "--height", "128", "--width", "256", "--frames", "1",
                 "--layers", "1", "--mesh", MESH, "--stages", "sample", "--json", str(out)]) == 0
    assert asked["layers"] == 1 and asked["stages"] == ("sample",) and asked["topology"] == SLICE
    printed = capsys.readouterr().out
    assert printed.strip() == format_report(one_block)
    assert "LOWER BOUND on time" in printed and "the compiler's part" in printed and "attention kernels' " in printed
    assert "50 steps x 1 call" in printed and "918 TFLOP/s" in printed and "+ attention TFLOP" in printed
    data = json.loads(out.read_text())
    cost, expected = data["stages"]["sample"]["cost"], one_block.stages["sample"].cost
    assert cost["attention_flops"] == expected.attention_flops and cost["compiler_flops"] == expected.compiler_flops
    assert cost["seconds"] == expected.seconds > 0 and cost["compiler_seconds_from"] in ("optimal_seconds", ROOFLINE)
    bound = data["time_bound"]
    assert bound["steps"] == 50 and bound["video_seconds"] == pytest.approx(50 * cost["seconds"])
    assert f"{bound['video_seconds']:.3g} s for a video's sampling" in printed


def test_a_step_cache_or_no_step_gives_no_video_bound():
    from tpu_runtime.tools.plan import sampling_bound
    from tpu_runtime.tools.plan_compile import StageReport

    assert sampling_bound({}, 50, "none")[0] is None
    assert "not planned" in sampling_bound({}, 50, "none")[1]
    assert "not compiled" in sampling_bound({"sample": StageReport(compiled=False, skipped=True)}, 50, "none")[1]
    assert "skips" in sampling_bound({"sample_mag_full": StageReport(compiled=True)}, 50, "magcache")[1]


# --- the native bridge's rows ------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=versions_param())
def pack(request):
    with comfyui_session(request.param):
        yield request.param


@pytest.mark.comfy_versions("newest")
def test_the_bridged_step_has_the_same_attention_work_as_the_family(pack, one_block):
    """ComfyUI's WanModel through the bridge, one block, same size, mesh and CFG batch: its kernels do the family's
    attention work exactly, its compiler-counted work is within 10% of the family's; the bound is for ComfyUI's
    KSampler default of 20 steps unless --steps says otherwise, in the text and the JSON data."""
    from dataclasses import asdict

    from tpu_runtime.tools.plan_native import KSAMPLER_STEPS, format_native_report, plan_native

    report = plan_native(MODEL, None, SLICE, **SIZE, layers=1, mesh=MESH, compare=False)
    bridged, family = report.step.cost, one_block.stages["sample"].cost
    assert bridged.attention_kernels == 2 and bridged.attention_flops == family.attention_flops
    assert bridged.compiler_flops == pytest.approx(family.compiler_flops, rel=0.1)
    assert report.steps == KSAMPLER_STEPS == 20
    assert report.time_bound.video_seconds == pytest.approx(20 * bridged.seconds)
    text = format_native_report(report)
    assert "LOWER BOUND on time" in text and "a step through the bridge" in text and "20 steps x 1 call" in text
    data = json.loads(json.dumps(asdict(report)))  # what plan --comfy-model --json writes
    assert data["step"]["cost"]["attention_flops"] == family.attention_flops
    assert data["time_bound"]["step_seconds"] == bridged.seconds
    again = plan_native(MODEL, None, SLICE, **SIZE, layers=1, mesh=MESH, compare=False, steps=50)
    assert again.time_bound.video_seconds == pytest.approx(50 * bridged.seconds)  # the same program, not compiled
