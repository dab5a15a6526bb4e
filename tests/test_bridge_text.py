"""TPU Text Encoder: ComfyUI's own text encoders (umT5 as Wan loads it, T5-XXL as LTX-Video does, Qwen 2.5 as
ComfyUI's LLaMA-style model, CLIP-L), made as ComfyUI's loader makes them at a reduced configuration, encode through
ComfyUI's CLIPTextEncode on the runtime and equal ComfyUI's native CPU run (float32, 1e-4 relative). Programs are
counted per text model: one per padded prompt length and batch. (8 simulated devices: test_bridge_vae.py's mesh
test runs the text encoder too.)"""

import pytest
import torch
from comfy_native import comfyui_session, versions_param, load_pack, relative

TOL = 1e-4
PROMPTS = ("a cat", "a dog running on the beach at sunset, cinematic")


@pytest.fixture(scope="module", params=versions_param())
def pack(request):
    with comfyui_session(request.param), torch.inference_mode():  # ComfyUI runs its nodes in inference mode
        yield load_pack()


@pytest.fixture(scope="module")
def encoders(pack):
    from tpu_runtime.bridge.tiny import tiny_text_encoder

    built = {}

    def get(kind: str, **options):
        key = (kind, tuple(sorted(options.items())))
        if key not in built:
            built[key] = tiny_text_encoder(kind, seed=len(built) + 1, **options)
        return built[key]

    return get


def tpu_text(pack, clip, **inputs):
    """The TPU Text Encoder node applied to ``clip``."""
    return pack.NODE_CLASS_MAPPINGS["TPUTextEncoder"]().apply(clip, **inputs)[0]


def text_models(clip) -> dict:
    from tpu_runtime.bridge.text import bridged_text_models

    return bridged_text_models(clip)


def encode(clip, text):
    """CLIPTextEncode's conditioning: (cond, pooled output or None)."""
    import nodes

    cond, extra = nodes.CLIPTextEncode().encode(clip, text)[0][0]
    return cond, extra.get("pooled_output")


def assert_equal_native(clip, on_tpu, text):
    cond, pooled = encode(clip, text)
    cond_tpu, pooled_tpu = encode(on_tpu, text)
    assert cond_tpu.shape == cond.shape
    assert relative(cond_tpu, cond) < TOL, text
    if pooled is not None:
        assert relative(pooled_tpu, pooled) < TOL, text


# kind -> programs for the two prompts: T5s pad every prompt to one length (umT5 512, LTX-Video's T5 128) and never
# read the prompt's token count; Qwen's tokenizer does not pad (a program per length); CLIP-L pads to 77 but reads
# the token count for its pooled output (a program per count).
PROGRAMS = {"umt5": 1, "t5xxl": 1, "qwen25_3b": 2, "clip_l": 2}


@pytest.mark.parametrize("kind", list(PROGRAMS))
def test_text_encoders_equal_native(pack, encoders, kind):
    clip = encoders(kind)
    on_tpu = tpu_text(pack, clip)
    for text in PROMPTS:
        assert_equal_native(clip, on_tpu, text)
    (model,) = text_models(on_tpu).values()
    assert model.stats.programs == PROGRAMS[kind]
    again = model.stats.calls
    assert_equal_native(clip, on_tpu, PROMPTS[0])  # a prompt seen before compiles nothing
    assert model.stats.programs == PROGRAMS[kind] and model.stats.calls == again + 1


def test_one_program_per_padded_length_not_per_prompt(pack, encoders):
    from tpu_runtime.engine.runtime import compile_stats

    clip = encoders("umt5")
    on_tpu = tpu_text(pack, clip)
    encode(on_tpu, PROMPTS[0])
    before = compile_stats().xla_compiles
    for text in ("a red fox in the snow", "two birds", "an astronaut rides a horse on the moon, cinematic lighting"):
        assert_equal_native(clip, on_tpu, text)
    assert compile_stats().xla_compiles == before
    # ComfyUI's prompt weights add an unweighted copy of the prompt to the batch: a batch of two, its own program
    assert_equal_native(clip, on_tpu, "(a red fox:1.3) in the snow")
    (model,) = text_models(on_tpu).values()
    assert model.stats.programs == 2


def test_the_embedding_stays_on_the_host(pack, encoders):
    clip = encoders("umt5")
    on_tpu = tpu_text(pack, clip)
    encode(on_tpu, PROMPTS[0])
    (model,) = text_models(on_tpu).values()
    assert "shared.weight" not in model.state  # ComfyUI looks the tokens up on the host and passes embeddings
    assert "encoder.block.0.layer.0.SelfAttention.q.weight" in model.state
    assert model.rules.name == "T5"


# ComfyUI 0.33 loads a scaled fp8 text encoder as QuantizedTensors (its own conversion of the file, not the builder's
# ``scaled_fp8`` option): test_bridge_quant.py covers that file there.
@pytest.mark.comfy_versions("0.3.")
def test_fp8_weights_stay_fp8_on_the_devices(pack, encoders):
    clip = encoders("umt5", fp8=True)
    weight = clip.cond_stage_model.umt5xxl.transformer.encoder.block[0].layer[0].SelfAttention.q.weight
    assert weight.dtype == torch.float8_e4m3fn  # as ComfyUI holds a scaled fp8 file
    on_tpu = tpu_text(pack, clip)
    for text in PROMPTS:
        assert_equal_native(clip, on_tpu, text)
    (model,) = text_models(on_tpu).values()
    assert str(model.state["encoder.block.0.layer.0.SelfAttention.q.weight"].dtype) == "float8_e4m3fn"


def _lora(clip, seed: int, rank: int = 4) -> dict:
    """A LoRA in ComfyUI's generic text-encoder key format for every attention projection of the text model."""
    g = torch.Generator().manual_seed(seed)
    lora = {}
    for name, weight in clip.cond_stage_model.state_dict().items():
        if ".SelfAttention." in name and name.endswith(".weight") and weight.ndim == 2:
            key = "text_encoders." + name[: -len(".weight")]
            lora[f"{key}.lora_up.weight"] = torch.randn(weight.shape[0], rank, generator=g) * 0.3
            lora[f"{key}.lora_down.weight"] = torch.randn(rank, weight.shape[1], generator=g) * 0.3
    return lora


def test_lora_after_the_node_is_followed(pack, encoders):
    import comfy.sd

    clip = encoders("umt5")
    on_tpu = tpu_text(pack, clip)
    lora = _lora(clip, seed=5)
    plain = encode(clip, PROMPTS[1])[0]
    (model,) = text_models(on_tpu).values()
    encode(on_tpu, PROMPTS[1])
    programs, refreshes = model.stats.programs, model.stats.weight_refreshes
    for strength in (0.7, 1.2):
        native = encode(comfy.sd.load_lora_for_models(None, clip, lora, 0.0, strength)[1], PROMPTS[1])[0]
        assert relative(native, plain) > 1e-2  # the LoRA changes the result
        patched = comfy.sd.load_lora_for_models(None, on_tpu, lora, 0.0, strength)[1]
        assert relative(encode(patched, PROMPTS[1])[0], native) < TOL
    assert model.stats.weight_refreshes - refreshes >= 2  # each strength re-placed the patched weights
    assert model.stats.programs == programs  # and compiled nothing
    assert relative(encode(on_tpu, PROMPTS[1])[0], plain) < TOL  # without the LoRA again


def test_unload_models_releases_the_text_encoder(pack, encoders):
    import comfy.model_management as mm

    clip = encoders("t5xxl")
    on_tpu = tpu_text(pack, clip)
    first = encode(on_tpu, PROMPTS[0])[0]
    (model,) = text_models(on_tpu).values()
    assert model.state is not None
    mm.unload_all_models()
    assert model.state is None
    assert relative(encode(on_tpu, PROMPTS[0])[0], first) < 1e-6
    assert model.stats.programs == 1


def test_bad_inputs_are_named_before_any_encode(pack, encoders):
    from tpu_runtime.errors import InputError

    with pytest.raises(InputError, match="mesh dp=1,sp=1,tp=8 uses 8 devices"):
        tpu_text(pack, encoders("umt5"), mesh="dp=1,sp=1,tp=8")
    with pytest.raises(InputError, match="mesh axis 'xp' is not one of"):
        tpu_text(pack, encoders("umt5"), mesh="xp=1")
    with pytest.raises(InputError, match="the clip input holds a str"):
        tpu_text(pack, "not a clip")


@pytest.mark.comfy_versions("0.33")
@pytest.mark.parametrize("variant", ["gemma4_12b_with_projection", "gemma4_e2b"])
def test_gemma4_equals_native(pack, tmp_path, variant):
    """Gemma 4 as LTX-2.5 loads it (ComfyUI 0.33's ``comfy.text_encoders.gemma4``, tiny, int8 ConvRot files): the 12B
    encoder with LTX's projection, whose tokenizer pads every prompt to 1024 tokens (the sliding layers' window: their
    keys are repeated over the query heads, the program XLA's CPU YNNPACK fusions miscomputed), and E2B. TPU Text
    Encoder runs them and equals ComfyUI's own run."""
    import comfy.sd

    from tpu_runtime.bridge import tiny

    path = tmp_path / f"{variant}.safetensors"
    with tiny.gemma4_reduced():
        getattr(tiny, f"save_{variant}")(path, seed=3)
        kind = comfy.sd.CLIPType.LTXV if "12b" in variant else comfy.sd.CLIPType.STABLE_DIFFUSION
        clip = comfy.sd.load_clip([str(path)], clip_type=kind)
        on_tpu = tpu_text(pack, clip)
        for text in PROMPTS:
            assert_equal_native(clip, on_tpu, text)
    (model,) = text_models(on_tpu).values()
    assert type(model.module).__module__ == "comfy.text_encoders.gemma4"
