"""``bench --comfy-native``: a native Wan workflow's three stages — ComfyUI's own text encode (umT5), sampling
(WanModel) and VAE decode (the Wan 2.1 VAE) — natively and through TPU Text Encoder, TPU Diffusion Model and TPU
VAE, in one process on the same weights.

Reports wall times per generation (cold: the first, with its compiles; warm: a new seed), the XLA compiles each
generation ran, and per model call the time outside the compiled program (splitting the call, copying latents and
conditioning to the devices and the result back, dispatch) against the program's own run time. Without
``--comfy-file`` a tiny random-weight Wan file is built on the spot: the numbers measure the bridge's overheads
and compiles, not a real model's speed. The text encoder (umT5 at 4 layers of width 64) and the VAE (the Wan 2.1
VAE's layers at ``vae_width`` base channels) are tiny random-weight ones too, built with ComfyUI's own classes.

Also ``bench --restart``'s bridged models (``restart_scenarios``, run by ``restart.py`` in fresh processes): a
Wan-shaped ``WanModel`` and an LTX-2-shaped ``LTXAVModel`` (video with sound, its text connectors bridged too),
random weights, ``--restart-layers`` blocks, one euler step through TPU Diffusion Model.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path


def bench_native(comfy_dir: str | None, model_file: str | None = None, *, height: int = 64, width: int = 64,
                 frames: int = 9, steps: int = 8, cfg: float = 5.0, repeats: int = 2, text_tokens: int = 512,
                 dim: int = 256, layers: int = 4, text_and_vae: bool = True) -> dict:
    import torch

    from ..bridge.architectures import use_comfyui
    from ..bridge.comfy import BridgeSettings
    from ..bridge.diffusion import diffusion_model_on_runtime
    from ..engine.runtime import compile_stats, get_runtime, runtime_started
    from .bench import _machine

    use_comfyui(comfy_dir)
    import comfy.sample
    import comfy.sd

    work = Path(tempfile.mkdtemp(prefix="tpu_video_bench_native_"))
    # cold means compiled here: a fresh compilation cache, unless this process already runs the runtime (it has one)
    runtime = get_runtime() if runtime_started() else get_runtime(cache_dir=work / "xla_cache")
    if model_file is None:
        from ..bridge.tiny import save_diffusion_model, tiny_wan

        model_file = str(save_diffusion_model(tiny_wan("t2v", dim=dim, layers=layers), work / "wan.safetensors", 1))
        label = f"tiny random-weight ComfyUI WanModel (dim {dim}, {layers} layers)"
    else:
        label = model_file
    model = comfy.sd.load_diffusion_model(model_file)
    g = torch.Generator().manual_seed(0)
    width_text = model.model.diffusion_model.text_embedding[0].weight.shape[1]
    positive = [[torch.randn(1, text_tokens, width_text, generator=g), {}]]
    negative = [[torch.randn(1, text_tokens, width_text, generator=g), {}]]
    latent = torch.zeros(1, 16, (frames - 1) // 4 + 1, height // 8, width // 8)

    def generate(m, seed: int):
        noise = comfy.sample.prepare_noise(latent, seed)
        start = time.perf_counter()
        comfy.sample.sample(m, noise, steps, cfg, "euler", "simple", positive, negative, latent, seed=seed,
                            disable_pbar=True)
        return time.perf_counter() - start

    native = [generate(model, i) for i in range(repeats + 1)]
    bridged_model = diffusion_model_on_runtime(model, BridgeSettings())
    bridged = next(v for k, v in bridged_model.object_patches.items() if k.startswith("diffusion_model.")).bridged
    runs, compiles = [], []
    for i in range(repeats + 1):
        before = compile_stats()
        if i == 1:
            bridged.stats.reset()  # per-call figures from warm generations only
        runs.append(generate(bridged_model, i))
        compiles.append(compile_stats().since(before).xla_compiles)
    s = bridged.stats
    calls = max(s.calls, 1)
    stages = bench_text_and_vae(tuple(latent.shape), repeats) if text_and_vae else {}
    return {**stages,
        "machine": _machine(runtime), "model": label, "size": f"{width}x{height}x{frames}", "steps": steps,
        "cfg": cfg, "text_tokens": text_tokens,
        "native_s": {"cold": native[0], "warm": statistics.median(native[1:])},
        "bridged_s": {"cold": runs[0], "warm": statistics.median(runs[1:])},
        "xla_compiles_per_generation": compiles,
        "programs": bridged.program_count,
        "per_call_ms": {"calls": s.calls, "whole": 1e3 * s.call_seconds / calls,
                        "program": 1e3 * s.run_seconds / calls, "to_device": 1e3 * s.to_device_seconds / calls,
                        "to_host": 1e3 * s.to_host_seconds / calls,
                        "outside_program": 1e3 * (s.call_seconds - s.run_seconds) / calls},
    }


def _stage(run, native, on_runtime, repeats: int, bridged) -> dict:
    """``run(obj, i)`` timed on the native object and on the runtime's copy; compiles counted per run, and the
    programs the copy's bridged modules (``bridged()``) hold after each run."""
    from ..engine.runtime import compile_stats

    def timed(obj, i):
        start = time.perf_counter()
        run(obj, i)
        return time.perf_counter() - start

    natively = [timed(native, i) for i in range(repeats + 1)]
    runs, compiles, programs = [], [], []
    for i in range(repeats + 1):
        before = compile_stats()
        runs.append(timed(on_runtime, i))
        compiles.append(compile_stats().since(before).xla_compiles)
        programs.append(sum(b.program_count for b in bridged(on_runtime).values()))
    return {"native_s": {"cold": natively[0], "warm": statistics.median(natively[1:])},
            "bridged_s": {"cold": runs[0], "warm": statistics.median(runs[1:])}, "xla_compiles_per_run": compiles,
            "programs_after_each_run": programs}


def bench_text_and_vae(latent_shape: tuple[int, ...], repeats: int = 2, vae_width: int = 8) -> dict:
    """The text encode (a new prompt each run) and the VAE decode of ``latent_shape`` latents (new latents each run),
    natively and through TPU Text Encoder and TPU VAE."""
    import torch

    from ..bridge.comfy import BridgeSettings
    from ..bridge.text import bridged_text_models, text_encoder_on_runtime
    from ..bridge.tiny import tiny_text_encoder, tiny_vae
    from ..bridge.vae import bridged_parts, vae_on_runtime

    clip = tiny_text_encoder("umt5", seed=1, layers=4)
    prompts = ["a red fox running through snow", "a lighthouse at dusk, waves", "a cat on a piano, close-up"]

    def encode(c, i):  # what CLIPTextEncode does
        c.encode_from_tokens_scheduled(c.tokenize(prompts[i % len(prompts)]))

    vae = tiny_vae("wan2.1", width=vae_width)

    def decode(v, i):  # what VAEDecode does
        v.decode(torch.randn(latent_shape, generator=torch.Generator().manual_seed(i)))

    return {"text_encode": _stage(encode, clip, text_encoder_on_runtime(clip, BridgeSettings()), repeats,
                                  bridged_text_models),
            "vae_decode": _stage(decode, vae, vae_on_runtime(vae, BridgeSettings()), repeats, bridged_parts)}


def print_native_table(r: dict) -> None:
    m = r["machine"]
    print(f"bench --comfy-native: {r['model']} at {r['size']}, {r['steps']} euler steps, CFG {r['cfg']:g}, "
          f"{r['text_tokens']} text tokens")
    print(f"  on {m['backend']} ({m['devices']} device(s), {m['device_kind']}), {m['processor']}")
    print(f"  {'':<28}{'cold s':>9}{'warm s':>9}")
    print(f"  {'ComfyUI native (torch)':<28}{r['native_s']['cold']:>9.2f}{r['native_s']['warm']:>9.2f}")
    print(f"  {'TPU Diffusion Model':<28}{r['bridged_s']['cold']:>9.2f}{r['bridged_s']['warm']:>9.2f}"
          f"   warm ratio {r['bridged_s']['warm'] / r['native_s']['warm']:.2f} of native")
    print(f"  XLA compiles per generation: {r['xla_compiles_per_generation']} ({r['programs']} program(s))")
    c = r["per_call_ms"]
    print(f"  per model call (warm, {c['calls']} calls): {c['whole']:.2f} ms in all, the program "
          f"{c['program']:.2f} ms, outside it {c['outside_program']:.2f} ms (to the devices {c['to_device']:.2f}, "
          f"back {c['to_host']:.2f}, the rest splitting the call and dispatch)")
    for name, label in (("text_encode", "text encode (umT5, tiny)"), ("vae_decode", "VAE decode (Wan 2.1, tiny)")):
        s = r.get(name)
        if s:
            print(f"  {label:<28}native {s['native_s']['cold']:.2f} / {s['native_s']['warm']:.2f} s, TPU node "
                  f"{s['bridged_s']['cold']:.2f} / {s['bridged_s']['warm']:.2f} s (cold / warm); XLA compiles per "
                  f"run {s['xla_compiles_per_run']}, programs {s['programs_after_each_run'][-1]}")


# --- bench --restart: ComfyUI's own models in fresh processes (tools/restart.py) ------------------------------------
RESTART_WAN_DIM = 256  # the bridged Wan's width (2 heads of 128, as ComfyUI's detection reads them)


def restart_scenarios() -> dict:
    """``bench --restart``'s bridged models: name -> (label, ``run(folder, layers, generation, comfy_dir)``)."""
    return {"wan-bridge": ("Wan (ComfyUI WanModel, bridge)", _restart_wan),
            "ltx2-bridge": ("LTX-2 (ComfyUI LTXAVModel, bridge)", _restart_ltx2)}


def _comfy_imports(comfy_dir: str | None) -> None:
    from ..bridge.architectures import use_comfyui

    use_comfyui(comfy_dir)
    import comfy.sample  # noqa: F401 - ComfyUI's own start-up work (scipy and the samplers), before the clock
    import comfy.samplers  # noqa: F401
    import comfy.sd  # noqa: F401

    from ..bridge import comfy as _bridge, diffusion as _diffusion  # noqa: F401 - the bridge's imports too


def _first_step_on_runtime(model, latent, positive, negative, cfg: float) -> tuple[float, float, object]:
    """ComfyUI's KSampler for one euler step with ``model`` (ComfyUI's MODEL, just loaded) through TPU Diffusion
    Model: (seconds in all, seconds of the step's own program run, the latents)."""
    import comfy.sample

    from ..bridge.comfy import BridgeSettings
    from ..bridge.diffusion import diffusion_model_on_runtime

    start = time.perf_counter()
    on_runtime = diffusion_model_on_runtime(model, BridgeSettings())
    noise = comfy.sample.prepare_noise(latent, 0)
    out = comfy.sample.sample(on_runtime, noise, 1, cfg, "euler", "simple", positive, negative, latent, seed=0,
                              disable_pbar=True)
    seconds = time.perf_counter() - start
    diffusion = model.model.diffusion_model
    step = sum(p.bridged.stats.run_seconds for p in on_runtime.object_patches.values()
               if getattr(getattr(p, "bridged", None), "module", None) is diffusion)
    return seconds, step, out


def _restart_wan(folder: Path, layers: int, generation: str, comfy_dir: str | None) -> tuple:
    import torch

    _comfy_imports(comfy_dir)
    import comfy.sd

    from ..bridge.tiny import save_diffusion_model, tiny_wan

    path = folder / "wan.safetensors"
    if not path.exists():
        save_diffusion_model(tiny_wan("t2v", dim=RESTART_WAN_DIM, layers=layers), path, seed=3)
    g = torch.Generator().manual_seed(1)
    positive = [[torch.randn(1, 12, 4096, generator=g), {}]]
    negative = [[torch.randn(1, 12, 4096, generator=g), {}]]
    latent = torch.zeros(1, 16, 3, 8, 8)
    return _first_step_on_runtime(comfy.sd.load_diffusion_model(str(path)), latent, positive, negative, 5.0)


def _restart_ltx2(folder: Path, layers: int, generation: str, comfy_dir: str | None) -> tuple:
    import torch

    _comfy_imports(comfy_dir)
    try:
        import comfy.ldm.lightricks.av_model  # noqa: F401
        import comfy.nested_tensor
    except ImportError:
        return None, None, "this ComfyUI has no LTX-2 (0.33 or later has)"
    import comfy.sd

    from ..bridge.tiny import save_diffusion_model, tiny_ltxav

    path = folder / "ltx2.safetensors"
    if not path.exists():
        module, metadata = tiny_ltxav(num_layers=layers)
        save_diffusion_model(module, path, seed=11, metadata=metadata)
    g = torch.Generator().manual_seed(1)
    extra = {"frame_rate": 25, "unprocessed_ltxav_embeds": True}  # through the model's own text connectors
    positive = [[torch.randn(1, 7, 64, generator=g), dict(extra)]]
    negative = [[torch.randn(1, 9, 64, generator=g), dict(extra)]]
    latent = comfy.nested_tensor.NestedTensor((torch.zeros(1, 128, 2, 2, 2), torch.zeros(1, 8, 5, 16)))
    return _first_step_on_runtime(comfy.sd.load_diffusion_model(str(path)), latent, positive, negative, 3.0)
