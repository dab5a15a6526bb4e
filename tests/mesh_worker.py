"""Run in a subprocess with 8 simulated CPU devices: sample + decode on several meshes, report frames and HLO.
Works for CogVideoX and Wan folders alike.

usage: python mesh_worker.py MODEL_DIR OUT_NPZ HEIGHT WIDTH MESH [MESH ...]
       python mesh_worker.py --encode MODEL_DIR OUT_NPZ MESH [MESH ...]   (the text encode alone: prompt streams
       and each text-encoder weight's sharding)
A MESH may end in ":width" or ":replicated" (the VAE decode's layout; default auto, which is width on these 8
devices), ":fsdp" (split every weight matrix over dp as well), ":decode9" (also decode random latents of 9 latent
frames: CogVideoX's batch-by-batch decode), e.g. "dp=2,sp=1,tp=4:fsdp".
"""

import json
import re
import sys

import numpy as np
import torch

from tpu_runtime.engine.stages import SampleSettings, VideoLatents
from tpu_runtime.engine.runtime import compile_stats
from tpu_runtime.families import registry


def nine_latent_frames(shape):
    """Random latents of ``shape`` with 9 latent frames (the test makes the same ones)."""
    return torch.randn(shape[0], shape[1], 9, *shape[3:], generator=torch.Generator().manual_seed(9))


def main():
    model, out, height, width, *meshes = sys.argv[1:]
    height, width = int(height), int(width)
    frames, report = {}, {}
    for mesh in meshes:
        spec, *options = mesh.split(":")
        family = registry.open_model(model, dtype="float32", mesh=spec, fsdp="fsdp" in options,
                     vae_sharding=next((o for o in options if o in ("width", "replicated")), "auto"))
        emb = family.encode("a panda playing a guitar", "blurry, low quality")
        settings = SampleSettings(height, width, 9, steps=2, guidance=6.0, seed=4)
        latents = family.sample(emb, settings)
        frames[mesh] = family.decode(latents).numpy()
        if "decode9" in options:
            frames[mesh + ":decode9"] = family.decode(VideoLatents(nine_latent_frames(latents.latents.shape), height,
                                                                   width, 33, family.signature)).numpy()
        before = compile_stats()
        family.sample(family.encode("another prompt"), SampleSettings(height, width, 9, steps=3, guidance=5.0, seed=8))
        hlo = family.timings.programs["sample"].executable.as_text()
        report[mesh] = {
            "vae_sharding": family.vae_sharding,
            "decode_split_axes": [list(a) if isinstance(a, tuple) else a
                                  for a in family._vae_input_spec(tuple(latents.latents.shape))],
            "sample_compiles": family.timings.compiles["sample"],
            "recompiles_second_run": compile_stats().since(before).backend_compiles,
            "collectives": {op: len(re.findall(rf"= [^\n]*\b{op}(?:-start)?\(", hlo))
                            for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")},
            "all_gather_shapes": [[int(n) for n in dims.split(",") if n] for dims in
                                  re.findall(r"= \w+\[([\d,]*)\]\S* all-gather(?:-start)?\(", hlo)],
            "weight_shapes": sorted({tuple(p.shape) for p in family._parts["transformer"].parameters()}),
            "weights_split_on_dp": sum("dp" in str(a.sharding.spec) for a in family._states["transformer"].values()),
        }
    np.savez(out, **{m.replace(",", "_").replace("=", "").replace(":", "_"): f for m, f in frames.items()})
    print("REPORT " + json.dumps(report))


def encode():
    """The text encode stage on each mesh: its outputs, and how each text weight (encoder and connectors) is
    split."""
    model, out, *meshes = sys.argv[2:]
    outputs, report = {}, {}
    for mesh in meshes:
        family = registry.open_model(model, dtype="float32", mesh=mesh)
        emb = family.encode("a panda playing a guitar", "blurry, low quality")
        key = mesh.replace(",", "_").replace("=", "")
        outputs[key] = emb.prompt_embeds.numpy()
        outputs[key + "_negative"] = emb.negative_prompt_embeds.numpy()
        if emb.audio_prompt_embeds is not None:
            outputs[key + "_audio"] = emb.audio_prompt_embeds.numpy()
        report[mesh] = {f"{component}.{name}": [a if a is None or isinstance(a, str) else list(a)
                                                 for a in array.sharding.spec]
                        for component in ("text_encoder", "connectors") if component in family._states
                        for name, array in family._states[component].items()}
    np.savez(out, **outputs)
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    encode() if sys.argv[1] == "--encode" else main()
