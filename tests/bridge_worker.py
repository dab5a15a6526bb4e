"""The native bridge in a process of its own (meshes need XLA_FLAGS before JAX starts; a restart needs a new
process): samples a tiny ComfyUI Wan file natively and through TPU Diffusion Model, prints one JSON line.

usage: python bridge_worker.py MODEL_FILE MESH [MESH ...] [--generic] [--as-loaded]
A MESH is "auto" or "dp=N,sp=N,tp=N". --generic forgets the rule tables (the model gets the generic placement,
splitting every matrix of 1024 elements or more). --as-loaded: compute_dtype "as loaded" (a quantized file computes
in float32, as ComfyUI does here). The report gives the placement of every array of the first block.
"""

import json
import sys

import torch
from comfy_native import comfyui_session, load, load_pack, relative, sample


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    path, meshes = args[0], args[1:]
    with comfyui_session():
        pack = load_pack()
        from tpu_runtime.bridge import rules
        from tpu_runtime.engine.runtime import compile_stats

        if "--generic" in sys.argv:
            rules.KNOWN = ()
            rules.GENERIC_MIN_ELEMENTS = 1024
        g = torch.Generator().manual_seed(1)
        positive = [[torch.randn(1, 12, 4096, generator=g), {}]]
        negative = [[torch.randn(1, 12, 4096, generator=g), {}]]
        latent = torch.zeros(1, 16, 3, 8, 8)
        model = load(path)
        native = sample(model, latent, positive, negative, cfg=4.0)
        report = {"devices": None, "meshes": {}}
        for mesh in meshes:
            before = compile_stats()
            compute = "as loaded" if "--as-loaded" in sys.argv else "auto"
            on_tpu = pack.NODE_CLASS_MAPPINGS["TPUDiffusionModel"]().apply(model, mesh=mesh, compute_dtype=compute)[0]
            out = sample(on_tpu, latent, positive, negative, cfg=4.0)
            bridged = next(v for k, v in on_tpu.object_patches.items() if k.startswith("diffusion_model.")).bridged
            state = bridged.state
            q = state["blocks.0.self_attn.q.weight"]
            report["devices"] = len(bridged.runtime.devices)
            report["meshes"][mesh] = {
                "relative": relative(out, native),
                "mesh": dict(bridged.mesh.shape),
                "programs": bridged.stats.programs,
                "xla_compiles": compile_stats().since(before).xla_compiles,
                "q_spec": [str(a) for a in q.sharding.spec],
                "q_shard_elements": int(q.addressable_shards[0].data.size),
                "q_elements": int(q.size),
                "rules": bridged.rules.name,
                "block0": {k: {"spec": [str(a) for a in v.sharding.spec], "shape": list(v.shape),
                               "shard": list(v.addressable_shards[0].data.shape), "dtype": str(v.dtype)}
                           for k, v in state.items() if k.startswith("blocks.0.")},
            }
    print("BRIDGE " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
