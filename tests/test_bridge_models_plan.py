"""plan --comfy-model for ComfyUI 0.33's LTX-2 19B, LTX-2.3 22B, HunyuanVideo 1.5 and MiniMax H3: their released configs build
ComfyUI's classes at the released sizes, the bridge's rule tables split their big matrices Megatron-style (the audio
stream and the text connectors of LTX-2 too), and their steps compile for a v6e-8 (checked on reduced configs of the
same classes: the released-size compiles take minutes; their rows are in docs/plan.md)."""

import dataclasses
import re

import pytest
from comfy_native import comfyui_session

RELEASED = {  # name: (rule table, parameters in billions: ComfyUI's diffusion model, without the text projection)
    "ltx2-19b": ("LTX-2", 19.4, 19.8),
    "ltx2.3-22b": ("LTX-2", 20.8, 21.2),  # + Gemma's 1.16B per-stream text projection, held by the text encoder
    "hunyuanvideo1.5": ("HunyuanVideo", 8.2, 8.4),
    "minimax-h3": ("MiniMax H3", 19.5, 21.0),  # the pruned (curve) form its templates load (a 19.5 GB int8 file)
}
# The matrices the rules leave whole on purpose: timestep modulation and embedding tables, small projections.
WHOLE = re.compile(r"adaln|adaLN|scale_shift|_mod\.|embedder|time_in|caption_projection|patchify|proj_out|"
                   r"final_layer|byt5_in|vision_in|img_in|learnable_registers|to_gate_logits|condition_proj|"
                   r"patch_proj")


@pytest.fixture(scope="module")
def comfy():
    with comfyui_session("0.33.0"):
        yield


@pytest.mark.parametrize("name", list(RELEASED))
def test_the_rules_split_the_big_matrices(comfy, name):
    from tpu_runtime.bridge.architectures import architecture, parameter_count
    from tpu_runtime.bridge.rules import placement_specs, rule_coverage, rules_for

    rules_name, low, high = RELEASED[name]
    module = architecture(name).build()
    assert low * 1e9 < parameter_count(module) < high * 1e9
    rules = rules_for(module)
    assert rules.name == rules_name
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    specs = placement_specs(shapes, rules, {"dp": 1, "sp": 1, "tp": 8})
    left = [n for n, s in shapes.items() if len(s) == 2 and s[0] * s[1] >= 1 << 20 and not any(specs[n])
            and not WHOLE.search(n)]
    assert not left, left[:5]
    coverage = rule_coverage(shapes, rules)
    assert coverage["split"] > 0.97 * (coverage["split"] + coverage["whole"])
    assert rules.auto_mesh(module, 8).tp == 8  # 32 (LTX-2), 16 (HunyuanVideo 1.5) or 56 (MiniMax H3) heads on tp
    if rules_name == "LTX-2":  # the audio stream and the streams' attention to each other, Megatron-style
        for block in ("attn1", "audio_attn1", "audio_to_video_attn", "video_to_audio_attn"):
            assert specs[f"transformer_blocks.0.{block}.to_q.weight"] == ("tp", None)
            assert specs[f"transformer_blocks.0.{block}.to_out.0.weight"] == (None, "tp")
        assert specs["transformer_blocks.0.audio_ff.net.0.proj.weight"] == ("tp", None)
        assert specs["audio_embeddings_connector.transformer_1d_blocks.0.ff.net.2.weight"] == (None, "tp")


# Reduced configs of the released ones (1 block, fewer heads): the same classes and options, a short compile.
REDUCED = {
    "ltx2-19b": dict(num_attention_heads=8, attention_head_dim=64, audio_num_attention_heads=8,
                     audio_attention_head_dim=32, cross_attention_dim=512, audio_cross_attention_dim=256,
                     caption_channels=256, connector_num_attention_heads=2),
    "ltx2.3-22b": dict(num_attention_heads=8, attention_head_dim=64, audio_num_attention_heads=8,
                       audio_attention_head_dim=32, cross_attention_dim=512, audio_cross_attention_dim=256,
                       caption_channels=256, connector_num_attention_heads=8, connector_attention_head_dim=64,
                       audio_connector_num_attention_heads=8, audio_connector_attention_head_dim=32),
    "hunyuanvideo1.5": dict(hidden_size=1024, num_heads=8, context_in_dim=256),
    "minimax-h3": dict(hidden_size=512, num_attention_heads=8, attention_head_dim=64, ffn_hidden_size=1024,
                       text_dim=256, time_embed_dim=128, rope_inv_freq_len=8),
}


@pytest.mark.parametrize("name", list(REDUCED))
def test_a_reduced_step_compiles_for_v6e8(comfy, monkeypatch, name):
    from tpu_runtime.bridge import architectures
    from tpu_runtime.tools.plan_native import format_native_report, plan_native

    released = architectures.architecture(name)
    config = {**released.config, **REDUCED[name]}
    width = 2 * config["caption_channels"] if name == "ltx2-19b" else (
        config["cross_attention_dim"] + config["audio_cross_attention_dim"] if released.audio
        else config.get("context_in_dim", config.get("hidden_size")))
    reduced = dataclasses.replace(released, name=f"{name}-reduced", config=config, text=(64, width))
    monkeypatch.setitem(architectures.ARCHITECTURES, reduced.name, reduced)
    frames = 22 if name == "minimax-h3" else 9  # MiniMax H3: 17N+5 frames
    report = plan_native(reduced.name, None, "v6e-8", height=64, width=64, frames=frames, layers=1, compare=False)
    step = report.step
    assert step.compiled, step.error
    assert report.fits and report.mesh == "dp=1,sp=1,tp=8"  # 8 heads on tp
    if name == "minimax-h3":  # one packed sequence: one splash attention a block (the token refiner runs once a
        # sampling run, in a program of its own); Megatron's all-reduces, the adaLN split on its input; batch 1, a CFG
        # step two calls of it
        assert step.mosaic_kernels == 1 and step.all_gathers == 0 and step.all_reduces >= 3
        assert report.time_bound.calls_per_step == 2 and "two calls a CFG step" in report.step.describe
    elif released.audio:  # six splash attentions a block: video self and text, audio self and text, a2v, v2a;
        # Megatron's all-reduces (attention out and feed-forward out of both streams), no weight gathered
        assert step.mosaic_kernels == 6 and step.all_gathers == 0 and step.all_reduces >= 6
    else:  # the joint attention of the double block, the text refiner's two blocks; the modulations split on
        # their input: no collective-permute (split on their output, the modulation vector's parts moved around)
        assert step.mosaic_kernels == 3 and step.all_reduces >= 2 and step.collective_permutes == 0
    assert any(name in report.rules for name in ("LTX-2", "HunyuanVideo", "MiniMax H3"))
    assert "FITS" in format_native_report(report)


def test_the_original_hunyuanvideo_builds_with_0_33s_class(comfy):
    """0.33's HunyuanVideo class requires HunyuanVideo 1.5's options: plan passes them off for the original model."""
    from tpu_runtime.bridge.architectures import architecture

    module = architecture("hunyuanvideo").build(layers=1)
    assert module.vision_in is None and module.cond_type_embedding is None
