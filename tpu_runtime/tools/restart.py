"""``bench --restart``: the seconds a fresh process spends before its first sampling step, cold, warm with the
persistent XLA cache alone, and warm with the saved programs (``engine/program_store.py``), as ratios in one run.

Each model is run three times, each time in a fresh process on one cache folder: ComfyUI's own model classes
through TPU Diffusion Model (``bench_native.restart_scenarios``: a Wan-shaped and an LTX-2-shaped one, loaded by
ComfyUI's loader and sampled by ComfyUI's sampler), and a family model (``--generation``'s tiny random-weight
model: text encode, then the sampler).

A run's clock starts when the model is loaded (the file read by ComfyUI's loader; the family's folder opened and its
tokenizer run once) and stops when its first step's result is on the host: the weights placed on the devices (the
family's also read from its folder), every program the first step needs (traced and compiled, or loaded: the
family's text encoder's and sampler's; a bridged LTX-2's text connectors' and model's), the step itself; the
seconds *before the first step* leave out the step's own program run (reported beside them: it is the same in every
mode). Python imports are done before the clock (a server has them from its start). Modes: ``cold`` (a new cache
folder), ``warm, XLA cache`` (the same folder, saved programs off: ``TPU_VIDEO_PROGRAM_CACHE_GB=0``, what a restart
cost before them), ``warm, saved programs`` (the same folder). Each run's result is hashed: warm runs must equal the
cold one bit for bit. A run is a child process (``python -m tpu_runtime.tools.restart child ...``) printing one JSON
line.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = {"cold": {}, "warm, XLA cache": {"TPU_VIDEO_PROGRAM_CACHE_GB": "0"}, "warm, saved programs": {}}
FAMILY = "family"
_RESULT = "RESTART_RESULT "


def scenarios(comfy: bool) -> dict[str, tuple[str, object]]:
    """name -> (label, ``run(folder, layers, generation, comfy_dir) -> (seconds, step seconds, result)``): the
    bridged models' (with ComfyUI) and the family's."""
    found = {}
    if comfy:
        from .bench_native import restart_scenarios

        found.update(restart_scenarios())
    found[FAMILY] = ("the pack's family", _family)
    return found


# --- the parent --------------------------------------------------------------------------------------------------
def run_restart(comfy_dir: str | None, names=None, modes=tuple(MODES), layers: int = 20, generation: str = "2b",
                work: str | Path | None = None, env: dict | None = None, rounds: int = 1) -> dict:
    """Each scenario (``names``: all) run in a fresh process once per mode, in order, on one cache folder per
    scenario and round; the results, the ratios to the cold run of the same round and whether each run's result
    equals the cold one's. With several ``rounds`` a mode's ``seconds`` and ratio are the medians over the rounds
    (each round's own in ``rounds``): a shared machine's load moves single runs a lot."""
    work = Path(work or tempfile.mkdtemp(prefix="tpu_video_restart_"))
    known = scenarios(bool(comfy_dir))
    results = {}
    for name in names or known:
        every = []
        for number in range(rounds):
            folder = work / name / (f"round{number + 1}" if rounds > 1 else "")
            folder.mkdir(parents=True, exist_ok=True)
            runs = {}
            for mode in modes:
                runs[mode] = _child_run(name, mode, folder, comfy_dir, layers, generation, env)
                if runs[mode].get("skipped"):
                    break
            cold = runs.get("cold", {})
            for run in runs.values():
                if "seconds" in run and cold.get("seconds"):
                    run["ratio_to_cold"] = run["seconds"] / cold["seconds"]
                    run["equal_to_cold"] = run["result_sha256"] == cold["result_sha256"]
            every.append(runs)
        results[name] = {"label": known[name][0] if name != FAMILY else f"{generation} (the pack's family)",
                         "runs": _medians(every) if rounds > 1 else every[0]}
        if rounds > 1:
            results[name]["rounds"] = every
    return {"work": str(work), "layers": layers, "generation": generation, "rounds": rounds, "scenarios": results}


def _medians(every: list[dict]) -> dict:
    """Each mode's run of the middle round by seconds, with the medians of its seconds and ratio; bit-equal only
    where every round's was."""
    import statistics

    out = {}
    for mode in every[0]:
        runs = [r[mode] for r in every if mode in r]
        if any(run.get("skipped") for run in runs):
            out[mode] = runs[0]
            continue
        middle = dict(sorted(runs, key=lambda run: run["seconds"])[len(runs) // 2])
        middle["seconds"] = statistics.median(run["seconds"] for run in runs)
        middle["first_step_s"] = statistics.median(run["first_step_s"] for run in runs)
        if all("ratio_to_cold" in run for run in runs):
            middle["ratio_to_cold"] = statistics.median(run["ratio_to_cold"] for run in runs)
            middle["equal_to_cold"] = all(run["equal_to_cold"] for run in runs)
        out[mode] = middle
    return out


def _child_run(name: str, mode: str, folder: Path, comfy_dir, layers: int, generation: str, env) -> dict:
    child_env = {**os.environ, **(env or {}), **MODES[mode]}
    command = [sys.executable, "-m", "tpu_runtime.tools.restart", "child", name, str(folder), str(layers), generation]
    if comfy_dir:
        command.append(str(comfy_dir))
    start = time.perf_counter()
    proc = subprocess.run(command, env=child_env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bench --restart: the {mode} run of {name} failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len(_RESULT):])
    result["process_s"] = time.perf_counter() - start
    result["log"] = [line for line in proc.stderr.splitlines() if " loaded " in line or " compiled " in line
                     or "no saved program" in line or "damaged" in line or "not saved" in line]
    return result


def format_restart(r: dict) -> str:
    lines = [f"bench --restart: seconds before the first step (from the model loaded; the step's own run apart), "
             f"each in a fresh process (bridged models: {r['layers']} blocks)"
             + (f"; the median of {r['rounds']} rounds" if r.get("rounds", 1) > 1 else ""),
             f"  {'model':<36}{'mode':<24}{'before s':>9}{'x cold':>8}{'step s':>8}{'bit-equal':>11}{'traced':>8}"
             f"{'compiled':>10}{'loaded':>8}{'process s':>11}"]
    for scenario in r["scenarios"].values():
        label = scenario["label"]
        for mode, run in scenario["runs"].items():
            if run.get("skipped"):
                lines.append(f"  {label:<36}skipped: {run['skipped']}")
                continue
            ratio = f"{run['ratio_to_cold']:.3f}" if "ratio_to_cold" in run else ""
            equal = "" if mode == "cold" else ("yes" if run.get("equal_to_cold") else "NO")
            lines.append(f"  {label:<36}{mode:<24}{run['seconds']:>9.2f}{ratio:>8}{run['first_step_s']:>8.2f}"
                         f"{equal:>11}{run['traces']:>8}{run['xla_compiles']:>10}{run['programs_loaded']:>8}"
                         f"{run['process_s']:>11.1f}")
    lines.append("  traced: traces of torch code through torchax; compiled: XLA compiles; loaded: saved programs "
                 "loaded (counted from the model loaded to its first step)")
    return "\n".join(lines)


# --- a child: one fresh process ----------------------------------------------------------------------------------
def digest(value) -> str:
    """SHA-256 of a tensor's (or a nested tensor's) shapes, dtypes and bytes."""
    import torch

    h = hashlib.sha256()
    tensors = value.unbind() if getattr(value, "is_nested", False) else [value]
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _family(folder: Path, layers: int, generation: str, comfy_dir: str | None) -> tuple:
    from ..engine.runtime import get_runtime
    from ..engine.stages import SampleSettings
    from ..families import registry
    from .generate import GenerateRequest, open_model

    spec, demo = registry.demos()[generation]
    model_dir = folder / "model"
    if not model_dir.exists():
        spec.build_demo(generation, model_dir)
    family = open_model(GenerateRequest(model=str(model_dir), output_dir=str(folder), dtype="float32"), get_runtime())
    family.tokenize(["a panda"])  # the tokenizer and the text code's imports: a server has them from earlier work
    _import_component_classes(model_dir)
    start = time.perf_counter()
    embeddings = family.encode("a panda playing a guitar", "blurry")
    latents = family.sample(embeddings, SampleSettings(demo.height, demo.width, demo.frames, steps=1,
                                                       guidance=family.DEFAULT_GUIDANCE, seed=0))
    return time.perf_counter() - start, family.timings.run.get("sample", 0.0), latents.latents


def _import_component_classes(model_dir: Path) -> None:
    """The modules of the classes ``model_index.json`` names imported before the clock, as a server has them from its
    first model (the cold run imported them while it built the model; a warm one would import them on the clock)."""
    from ..engine.components import model_class

    index = json.loads((model_dir / "model_index.json").read_text())
    for name, entry in index.items():
        if not name.startswith("_") and isinstance(entry, list) and len(entry) == 2 and all(entry):
            model_class(*entry)


def child(argv: list[str]) -> int:
    """One run: ``child SCENARIO FOLDER LAYERS GENERATION [COMFYUI_DIR]``; prints ``RESTART_RESULT {json}``."""
    import logging

    from ..engine.runtime import compile_stats, get_runtime

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    name, folder, layers, generation = argv[0], Path(argv[1]), int(argv[2]), argv[3]
    comfy_dir = argv[4] if len(argv) > 4 else None
    get_runtime(cache_dir=folder / "cache")
    before = compile_stats()
    seconds, step, out = scenarios(bool(comfy_dir))[name][1](folder, layers, generation, comfy_dir)
    if seconds is None:
        result = {"skipped": out}
    else:
        delta = compile_stats().since(before)
        result = {"seconds": seconds - step, "first_step_s": step, "total_s": seconds, "result_sha256": digest(out),
                  "traces": delta.traces, "xla_compiles": delta.xla_compiles,
                  "persistent_cache_hits": delta.persistent_cache_hits, "programs_loaded": delta.programs_loaded}
    print(_RESULT + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover - the child process
    if sys.argv[1:2] == ["child"]:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        code = child(sys.argv[2:])
        sys.stdout.flush()
        os._exit(code)  # ComfyUI's model patchers can raise at interpreter exit
    sys.exit(f"usage: python -m {__spec__.name} child SCENARIO FOLDER LAYERS GENERATION [COMFYUI_DIR]")
