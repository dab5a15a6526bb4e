"""TPU VAE and TPU Text Encoder in a process of their own (meshes need XLA_FLAGS before JAX starts): a tiny Wan VAE
decodes and a tiny umT5 encodes natively and through the nodes on each mesh; prints one JSON line.

usage: python bridge_vae_text_worker.py [--comfy VERSION] MESH [MESH ...]
       (a MESH is "auto" or "dp=N,sp=N,tp=N"; VERSION one of comfy_native.COMFYUI_TREES, default its default tree)
"""

import json
import sys

import torch
from comfy_native import comfyui_session, load_pack, relative


def main():
    meshes = sys.argv[1:]
    version = None
    if meshes[:1] == ["--comfy"]:
        version, meshes = meshes[1], meshes[2:]
    with comfyui_session(version), torch.inference_mode():
        pack = load_pack()
        import comfy.ldm.wan.vae as wan_vae
        import comfyui_version
        import nodes

        from tpu_runtime.bridge.text import bridged_text_models
        from tpu_runtime.bridge.tiny import tiny_text_encoder, tiny_vae
        from tpu_runtime.bridge.vae import bridged_parts

        vae, clip = tiny_vae("wan2.1", seed=3), tiny_text_encoder("umt5", seed=4)
        z = torch.randn(1, 16, 3, 8, 8, generator=torch.Generator().manual_seed(5))
        native_frames = nodes.VAEDecode().decode(vae, {"samples": z})[0]
        native_text = nodes.CLIPTextEncode().encode(clip, "a red fox in the snow")[0][0][0]
        report = {"devices": None, "comfyui": comfyui_version.__version__, "meshes": {}}
        # the length of the cache list ComfyUI gives the decoder (0.33 counts its downsampling slots too)
        slots = (getattr(wan_vae, "count_cache_layers", None) or wan_vae.count_conv3d)(vae.first_stage_model.decoder)
        for mesh in meshes:
            on_tpu = pack.NODE_CLASS_MAPPINGS["TPUVAE"]().apply(vae, mesh=mesh)[0]
            frames = nodes.VAEDecode().decode(on_tpu, {"samples": z})[0]
            decoder = bridged_parts(on_tpu)["decoder.forward"]
            cache = [None] * slots
            decoder(z[:, :, :1], feat_cache=cache, feat_idx=[0])  # the caches a first chunk leaves on the devices
            carried = next(v.array for v in cache if v is not None and not isinstance(v, str) and len(v.shape) == 5)
            text_on_tpu = pack.NODE_CLASS_MAPPINGS["TPUTextEncoder"]().apply(clip, mesh=mesh)[0]
            text = nodes.CLIPTextEncode().encode(text_on_tpu, "a red fox in the snow")[0][0][0]
            t5 = next(iter(bridged_text_models(text_on_tpu).values()))
            q = t5.state["encoder.block.0.layer.0.SelfAttention.q.weight"]
            report["devices"] = len(decoder.runtime.devices)
            report["meshes"][mesh] = {
                "vae_relative": relative(frames, native_frames),
                "vae_mesh": dict(decoder.mesh.shape),
                "decoder_programs": decoder.stats.programs,
                "cache_spec": [str(a) for a in carried.sharding.spec],
                "cache_shape": list(carried.shape),
                "cache_shard_shape": list(carried.addressable_shards[0].data.shape),
                "text_relative": relative(text, native_text),
                "text_mesh": dict(t5.mesh.shape),
                "text_programs": t5.stats.programs,
                "q_spec": [str(a) for a in q.sharding.spec],
                "q_shard_elements": int(q.addressable_shards[0].data.size),
                "q_elements": int(q.size),
                "embedding_placed": "shared.weight" in t5.state,
            }
    print("BRIDGE " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
