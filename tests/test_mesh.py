"""On 8 simulated CPU devices, every mesh gives the single-device frames (with FSDP, and the VAE decode split over
the frame width, the default on more than one device, or replicated);
invalid meshes fail before compiling; the compiled step holds the expected collectives and gathers no sharded
weight; one compile per shape and mesh."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import subprocess_env
from mesh_worker import mesh_key, nine_latent_frames

from tpu_runtime.families.cogvideox.model import CogVideoXFamily
from tpu_runtime.engine.stages import SampleSettings, VideoLatents
from tpu_runtime.errors import InputError
from tpu_runtime.engine.runtime import compile_stats
from tpu_runtime.engine.sharding import MeshSpec, default_mesh, frame_split_spec, parse_mesh, split_axes
from tpu_runtime.families.cogvideox.tiny import TinySpec, build_tiny_cogvideox

MESHES = ["dp=1,sp=1,tp=8", "dp=2,sp=1,tp=4", "dp=1,sp=2,tp=4", "dp=2,sp=2,tp=2"]
REPLICATED_VAE = "dp=2,sp=1,tp=4:replicated"  # every device decodes the whole video (the others: split on width)
FSDP = "dp=2,sp=1,tp=4:fsdp"  # every matrix split over dp too (tp's matrices on their other dimension)
FSDP_DECODE9 = FSDP + ":decode9"  # and random latents of 9 latent frames decoded (CogVideoX's batch programs)


@pytest.fixture(scope="module")
def eight_head_model(tmp_path_factory):
    return build_tiny_cogvideox(tmp_path_factory.mktemp("heads8") / "m", "5b", spec=TinySpec("5b", heads=8))


@pytest.fixture(scope="module")
def four_head_wan(tmp_path_factory):
    from tpu_runtime.families.wan.tiny import TinyWanSpec, build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("wan4") / "m", "2.1", spec=TinyWanSpec(heads=4, layers=1))


@pytest.fixture(scope="module")
def wan_lora(four_head_wan, tmp_path_factory):
    from tpu_runtime.families.wan.tiny import build_tiny_lora

    return build_tiny_lora(four_head_wan / "transformer", tmp_path_factory.mktemp("lora") / "l.safetensors", "comfy",
                           seed=2)


CANNOT_SPLIT = ("dp=1,sp=2,tp=4", 6.0), ("dp=2,sp=2,tp=2", 1.0)  # tp past the heads; dp past the batch without CFG
WAN_MESHES = ["dp=2,sp=1,tp=4", "dp=1,sp=2,tp=4", "dp=2,sp=2,tp=2", FSDP, REPLICATED_VAE]  # Wan decodes by frame
LORA_MESH, LORA_STRENGTH = "dp=2,sp=1,tp=4", 0.7


@pytest.fixture(scope="module")
def eight_devices(eight_head_model, four_head_wan, wan_lora, tiny_ltx2, tmp_path_factory):
    """Every 8-device job of this file in one process of its own (mesh_worker.py): (the folder of each job's
    outputs, the report by job name)."""
    base = tmp_path_factory.mktemp("eight_devices")
    two_heads = build_tiny_cogvideox(base / "two_heads", "2b")
    jobs = {
        "cogvideox": {"frames": str(eight_head_model), "height": 64, "width": 128,
                      "meshes": MESHES + [REPLICATED_VAE, FSDP_DECODE9]},
        "padded": {"frames": str(eight_head_model), "height": 64, "width": 80,
                   "meshes": ["dp=1,sp=8,tp=1", "dp=2,sp=1,tp=4"]},
        "refused": {"refused": str(two_heads), "cases": CANNOT_SPLIT},
        "wan": {"frames": str(four_head_wan), "height": 64, "width": 128, "meshes": WAN_MESHES},
        "wan_lora": {"lora": str(four_head_wan), "file": str(wan_lora), "strength": LORA_STRENGTH,
                     "mesh": LORA_MESH, "height": 64, "width": 128},
        **{f"ltx2_{g}": {"encode": str(tiny_ltx2[g]), "meshes": ["dp=2,sp=2,tp=2"]} for g in ("2.3", "2.0")},
    }
    (base / "jobs.json").write_text(json.dumps(jobs))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("mesh_worker.py")), str(base / "jobs.json"), str(base)],
        env=subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"), capture_output=True, text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return base, json.loads(proc.stdout.split("REPORT ", 1)[1])


def _job(eight_devices, name):
    """(outputs, report) of one job of ``eight_devices``; its traceback where it failed."""
    base, report = eight_devices
    assert "error" not in report[name], report[name].get("error")
    path = base / f"{name}.npz"
    return (np.load(path) if path.exists() else None), report[name]


def _single_device_frames(model, height, width):
    family = CogVideoXFamily(model, dtype="float32")
    emb = family.encode("a panda playing a guitar", "blurry, low quality")
    return family.decode(family.sample(emb, SampleSettings(height, width, 9, steps=2, guidance=6.0, seed=4))).numpy()


def test_meshes_match_single_device(eight_head_model, eight_devices):
    single = _single_device_frames(eight_head_model, 64, 128)
    frames, report = _job(eight_devices, "cogvideox")
    # CogVideoX's batch-by-batch decode (the first two latent batches, then two calls of the later-batch program)
    # split over the width of the 8 devices, against one device's.
    family = CogVideoXFamily(eight_head_model, dtype="float32")
    z = nine_latent_frames((1, family.vae_config["latent_channels"], 3, 8, 16))
    assert [p.part for p in family.decode_programs(tuple(z.shape))] == ["start", "batch"]
    alone = family.decode(VideoLatents(z, 64, 128, 33, family.signature)).numpy()
    assert np.abs(frames[mesh_key(FSDP_DECODE9 + ":decode9")] - alone).max() < 1e-4
    for mesh in MESHES + [REPLICATED_VAE, FSDP_DECODE9]:
        got = frames[mesh_key(mesh)]
        assert np.abs(got - single).max() < 1e-4, mesh
        r = report[mesh]
        # The default decode splits the 16 latent columns over all 8 devices (every axis larger than 1).
        if mesh == REPLICATED_VAE:
            assert r["vae_sharding"] == "replicated" and r["decode_split_axes"] == [], r
        else:
            axes = [a for a in ("dp", "sp", "tp") if f"{a}=1" not in mesh]
            assert r["vae_sharding"] == "width" and r["decode_split_axes"][-1] == axes, (mesh, r)
        # One sampler program per mesh (the replicated-VAE run reuses its mesh's sampler), none for a new
        # seed, prompt and step count.
        assert r["sample_programs"] == (0 if mesh == REPLICATED_VAE else 1), (mesh, r)
        assert r["recompiles_second_run"] == 0, (mesh, r)
        # Gathers of activations are expected with sp (k/v along the sequence); a gathered weight would not be,
        # except under FSDP, whose weights are gathered before use by design.
        weight_shapes = {tuple(shape) for shape in r["weight_shapes"]}
        gathered_weights = [s for s in r["all_gather_shapes"] if tuple(s) in weight_shapes]
        if mesh == FSDP_DECODE9:
            assert r["weights_split_on_dp"] > 0, "FSDP placed no weight on dp"
            continue
        assert r["weights_split_on_dp"] == 0, mesh
        assert not gathered_weights, (mesh, gathered_weights)
        if "sp=1" in mesh:
            assert r["collectives"]["all-gather"] == 0, (mesh, r["all_gather_shapes"])
        if "tp=1," not in mesh + ",":
            # Megatron pattern: one all-reduce after attention and one after the feed-forward per layer.
            assert r["collectives"]["all-reduce"] >= 2, (mesh, r)


def test_sequence_not_divisible_by_sp_is_padded(eight_head_model, eight_devices):
    # 64x80: 16 text + 3*4*5 video tokens = 76, not a multiple of sp=8 (nor 3 latent frames of 20 patches).
    # Its 10 latent columns split over dp alone on dp=2,tp=4 (2 divides 10, 8 and 4 do not) and its 8 rows over tp;
    # on dp=1,sp=8,tp=1 no axis divides the columns and sp takes the rows; both equal the single device.
    single = _single_device_frames(eight_head_model, 64, 80)
    frames, report = _job(eight_devices, "padded")
    assert np.abs(frames["dp1_sp8_tp1"] - single).max() < 1e-4
    assert np.abs(frames["dp2_sp1_tp4"] - single).max() < 1e-4
    assert report["dp=2,sp=1,tp=4"]["decode_split_axes"][-2:] == [["tp"], ["dp"]], report
    assert report["dp=1,sp=8,tp=1"]["decode_split_axes"][-2:] == [["sp"], None], report


def test_invalid_meshes_fail_before_compiling(tiny_models, runtime):
    before = compile_stats()
    with pytest.raises(InputError, match="mesh dp=2,sp=1,tp=1 uses 2 devices but 1 are available"):
        CogVideoXFamily(tiny_models["2b"], mesh="dp=2")
    with pytest.raises(InputError, match="mesh axis 'xp' is not one of"):
        parse_mesh("xp=2")
    with pytest.raises(InputError, match="write it as dp=N,sp=N,tp=N"):
        parse_mesh("dp2")
    assert compile_stats().since(before).backend_compiles == 0


def test_invalid_axes_on_eight_devices(eight_devices):
    """On 8 devices, a mesh the model's heads or the batch cannot take is refused before the step compiles."""
    _, report = _job(eight_devices, "refused")
    tp, dp = (report[mesh] for mesh, _ in CANNOT_SPLIT)
    assert tp["error"] == "mesh axis tp=4 does not divide the model's 2 attention heads: use tp in [1, 2]", tp
    assert not tp["opened"]  # refused when the model opens
    assert dp["error"] == "mesh axis dp=2 does not divide the batch of 1 (no CFG: guidance <= 1): use dp=1", dp
    assert dp["built_by_sample"] == 0


def test_wan_meshes_match_single_device(four_head_wan, eight_devices):
    """Wan's rule table (self- and cross-attention, feed-forward, q/k norms across heads) on the same meshes."""
    from tpu_runtime.families.wan.model import WanFamily

    family = WanFamily(four_head_wan, dtype="float32")
    emb = family.encode("a panda playing a guitar", "blurry, low quality")
    single = family.decode(family.sample(emb, SampleSettings(64, 128, 9, steps=2, guidance=6.0, seed=4))).numpy()
    frames, report = _job(eight_devices, "wan")
    for mesh in WAN_MESHES:
        got = frames[mesh_key(mesh)]
        assert np.abs(got - single).max() < 1e-4, mesh
        r = report[mesh]
        assert r["recompiles_second_run"] == 0, (mesh, r)
        weight_shapes = {tuple(shape) for shape in r["weight_shapes"]}
        gathered_weights = [s for s in r["all_gather_shapes"] if tuple(s) in weight_shapes]
        if mesh != FSDP:
            assert not gathered_weights, (mesh, gathered_weights)
            assert r["weights_split_on_dp"] == 0, mesh
        else:
            assert r["weights_split_on_dp"] > 0, "FSDP placed no weight on dp"
        assert r["collectives"]["all-reduce"] >= 3, (mesh, r)  # attn1, attn2 and ffn outputs are row-parallel


def test_width_split_takes_the_most_devices_that_divide_the_width_then_the_height():
    v6e8 = {"dp": 2, "sp": 1, "tp": 4}
    assert split_axes(v6e8, 160) == ("dp", "tp")  # Wan at 1280 wide: every chip
    assert split_axes(v6e8, 90) == ("dp",)  # CogVideoX at 720: 90 columns, 8 and 4 do not divide
    assert split_axes(v6e8, 52) == ("tp",)  # 416 wide: 4 divides, 8 does not
    assert split_axes(v6e8, 45) == ()
    assert split_axes({"dp": 2, "sp": 2, "tp": 2}, 12) == ("dp", "sp")  # 4 of the 8 devices
    assert split_axes({"dp": 1, "sp": 1, "tp": 1}, 16) == ()
    # A frame: the width first, the axes it leaves on the height.
    assert frame_split_spec(v6e8, (1, 16, 21, 90, 160)) == (None, None, None, None, ("dp", "tp"))  # Wan 720p
    assert frame_split_spec(v6e8, (1, 16, 13, 60, 90)) == (None, None, None, ("tp",), ("dp",))  # CogVideoX 720x480
    assert frame_split_spec(v6e8, (1, 16, 21, 96, 170)) == (None, None, None, ("tp",), ("dp",))  # 1.5 1360x768
    assert frame_split_spec(v6e8, (1, 16, 13, 45, 45)) == ()
    assert frame_split_spec(v6e8, (1, 16, 13, 64, 45)) == (None, None, None, ("dp", "tp"), None)


def test_default_mesh():
    assert default_mesh(8, 48) == MeshSpec(dp=2, sp=1, tp=4)  # the seed's best for 5b / 1.5 on a v6e-8
    assert default_mesh(8, 30) == MeshSpec(dp=2, sp=2, tp=2)  # 2b: 30 heads
    assert default_mesh(1, 30) == MeshSpec()
    assert default_mesh(4, 48, cfg=False) == MeshSpec(tp=4)
    assert parse_mesh("dp=2,sp=1,tp=4") == MeshSpec(2, 1, 4) and parse_mesh("auto") is None
    # Wan: 12 heads (1.3B), 24 (TI2V-5B), 40 (14B) on a v6e-8
    assert default_mesh(8, 12) == MeshSpec(dp=2, sp=1, tp=4)
    assert default_mesh(8, 24) == MeshSpec(dp=2, sp=1, tp=4)
    assert default_mesh(8, 40) == MeshSpec(dp=2, sp=1, tp=4)
    assert default_mesh(16, 40) == MeshSpec(dp=2, sp=1, tp=8)


def test_wan_lora_merges_under_each_weights_sharding(four_head_wan, wan_lora, eight_devices):
    """On dp=2,tp=4 the LoRA is merged into each weight where it lives (same sharding after as before) and the
    frames equal the single-device frames with the same LoRA."""
    from tpu_runtime.engine.lora import LoraSpec
    from tpu_runtime.families.wan.model import WanFamily

    frames, report = _job(eight_devices, "wan_lora")
    assert report["same_shardings"] and report["split_weights"] > 0 and report["touched"] > 0, report
    family = WanFamily(four_head_wan, dtype="float32")
    emb = family.encode("a panda playing a guitar", "blurry, low quality")
    settings = SampleSettings(64, 128, 9, steps=2, guidance=6.0, seed=4,
                              loras=(LoraSpec(str(wan_lora), LORA_STRENGTH),))
    single = family.decode(family.sample(emb, settings)).numpy()
    assert np.abs(frames["frames"] - single).max() < 1e-4


@pytest.mark.parametrize("generation", ["2.3", "2.0"])
def test_ltx2_text_encode_split_over_tp_matches_one_device(tiny_ltx2, eight_devices, generation):
    """LTX-2's text encode with Gemma's token embedding and the text connectors split over tp gives the one-device
    prompt streams. The tiny 2.3's connectors have 2 heads (tp=2 divides them: Megatron), the tiny 2.0's 3 (it
    does not: their attention split by input, their feed-forward by Megatron); the input projections from Gemma's
    stacked states by input."""
    from tpu_runtime.families.ltx2.model import LTX2Family

    meshes = ["dp=2,sp=2,tp=2"]
    folder = tiny_ltx2[generation]
    streams, report = _job(eight_devices, f"ltx2_{generation}")
    alone = LTX2Family(folder, dtype="float32").encode("a panda playing a guitar", "blurry, low quality")
    for mesh in meshes:
        key = mesh_key(mesh)
        for suffix, want in (("", alone.prompt_embeds), ("_negative", alone.negative_prompt_embeds),
                             ("_audio", alone.audio_prompt_embeds)):
            assert np.abs(streams[key + suffix] - want.numpy()).max() < 1e-5, (mesh, suffix)
        specs = report[mesh]
        assert specs["text_encoder.embed_tokens.weight"] == [None, "tp"], specs
        projection = "connectors.video_text_proj_in.weight" if generation == "2.3" else "connectors.text_proj_in.weight"
        assert specs[projection] == [None, "tp"], specs
        block = "connectors.video_connector.transformer_blocks.0."
        megatron = generation == "2.3"
        assert specs[block + "attn1.to_q.weight"] == (["tp", None] if megatron else [None, "tp"]), specs
        assert specs[block + "ff.net.0.proj.weight"] == ["tp", None], specs
        assert specs[block + "ff.net.2.weight"] == [None, "tp"], specs
