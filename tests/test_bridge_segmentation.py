"""SAM 3.1 (ComfyUI 0.33's segmentation and video tracking model, which SCAIL-2 and VACE inpainting templates load with
Load Checkpoint) through TPU Diffusion Model and the automatic mode: its image encoder runs on the runtime, its
detector, segmenter and tracker stay ComfyUI's on the host, and SAM3 Detect and SAM3 Video Track give ComfyUI's native
results. A tiny random-weight checkpoint in the released layout (``tiny.save_sam3``: the ViT trunk, the detector, the
multiplex tracker, the CLIP text encoder in open_clip's names), read by ComfyUI's own loader at the tiny sizes
``tiny.sam3_reduced`` makes it build."""

import logging

import pytest
import torch
from comfy_native import comfyui_session, load_pack, relative, versions_param

TOL = 1e-4


@pytest.fixture(scope="module", params=versions_param())
def pack(request):
    with comfyui_session(request.param):
        yield load_pack()


@pytest.fixture(scope="module")
def sam3(pack, tmp_path_factory):
    """(pack, SAM 3.1 MODEL, its CLIP, its VAE output) as Load Checkpoint gives them."""
    import comfy.sd

    from tpu_runtime.bridge import tiny

    path = tmp_path_factory.mktemp("sam3") / "sam3.1_multiplex_fp16.safetensors"
    with tiny.sam3_reduced():
        tiny.save_sam3(path, seed=3)
        loaded = comfy.sd.load_checkpoint_guess_config(str(path), output_vae=True, output_clip=True)[:3]
        with torch.inference_mode():  # ComfyUI runs its nodes in inference mode
            yield (pack, *loaded)


def frames(count: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(count, 64, 48, 3, generator=g)


@pytest.mark.comfy_versions("0.33")
def test_the_image_encoder_runs_on_the_runtime_and_detect_and_track_equal_native(sam3):
    import comfy_extras.nodes_sam3 as sam3_nodes
    import nodes

    from tpu_runtime.bridge.segmentation import TRUNK

    pack, model, clip, _ = sam3
    assert type(model.model.diffusion_model).__name__ == "SAM3Model"
    on_tpu = pack.NODE_CLASS_MAPPINGS["TPUDiffusionModel"]().apply(model)[0]
    assert list(k for k in on_tpu.object_patches if k.startswith("diffusion_model.")) == [
        f"diffusion_model.{TRUNK}.forward"]  # SAM 3's own forward (the detector's host decisions) is left alone
    encoder = on_tpu.object_patches[f"diffusion_model.{TRUNK}.forward"].bridged
    cond = nodes.CLIPTextEncode().encode(clip, "human")[0]
    video = frames(3, 1)

    options = dict(conditioning=cond, threshold=0.5, refine_iterations=1)  # one pass of the segmenter after detection
    native = sam3_nodes.SAM3_Detect.execute(model, video[:1], **options).result
    detected = sam3_nodes.SAM3_Detect.execute(on_tpu, video[:1], **options).result
    assert sum(map(len, native[1])) > 0  # the tiny detector finds something in each run, and the same
    assert [len(f) for f in detected[1]] == [len(f) for f in native[1]]
    boxes = lambda found: torch.tensor([[b[k] for k in ("x", "y", "width", "height", "score")]  # noqa: E731
                                        for frame in found for b in frame])
    assert relative(boxes(detected[1]), boxes(native[1])) < TOL
    assert torch.equal(detected[0], native[0])

    options = dict(conditioning=cond, detection_threshold=0.5, max_objects=4, detect_interval=1)
    native = sam3_nodes.SAM3_VideoTrack.execute(video, model, **options).result[0]
    tracked = sam3_nodes.SAM3_VideoTrack.execute(video, on_tpu, **options).result[0]
    assert native["scores"] and relative(torch.tensor(tracked["scores"]), torch.tensor(native["scores"])) < TOL
    assert tracked["packed_masks"].shape == native["packed_masks"].shape
    # masks are logits > 0 at 1008x1008: the encoder's float rounding (1e-6) may move a pixel or two across zero
    flipped = (tracked["packed_masks"] != native["packed_masks"]).float().mean().item()
    assert flipped < 1e-4, flipped
    # one program for every frame of both nodes (one frame a call, 1008x1008)
    assert encoder.label == "ViTDet" and encoder.stats.programs == 1 and encoder.stats.calls >= 2 + 3


@pytest.mark.comfy_versions("0.33")
def test_the_automatic_mode_takes_the_encoder_and_text_and_leaves_the_empty_vae(sam3, caplog):
    import execution
    import nodes

    from tpu_runtime.bridge import auto

    pack, model, clip, vae = sam3
    assert vae.first_stage_model is None  # SAM 3's checkpoint holds no VAE: ComfyUI's loader gives an empty one
    auto._state.started = frozenset(auto.PARTS)
    try:
        assert auto.install(execution)
        with caplog.at_level(logging.INFO, logger="tpu_runtime.bridge.auto"):
            output, _, _ = execution.get_output_from_returns([(model, clip, vae)], nodes.CheckpointLoaderSimple())
    finally:
        auto._state.started = frozenset()
    assert output[2][0] is vae and "stays on the host" not in caplog.text  # nothing to run, nothing to warn of
    assert "ViTDet from CheckpointLoaderSimple runs on the TPU runtime" in caplog.text
    assert "CLIPTextModel (sam3_clip) from CheckpointLoaderSimple runs on the TPU runtime" in caplog.text
    ours = nodes.CLIPTextEncode().encode(output[1][0], "human")[0]
    theirs = nodes.CLIPTextEncode().encode(clip, "human")[0]
    assert relative(ours[0][0], theirs[0][0]) < TOL
