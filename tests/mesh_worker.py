"""Run in a subprocess with 8 simulated CPU devices: the 8-device jobs of test_mesh.py, all in one process (one
start-up of torch and JAX for all of them; a program one job compiled is reused by the next that needs it, as in
any long-lived process). Works for CogVideoX, Wan and LTX-2 folders alike.

usage: python mesh_worker.py JOBS_JSON OUT_DIR

JOBS_JSON maps a job's name to one of
  {"frames": MODEL, "height": H, "width": W, "meshes": [MESH, ...]}
      sample (2 steps, CFG) and decode on each mesh; frames into OUT_DIR/NAME.npz, the compiled step's collectives,
      the weights' and the decode's layout, the programs built, and what a second run (new seed, prompt and step
      count) built into the report. A MESH may end in ":width" or ":replicated" (the VAE decode's layout; default
      auto, which is width on these 8 devices), ":fsdp" (split every weight matrix over dp as well), ":decode9"
      (also decode random latents of 9 latent frames: CogVideoX's batch-by-batch decode), e.g.
      "dp=2,sp=1,tp=4:fsdp".
  {"encode": MODEL, "meshes": [MESH, ...]}
      the text encode alone: its prompt streams into OUT_DIR/NAME.npz, each text-encoder weight's sharding reported
  {"refused": MODEL, "cases": [[MESH, GUIDANCE], ...]}
      open the model on the mesh and sample: the refusal's message, and what was built after the model opened
  {"lora": MODEL, "file": LORA, "strength": S, "mesh": MESH, "height": H, "width": W}
      sample and decode with the LoRA merged; frames into OUT_DIR/NAME.npz, whether each weight kept its sharding
A job that raises reports {"error": its traceback}; the others still run. The report is one JSON line after
"REPORT ".
"""

import json
import re
import sys
import traceback
from pathlib import Path

import numpy as np
import torch

from tpu_runtime.engine.runtime import compile_stats
from tpu_runtime.engine.stages import SampleSettings, VideoLatents
from tpu_runtime.errors import InputError
from tpu_runtime.families import registry

PROMPT, NEGATIVE = "a panda playing a guitar", "blurry, low quality"


def nine_latent_frames(shape):
    """Random latents of ``shape`` with 9 latent frames (the test makes the same ones)."""
    return torch.randn(shape[0], shape[1], 9, *shape[3:], generator=torch.Generator().manual_seed(9))


def mesh_key(mesh: str) -> str:
    return mesh.replace(",", "_").replace("=", "").replace(":", "_")


def frames_job(job, out: Path) -> dict:
    height, width = job["height"], job["width"]
    frames, report = {}, {}
    for mesh in job["meshes"]:
        spec, *options = mesh.split(":")
        family = registry.open_model(job["frames"], dtype="float32", mesh=spec, fsdp="fsdp" in options,
                                     vae_sharding=next((o for o in options if o in ("width", "replicated")), "auto"))
        emb = family.encode(PROMPT, NEGATIVE)
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
            # programs built for the sampler (compiled, or loaded from the run's compilation cache or saved programs)
            "sample_programs": family.timings.compiles["sample"] + family.timings.cache_hits.get("sample", 0)
            + family.timings.loaded.get("sample", 0),
            "recompiles_second_run": compile_stats().since(before).backend_compiles,
            "collectives": {op: len(re.findall(rf"= [^\n]*\b{op}(?:-start)?\(", hlo))
                            for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")},
            "all_gather_shapes": [[int(n) for n in dims.split(",") if n] for dims in
                                  re.findall(r"= \w+\[([\d,]*)\]\S* all-gather(?:-start)?\(", hlo)],
            "weight_shapes": sorted({tuple(p.shape) for p in family._parts["transformer"].parameters()}),
            "weights_split_on_dp": sum("dp" in str(a.sharding.spec) for a in family._states["transformer"].values()),
        }
    np.savez(out, **{mesh_key(m): f for m, f in frames.items()})
    return report


def encode_job(job, out: Path) -> dict:
    outputs, report = {}, {}
    for mesh in job["meshes"]:
        family = registry.open_model(job["encode"], dtype="float32", mesh=mesh)
        emb = family.encode(PROMPT, NEGATIVE)
        key = mesh_key(mesh)
        outputs[key] = emb.prompt_embeds.numpy()
        outputs[key + "_negative"] = emb.negative_prompt_embeds.numpy()
        if emb.audio_prompt_embeds is not None:
            outputs[key + "_audio"] = emb.audio_prompt_embeds.numpy()
        report[mesh] = {f"{component}.{name}": [a if a is None or isinstance(a, str) else list(a)
                                                 for a in array.sharding.spec]
                        for component in ("text_encoder", "connectors") if component in family._states
                        for name, array in family._states[component].items()}
    np.savez(out, **outputs)
    return report


def refused_job(job, out: Path) -> dict:
    report = {}
    for mesh, guidance in job["cases"]:
        family, built = None, None
        try:
            family = registry.open_model(job["refused"], dtype="float32", mesh=mesh)
            embeddings = family.encode("a cat")
            before = compile_stats()
            try:
                family.sample(embeddings, SampleSettings(64, 64, 9, steps=1, guidance=guidance))
            finally:
                built = compile_stats().since(before).backend_compiles
            report[mesh] = {"error": None}
        except InputError as exc:
            report[mesh] = {"error": str(exc), "opened": family is not None, "built_by_sample": built}
    return report


def lora_job(job, out: Path) -> dict:
    from tpu_runtime.engine.lora import LoraSpec

    family = registry.open_model(job["lora"], dtype="float32", mesh=job["mesh"])
    emb = family.encode(PROMPT, NEGATIVE)
    family._component("transformer")
    specs = {k: str(v.sharding.spec) for k, v in family._states["transformer"].items()}
    settings = SampleSettings(job["height"], job["width"], 9, steps=2, guidance=6.0, seed=4,
                              loras=(LoraSpec(job["file"], job["strength"]),))
    np.savez(out, frames=family.decode(family.sample(emb, settings)).numpy())
    merged = {k: str(v.sharding.spec) for k, v in family._states["transformer"].items()}
    return {"same_shardings": specs == merged, "split_weights": sum("tp" in s for s in merged.values()),
            "touched": len(family._loras["transformer"].touched)}


JOBS = {"frames": frames_job, "encode": encode_job, "refused": refused_job, "lora": lora_job}


def main():
    jobs, out_dir = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    report = {}
    for name, job in jobs.items():
        kind = next(k for k in JOBS if k in job)
        try:
            report[name] = JOBS[kind](job, out_dir / f"{name}.npz")
        except Exception:  # noqa: BLE001 - the job's test shows it; the other jobs still run
            report[name] = {"error": traceback.format_exc()}
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main()
