"""The first process of a two-process slice running ComfyUI's own sampling through TPU Diffusion Model and a Wan
VAE's chunked decode through TPU VAE (the workers run `python -m tpu_runtime worker` and never import ComfyUI); it
also samples and decodes natively, and prints one JSON line.

usage: python bridge_slice_job.py MODEL_FILE MESH [MESH ...]   (the ComfyUI tree: $TPU_VIDEO_COMFYUI or the default)
"""

import json
import sys

import torch
from comfy_native import comfyui_session, load, load_pack, relative, sample


def main():
    path, meshes = sys.argv[1], sys.argv[2:]
    with comfyui_session():
        pack = load_pack()
        from tpu_runtime.engine.runtime import get_runtime

        runtime = get_runtime()
        g = torch.Generator().manual_seed(1)
        positive = [[torch.randn(1, 12, 4096, generator=g), {}]]
        negative = [[torch.randn(1, 12, 4096, generator=g), {}]]
        latent = torch.zeros(1, 16, 3, 8, 8)
        model = load(path)
        native = sample(model, latent, positive, negative, cfg=4.0)
        report = {"processes": runtime.slice.processes if runtime.slice else 1, "devices": len(runtime.devices),
                  "meshes": {}}
        for mesh in meshes:
            on_tpu = pack.NODE_CLASS_MAPPINGS["TPUDiffusionModel"]().apply(model, mesh=mesh)[0]
            out = sample(on_tpu, latent, positive, negative, cfg=4.0)
            again = sample(on_tpu, latent, positive, negative, cfg=4.0, seed=7)  # a new seed: nothing compiles
            bridged = next(v for k, v in on_tpu.object_patches.items() if k.startswith("diffusion_model.")).bridged
            report["meshes"][mesh] = {"relative": relative(out, native), "calls": bridged.stats.calls,
                                      "programs": bridged.stats.programs, "finite": bool(again.isfinite().all())}
        report["vae"] = decode_on_the_slice(pack)
        from tpu_runtime.bridge import auto

        automatic = auto.on_runtime("model", model, "UNETLoader")  # the automatic mode's path for a loader's MODEL
        out = sample(automatic, latent, positive, negative, cfg=4.0)
        bridged = next(v for k, v in automatic.object_patches.items() if k.startswith("diffusion_model.")).bridged
        report["automatic"] = {"relative": relative(out, native), "calls": bridged.stats.calls}
    print("REPORT " + json.dumps(report), flush=True)


def decode_on_the_slice(pack) -> dict:
    """A causal Wan VAE decodes chunk by chunk with its caches kept on the devices of both processes."""
    import nodes

    from tpu_runtime.bridge.tiny import tiny_vae
    from tpu_runtime.bridge.vae import bridged_parts

    vae = tiny_vae("wan2.1", seed=4)
    latents = torch.randn(1, vae.latent_channels, 5, 4, 4, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        native = nodes.VAEDecode().decode(vae, {"samples": latents})[0]
        on_tpu = pack.NODE_CLASS_MAPPINGS["TPUVAE"]().apply(vae, mesh="dp=1,sp=2,tp=4")[0]
        out = nodes.VAEDecode().decode(on_tpu, {"samples": latents})[0]
    decoder = bridged_parts(on_tpu)["decoder.forward"]
    return {"relative": relative(out, native), "calls": decoder.stats.calls, "programs": decoder.stats.programs,
            "label": decoder.label}


if __name__ == "__main__":
    main()
