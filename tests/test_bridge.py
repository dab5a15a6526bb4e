"""The native bridge (TPU Diffusion Model): ComfyUI's own diffusion models, loaded by ComfyUI's own loader and
sampled by ComfyUI's own samplers, run on the runtime and equal ComfyUI's native CPU run on the same weights
(float32, 1e-4 relative). Compiles are counted: the programs a bridged model built (``stats.programs``) and the
XLA compiles the process ran."""

import inspect

import pytest
import torch
from comfy_native import (
    comfyui_session, load, load_pack, relative, sample, save_diffusion_model, tiny_hunyuan_video, tiny_ltxv, tiny_wan,
    versions_param,
)

TOL = 1e-4
LATENT = torch.zeros(1, 16, 3, 8, 8)


@pytest.fixture(scope="module", params=versions_param())
def pack(request):
    with comfyui_session(request.param):
        yield load_pack()


@pytest.fixture(scope="module")
def files(pack, tmp_path_factory):
    base = tmp_path_factory.mktemp("native_models")
    return {
        "wan": save_diffusion_model(tiny_wan("t2v"), base / "wan_t2v.safetensors", seed=3),
        "wan_low": save_diffusion_model(tiny_wan("t2v"), base / "wan_t2v_low.safetensors", seed=4),
        "vace": save_diffusion_model(tiny_wan("vace"), base / "wan_vace.safetensors", seed=5),
        "i2v": save_diffusion_model(tiny_wan("i2v", in_dim=36), base / "wan_i2v.safetensors", seed=6),
    }


def conds(length=12, neg_length=12, seed=1, width=4096, **extra):
    g = torch.Generator().manual_seed(seed)
    return ([[torch.randn(1, length, width, generator=g), dict(extra)]],
            [[torch.randn(1, neg_length, width, generator=g), dict(extra)]])


def tpu(pack, model, **inputs):
    """The TPU Diffusion Model node applied to ``model``."""
    return pack.NODE_CLASS_MAPPINGS["TPUDiffusionModel"]().apply(model, **inputs)[0]


def bridged(model):
    """The bridged module behind a TPU node's output (or a clone of it)."""
    return next(v for k, v in model.object_patches.items() if k.startswith("diffusion_model.")).bridged


def xla_compiles():
    from tpu_runtime.engine.runtime import compile_stats

    return compile_stats().xla_compiles


@pytest.mark.parametrize("sampler,scheduler,cfg", [
    ("euler", "simple", 5.0), ("uni_pc", "simple", 5.0), ("dpmpp_2m", "karras", 5.0), ("res_multistep", "beta", 5.0),
    ("euler_ancestral", "normal", 5.0), ("dpmpp_2m_sde", "karras", 3.5), ("euler", "simple", 1.0),
])
def test_samplers_equal_native(pack, files, sampler, scheduler, cfg):
    model = load(files["wan"])
    positive, negative = conds()
    native = sample(model, LATENT, positive, negative, cfg=cfg, sampler=sampler, scheduler=scheduler)
    on_tpu = tpu(pack, model)
    out = sample(on_tpu, LATENT, positive, negative, cfg=cfg, sampler=sampler, scheduler=scheduler)
    assert relative(out, native) < TOL
    # cond and uncond of one length are one batch of two (CFG > 1), the cond alone at CFG 1: one program either way
    assert bridged(on_tpu).stats.programs == 1


def test_new_seed_prompt_cfg_sampler_steps_compile_nothing(pack, files):
    model = tpu(pack, load(files["wan"]))
    positive, negative = conds()
    sample(model, LATENT, positive, negative)
    before, programs = xla_compiles(), bridged(model).stats.programs
    positive2, negative2 = conds(seed=9)
    for kwargs in ({"seed": 7}, {"cfg": 3.0}, {"sampler": "uni_pc"}, {"steps": 6, "scheduler": "karras"}):
        sample(model, LATENT, positive2, negative2, **kwargs)
    assert bridged(model).stats.programs == programs == 1
    assert xla_compiles() == before


def test_prompts_of_different_lengths_are_two_programs(pack, files):
    model = load(files["wan"])
    positive, negative = conds(length=12, neg_length=7)
    native = sample(model, LATENT, positive, negative)
    on_tpu = tpu(pack, model)
    assert relative(sample(on_tpu, LATENT, positive, negative), native) < TOL
    assert bridged(on_tpu).stats.programs == 2  # ComfyUI calls cond and uncond apart when their shapes differ
    assert bridged(on_tpu).stats.calls == 8


def _lora(model, seed: int, rank: int = 4) -> dict:
    """A LoRA in ComfyUI's key format for every attention projection of ``model``'s blocks."""
    g = torch.Generator().manual_seed(seed)
    lora = {}
    for name, weight in model.model.diffusion_model.named_parameters():
        if ".self_attn." in name and name.endswith(".weight") and weight.ndim == 2:
            key = "diffusion_model." + name[: -len(".weight")]
            lora[f"{key}.lora_up.weight"] = torch.randn(weight.shape[0], rank, generator=g) * 0.2
            lora[f"{key}.lora_down.weight"] = torch.randn(rank, weight.shape[1], generator=g) * 0.2
    return lora


def _with_lora(model, lora, strength):
    import comfy.sd

    return comfy.sd.load_lora_for_models(model, None, lora, strength, 0)[0]


@pytest.mark.parametrize("where", ["before", "after"])
def test_lora_before_and_after_the_node(pack, files, where):
    model = load(files["wan"])
    lora = _lora(model, seed=11)
    positive, negative = conds()
    plain = sample(model, LATENT, positive, negative)
    on_tpu = tpu(pack, model) if where == "after" else None
    results = {}
    for strength in (0.6, 1.3):
        native = sample(_with_lora(model, lora, strength), LATENT, positive, negative)
        patched = (_with_lora(on_tpu, lora, strength) if where == "after"
                   else tpu(pack, _with_lora(model, lora, strength)))
        results[strength] = sample(patched, LATENT, positive, negative)
        assert relative(native, plain) > 1e-2  # the LoRA changes the result
        assert relative(results[strength], native) < TOL
    module = bridged(patched)
    assert module.stats.programs == 1  # a new strength re-places weights, compiles nothing
    assert module.stats.weight_refreshes >= 1
    # without the LoRA again: ComfyUI un-patches its host weights and the device copy follows
    unpatched = sample(on_tpu if where == "after" else tpu(pack, model), LATENT, positive, negative)
    assert relative(unpatched, plain) < TOL


def test_two_experts_keep_their_own_weights(pack, files):
    import comfy.sample

    high, low = load(files["wan"]), load(files["wan_low"])
    positive, negative = conds()
    latent = LATENT
    noise = comfy.sample.prepare_noise(latent, 5)

    def two_stage(first, second):
        # KSamplerAdvanced twice: steps 0-3 with noise added and the leftover noise returned, then 3-6 without noise
        mid = comfy.sample.sample(first, noise, 6, 4.0, "euler", "simple", positive, negative, latent, start_step=0,
                                  last_step=3, force_full_denoise=False, seed=5, disable_pbar=True)
        return comfy.sample.sample(second, noise, 6, 4.0, "euler", "simple", positive, negative, mid,
                                   disable_noise=True, start_step=3, last_step=6, force_full_denoise=True, seed=5,
                                   disable_pbar=True)

    native = two_stage(high, low)
    tpu_high, tpu_low = tpu(pack, high), tpu(pack, low)
    out = two_stage(tpu_high, tpu_low)
    assert relative(out, native) < TOL
    assert bridged(tpu_high) is not bridged(tpu_low)
    assert bridged(tpu_high).state is not None and bridged(tpu_low).state is not None
    assert bridged(tpu_high).stats.calls == 3 and bridged(tpu_low).stats.calls == 3


def test_vace_context_and_strength(pack, files):
    model = load(files["vace"])
    g = torch.Generator().manual_seed(3)
    frames = torch.randn(1, 32, 3, 8, 8, generator=g)
    mask = torch.rand(1, 64, 3, 8, 8, generator=g)
    for strength in (1.0, 0.5):
        positive, negative = conds(vace_frames=[frames], vace_mask=[mask], vace_strength=[strength])
        native = sample(model, LATENT, positive, negative)
        out = sample(tpu(pack, model), LATENT, positive, negative)
        assert relative(out, native) < TOL
    plain = sample(model, LATENT, *conds())
    assert relative(native, plain) > 1e-2


def test_image_to_video_clip_features_and_concat_latents(pack, files):
    from comfy.clip_vision import Output

    model = load(files["i2v"])
    g = torch.Generator().manual_seed(4)
    vision = Output()
    vision.penultimate_hidden_states = torch.randn(1, 257, 1280, generator=g)
    image = torch.randn(1, 16, 3, 8, 8, generator=g)
    mask = torch.ones(1, 1, 3, 8, 8)
    mask[:, :, :1] = 0.0
    positive, negative = conds(clip_vision_output=vision, concat_latent_image=image, concat_mask=mask)
    native = sample(model, LATENT, positive, negative)
    out = sample(tpu(pack, model), LATENT, positive, negative)
    assert relative(out, native) < TOL


def test_hunyuan_video_guidance_pooled_text_and_mask(pack, tmp_path):
    model = load(save_diffusion_model(tiny_hunyuan_video(), tmp_path / "hunyuan_video.safetensors", seed=7))
    g = torch.Generator().manual_seed(5)
    mask = torch.ones(1, 10, dtype=torch.int64)
    mask[:, 7:] = 0
    results = []
    for guidance in (6.0, 3.5):
        positive = [[torch.randn(1, 10, 64, generator=g), {"pooled_output": torch.randn(1, 768, generator=g),
                                                           "guidance": guidance, "attention_mask": mask}]]
        native = sample(model, LATENT, positive, [], cfg=1.0)
        on_tpu = tpu(pack, model)
        results.append(sample(on_tpu, LATENT, positive, [], cfg=1.0))
        assert relative(results[-1], native) < TOL


def test_ltx_video_frame_rate_mask_and_noise_mask(pack, tmp_path):
    import comfy.sample

    model = load(save_diffusion_model(tiny_ltxv(), tmp_path / "ltxv.safetensors", seed=8))
    g = torch.Generator().manual_seed(6)
    latent = torch.zeros(1, 128, 2, 4, 4)
    mask = torch.ones(1, 12, dtype=torch.int64)
    positive, negative = conds(length=12, neg_length=12, frame_rate=24, attention_mask=mask)
    native = sample(model, latent, positive, negative, cfg=3.0)
    on_tpu = tpu(pack, model)
    assert relative(sample(on_tpu, latent, positive, negative, cfg=3.0), native) < TOL
    # image to video: the first latent frame kept (noise mask 0 there): per-token timesteps
    noise_mask = torch.ones(1, 1, 2, 4, 4)
    noise_mask[:, :, 0] = 0.0
    start = torch.randn(1, 128, 2, 4, 4, generator=g)
    noise = comfy.sample.prepare_noise(start, 3)
    native = comfy.sample.sample(model, noise, 4, 3.0, "euler", "simple", positive, negative, start,
                                 noise_mask=noise_mask, seed=3, disable_pbar=True)
    out = comfy.sample.sample(on_tpu, noise, 4, 3.0, "euler", "simple", positive, negative, start,
                              noise_mask=noise_mask, seed=3, disable_pbar=True)
    assert relative(out, native) < TOL


def test_context_windows(pack, files):
    from comfy_extras.nodes_context_windows import WanContextWindowsManualNode

    model = load(files["wan"])
    latent = torch.zeros(1, 16, 6, 8, 8)
    positive, negative = conds()

    def windowed(m):  # 9 frames (3 latent frames) a window, 4 (1) overlapping, over 6 latent frames
        settings = dict(context_length=9, context_overlap=4, context_schedule="standard_static", context_stride=1,
                        closed_loop=False, fuse_method="pyramid", freenoise=False, retain_first_frame=False,
                        split_conds_to_windows=False)  # the later ones: newer ComfyUI's options, off
        accepted = inspect.signature(WanContextWindowsManualNode.execute).parameters
        return WanContextWindowsManualNode.execute(
            m, **{k: v for k, v in settings.items() if k in accepted}).result[0]

    shapes = set()  # the window shapes ComfyUI calls the model with (0.33 sizes its last window apart)

    def record(executor, x, *args, **kwargs):
        shapes.add(tuple(x.shape))
        return executor(x, *args, **kwargs)

    import comfy.patcher_extension

    probe = windowed(model).clone()
    probe.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "window_shapes", record)
    native = sample(probe, latent, positive, negative)
    assert relative(native, sample(model, latent, positive, negative)) > 1e-3  # windows change the result
    assert all(s[2] < latent.shape[2] for s in shapes)  # the model saw windows, never the whole latent
    for on_tpu in (windowed(tpu(pack, model)), tpu(pack, windowed(model))):  # the node before or after
        assert relative(sample(on_tpu, latent, positive, negative), native) < TOL
        module = bridged(on_tpu)
        assert module.stats.programs == len(shapes)  # one program per window shape, not per window


@pytest.mark.parametrize("cache", ["EasyCache", "LazyCache"])
def test_easycache_and_lazycache_skip_calls_alike(pack, files, cache):
    import comfy_extras.nodes_easycache as easycache

    node = getattr(easycache, f"{cache}Node")
    model = load(files["wan"])
    positive, negative = conds()

    def cached(m):
        return node.execute(m, 1.5, 0.15, 0.95, False).result[0]

    native = sample(cached(model), LATENT, positive, negative, steps=10)
    on_tpu = cached(tpu(pack, model))
    out = sample(on_tpu, LATENT, positive, negative, steps=10)
    assert relative(out, native) < TOL
    assert bridged(on_tpu).stats.calls < 10  # steps were skipped (each call is one CFG batch of two)


def _geqrf_block(args, extra):
    torch.geqrf(args["img"][0, :4, :4])  # an op torchax has no lowering for
    return {"img": extra["original_block"](args)["img"]}


def _python_branch_block(args, extra):
    if args["img"].abs().max() > 100:  # a Python branch on a value the model computes
        return {"img": args["img"]}
    return {"img": extra["original_block"](args)["img"]}


@pytest.mark.parametrize("patch,what", [(_geqrf_block, "the op aten::geqrf has no JAX lowering"),
                                        (_python_branch_block, "data-dependent Python control flow")])
def test_an_untraceable_model_is_named_and_still_runs_without_the_node(pack, files, patch, what):
    from tpu_runtime.bridge.program import UntraceableModel

    model = load(files["wan"]).clone()
    model.set_model_patch_replace(patch, "dit", "double_block", 0)
    positive, negative = conds()
    with pytest.raises(UntraceableModel) as refused:
        sample(tpu(pack, model), LATENT, positive, negative, steps=2)
    message = str(refused.value)
    assert "WanModel" in message and what in message and "test_bridge.py" in message
    assert sample(model, LATENT, positive, negative, steps=2).isfinite().all()  # the model without the node


def _fp8_file(model_module, path, seed, scaled: bool):
    """ComfyUI's fp8 file: every block matrix in float8_e4m3fn, with per-layer scales (``scale_weight``) and the
    ``scaled_fp8`` marker when ``scaled``."""
    from comfy_native import randomise
    from safetensors.torch import save_file

    state = {}
    for name, value in randomise(model_module, seed).items():
        key = "model.diffusion_model." + name
        if name.startswith("blocks.") and value.ndim == 2:
            scale = value.abs().max() / 448.0 if scaled else torch.tensor(1.0)
            state[key] = (value / scale).to(torch.float8_e4m3fn)
            if scaled:
                state[key[: -len("weight")] + "scale_weight"] = scale.float()
        else:
            state[key] = value
    if scaled:
        state["model.diffusion_model.scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    save_file(state, str(path))
    return path


def as_on_a_tpu(pack, model, monkeypatch):
    """TPU Diffusion Model's defaults as a TPU backend chooses them (compute_dtype auto: bfloat16 for fp8, quantized
    and half-precision files; on the CPU backend auto keeps ComfyUI's own float32); the program runs here."""
    from tpu_runtime.engine.runtime import get_runtime

    with monkeypatch.context() as patched:
        patched.setattr(get_runtime(), "backend", "tpu")
        return tpu(pack, model)


@pytest.mark.parametrize("scaled", [False, True])
def test_fp8_weights_stay_fp8_on_the_devices(pack, tmp_path, scaled, monkeypatch):
    path = _fp8_file(tiny_wan("t2v"), tmp_path / "wan_fp8.safetensors", seed=12, scaled=scaled)
    model = load(path, dtype=torch.float8_e4m3fn) if not scaled else load(path)
    positive, negative = conds()
    native = sample(model, LATENT, positive, negative)
    on_tpu = tpu(pack, model, compute_dtype="as loaded")
    assert relative(sample(on_tpu, LATENT, positive, negative), native) < TOL
    state = bridged(on_tpu).state
    assert str(state["blocks.0.self_attn.q.weight"].dtype) == "float8_e4m3fn"  # cast inside the program
    # auto on a TPU: computed in bfloat16 as ComfyUI computes fp8 weights on an accelerator
    import comfy.sample  # noqa: F401

    as_gpu = model.clone()
    as_gpu.add_object_patch("manual_cast_dtype", torch.bfloat16)
    reference = sample(as_gpu, LATENT, positive, negative)
    assert relative(sample(as_on_a_tpu(pack, model, monkeypatch), LATENT, positive, negative), reference) < 3e-2
    # auto on this machine's CPU backend: ComfyUI's own float32
    assert relative(sample(tpu(pack, model), LATENT, positive, negative), native) < TOL


def test_bf16_weights_compute_in_bf16(pack, files, monkeypatch):
    model = load(files["wan"], dtype=torch.bfloat16)
    assert model.model.manual_cast_dtype == torch.float32  # what --cpu chose: every layer cast up
    positive, negative = conds()
    as_gpu = model.clone()
    as_gpu.add_object_patch("manual_cast_dtype", None)
    reference = sample(as_gpu, LATENT, positive, negative)
    on_tpu = as_on_a_tpu(pack, model, monkeypatch)
    assert relative(sample(on_tpu, LATENT, positive, negative), reference) < 3e-2
    assert str(bridged(on_tpu).state["blocks.0.ffn.0.weight"].dtype) == "bfloat16"
    exact = tpu(pack, model, compute_dtype="as loaded")
    assert relative(sample(exact, LATENT, positive, negative), sample(model, LATENT, positive, negative)) < TOL


def test_cancel_stops_between_model_calls(pack, files):
    import comfy.model_management as mm
    import comfy.sample

    on_tpu = tpu(pack, load(files["wan"]))
    positive, negative = conds()
    noise = comfy.sample.prepare_noise(LATENT, 1)

    def press_cancel(step, *_):
        mm.interrupt_current_processing(True)  # what the server's Cancel does

    try:
        with pytest.raises(mm.InterruptProcessingException):
            comfy.sample.sample(on_tpu, noise, 6, 4.0, "euler", "simple", positive, negative, LATENT, seed=1,
                                callback=press_cancel, disable_pbar=True)
    finally:
        mm.interrupt_current_processing(False)
    assert bridged(on_tpu).stats.calls == 1  # the first step's call ran; the second was refused
    assert sample(on_tpu, LATENT, positive, negative).isfinite().all()  # and the next prompt runs


def test_unload_models_releases_the_device_copy(pack, files):
    import comfy.model_management as mm

    model = load(files["wan"])
    on_tpu = tpu(pack, model)
    positive, negative = conds()
    first = sample(on_tpu, LATENT, positive, negative)
    assert bridged(on_tpu).state is not None
    mm.unload_all_models()  # ComfyUI's "Unload Models" and POST /free
    assert bridged(on_tpu).state is None
    assert relative(sample(on_tpu, LATENT, positive, negative), first) < 1e-6  # placed again when used
    assert bridged(on_tpu).stats.programs == 1


def test_bench_times_the_three_stages_with_and_without_the_nodes(pack):
    """``bench --comfy-native``: a native Wan workflow's text encode, sampling and VAE decode, each natively and
    through its TPU node in one process; the first run of each compiles, later ones (a new seed, prompt or
    latents) compile nothing."""
    from tpu_runtime.tools.bench_native import bench_native, print_native_table

    # this process already runs the runtime (and its compilation cache): the first runs may load programs from it,
    # so the programs made are counted, and the XLA compiles of the later runs
    r = bench_native(None, height=32, width=32, frames=5, steps=2, repeats=1, dim=128, layers=1, text_tokens=16)
    assert r["programs"] == 1 and r["xla_compiles_per_generation"][1:] == [0]
    assert r["per_call_ms"]["calls"] == 2 and r["per_call_ms"]["program"] > 0
    for stage, programs in (("text_encode", 1), ("vae_decode", 2)):  # the decode: first and later latent frames
        assert r[stage]["programs_after_each_run"] == [programs, programs], (stage, r[stage])
        assert r[stage]["xla_compiles_per_run"][1:] == [0], (stage, r[stage])
        assert r[stage]["native_s"]["warm"] > 0 and r[stage]["bridged_s"]["warm"] > 0
    print_native_table(r)
