"""TPU Audio Encoder and the automatic mode's audio encoder part: ComfyUI's own wav2vec2 (what Wan 2.2 S2V and
InfiniteTalk read), made by Load Audio Encoder's own loader from a tiny random-weight file, encodes a clip on the
runtime equal to ComfyUI's native CPU run (every hidden state, 1e-4), one program per clip length; a bad input is
named before anything runs."""

import logging

import pytest
import torch
from comfy_native import comfyui_session, load_pack, relative, versions_param

TOL = 1e-4


@pytest.fixture(scope="module", params=versions_param())
def pack(request):
    with comfyui_session(request.param), torch.inference_mode():  # ComfyUI runs its nodes in inference mode
        yield load_pack()


def audio_encoder(tmp_path, released_width: int, seed: int):
    """The AUDIO_ENCODER Load Audio Encoder gives for a tiny wav2vec2 file standing for a released one."""
    import comfy.audio_encoders.audio_encoders as audio_encoders
    import comfy.utils

    from tpu_runtime.bridge import tiny

    path = tiny.save_wav2vec2(tmp_path / f"wav2vec2_{released_width}.safetensors", seed, released_width)
    original = audio_encoders.load_audio_encoder_from_sd
    tiny.shrink_wav2vec2()
    try:
        return audio_encoders.load_audio_encoder_from_sd(comfy.utils.load_torch_file(str(path)))
    finally:
        audio_encoders.load_audio_encoder_from_sd = original


def clip(seconds: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, int(44100 * seconds), generator=g) * 0.2  # stereo at 44.1 kHz: ComfyUI resamples it


@pytest.mark.parametrize("released_width", [1024, 768])  # S2V's English large, InfiniteTalk's Chinese base
def test_tpu_audio_encoder_equals_native_every_hidden_state(pack, tmp_path, released_width):
    from tpu_runtime.bridge.audio_encoder import bridged_audio_models

    encoder = audio_encoder(tmp_path, released_width, seed=3)
    on_tpu = pack.NODE_CLASS_MAPPINGS["TPUAudioEncoder"]().apply(encoder)[0]
    for seconds, seed in ((0.5, 1), (0.5, 2), (0.7, 3)):
        waveform = clip(seconds, seed)
        native, ours = encoder.encode_audio(waveform, 44100), on_tpu.encode_audio(waveform, 44100)
        assert ours["audio_samples"] == native["audio_samples"]
        assert relative(ours["encoded_audio"], native["encoded_audio"]) < TOL
        assert len(ours["encoded_audio_all_layers"]) == len(native["encoded_audio_all_layers"]) == 3
        for layer, expected in zip(ours["encoded_audio_all_layers"], native["encoded_audio_all_layers"]):
            assert relative(layer, expected) < TOL
    (bridged,) = bridged_audio_models(on_tpu).values()
    assert bridged.label == "Wav2Vec2Model" and bridged.stats.calls == 3 and bridged.stats.programs == 2


def test_the_automatic_mode_takes_load_audio_encoders_output(pack, tmp_path, caplog):
    import comfy_extras.nodes_audio_encoder as audio_nodes
    import execution

    from tpu_runtime.bridge import auto

    assert auto.loader_slots(audio_nodes.AudioEncoderLoader) == {0: "audio_encoder"}
    encoder = audio_encoder(tmp_path, 1024, seed=4)
    auto._state.started = frozenset({"audio_encoder"})
    try:
        assert auto.install(execution)
        with caplog.at_level(logging.INFO, logger="tpu_runtime.bridge.auto"):
            output, _, _ = execution.get_output_from_returns([(encoder,)], audio_nodes.AudioEncoderLoader)
    finally:
        auto._state.started = frozenset()
    assert "Wav2Vec2Model from AudioEncoderLoader runs on the TPU runtime (audio_encoder" in caplog.text
    waveform = clip(0.5, 5)
    ours = output[0][0].encode_audio(waveform, 44100)["encoded_audio"]
    assert relative(ours, encoder.encode_audio(waveform, 44100)["encoded_audio"]) < TOL


def test_a_bad_input_is_named(pack):
    from tpu_runtime.errors import InputError

    with pytest.raises(InputError, match="audio_encoder input holds a str.*Load Audio Encoder"):
        pack.NODE_CLASS_MAPPINGS["TPUAudioEncoder"]().apply("wav2vec2_large_english_fp16.safetensors")
