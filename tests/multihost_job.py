"""Generations run by one process of a slice (or by a single process, for the reference): the same script either
way, so the two runs share every line but the joining.

usage: python multihost_job.py OUT_DIR JOBS_JSON

JOBS_JSON is a list of steps run in order:
  {"generate": NAME, "model": PATH, "mesh": MESH, "height": H, "width": W, "frames": F, "loras": [FILE:S],
   "image": PATH, "steps": N, "cache": {GenerateRequest's cache fields}}
      generate() into OUT_DIR/NAME (float32, 2 steps unless given, CFG, seed 4; image-to-video with "image"; step
      caching with "cache")
  {"open_missing": PATH}     open a model the workers do not have: report the error and the compiles made
  {"cancel": K, "model": PATH, "mesh": MESH, "steps": N, ...sizes}
      sample with Cancel pressed after step K (should_stop), then with the step callback raising after step K (as
      ComfyUI's progress bar does); report the messages; then sample again (the slice kept in step)
  {"kill": PID, "at_step": K, "model": PATH, "mesh": MESH, ...sizes}
      sample, SIGKILL process PID after step K; report the error, how long it took, then that the next call is
      refused at once and this process is still alive after the coordinator's heartbeat timeout
      ("inside": S instead of "at_step": SIGKILL it S seconds after step 2 ends, from another thread: inside a
      step's program and its collectives, not between two steps)
The report (one JSON line after "REPORT ") holds what each step saw.
"""

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from tpu_runtime.errors import InputError, Interrupted, SliceError
from tpu_runtime.engine.stages import SampleSettings
from tpu_runtime.tools.generate import GenerateRequest, generate, open_model
from tpu_runtime.engine.runtime import compile_stats, get_runtime



class InterruptProcessingException(Exception):
    """What ComfyUI's progress bar raises on Cancel."""


out, jobs = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
runtime = get_runtime()
report = {"processes": runtime.slice.processes if runtime.slice else 1, "devices": len(runtime.devices),
          "local_devices": len(runtime.local_devices)}
for job in jobs:
    if "generate" in job:
        req = GenerateRequest(model=job["model"], output_dir=str(out / job["generate"]), prompt="a panda playing a guitar",
                              negative_prompt="blurry, low quality", height=job["height"], width=job["width"],
                              frames=job["frames"], steps=job.get("steps", 2), guidance=6.0, seed=4, dtype="float32",
                              mesh=job["mesh"], loras=job.get("loras", []), image=job.get("image"),
                              **job.get("cache", {}))
        config = generate(req)
        report[job["generate"]] = {"mesh": config["mesh"], "devices": config["devices"], "loras": "loras" in config,
                                   "step_cache": config["step_cache"]}
    elif "open_missing" in job:
        before = compile_stats()
        try:
            open_model(GenerateRequest(model=job["open_missing"], output_dir=str(out / "missing"), dtype="float32"))
            report["open_missing"] = {"error": None}
        except InputError as exc:
            report["open_missing"] = {"error": str(exc), "compiles": compile_stats().since(before).backend_compiles}
    elif "cancel" in job:
        family = open_model(GenerateRequest(model=job["model"], output_dir=str(out / "cancel"), dtype="float32",
                                            mesh=job["mesh"]))
        embeddings = family.encode("a panda playing a guitar", "blurry, low quality")
        settings = SampleSettings(job["height"], job["width"], job["frames"], steps=job["steps"], guidance=6.0, seed=4)
        done = []
        result = {}
        try:
            family.sample(embeddings, settings, on_step=lambda i, n: done.append(i),
                          should_stop=lambda: len(done) >= job["cancel"])
        except Interrupted as exc:
            result["interrupted"] = str(exc)
        # ComfyUI's progress bar raises its own exception on Cancel, from the step callback, between two steps.
        def on_step(i, total):
            if i == job["cancel"]:
                raise InterruptProcessingException("progress bar: processing interrupted")

        try:
            family.sample(embeddings, settings, on_step=on_step)
        except InterruptProcessingException as exc:
            result["raised_in_on_step"] = str(exc)
        family.sample(embeddings, settings)
        result["next_sample"] = "ok"
        report["cancel"] = result
    elif "kill" in job:
        family = open_model(GenerateRequest(model=job["model"], output_dir=str(out / "kill"), dtype="float32",
                                            mesh=job["mesh"]))
        embeddings = family.encode("a panda playing a guitar", "blurry, low quality")
        killed, steps = {}, []

        def kill():
            os.kill(job["kill"], signal.SIGKILL)
            killed["at"], killed["steps"] = time.monotonic(), len(steps)

        def on_step(i, total):
            steps.append(time.monotonic())
            if "inside" in job and i == 2:
                threading.Timer(job["inside"], kill).start()
            elif i == job.get("at_step"):
                kill()

        result = {"error": None}
        try:
            family.sample(embeddings, SampleSettings(job["height"], job["width"], job["frames"], steps=job["steps"],
                                                     guidance=6.0, seed=4), on_step=on_step)
        except SliceError as exc:
            result = {"error": str(exc), "seconds_after_kill": time.monotonic() - killed["at"],
                      "steps_at_kill": killed["steps"], "steps_done": len(steps),
                      "step_seconds": (steps[1] - steps[0]) if len(steps) > 1 else None}
        time.sleep(job["wait"])  # past the heartbeat timeout: the coordinator must not end this process
        start = time.monotonic()
        try:
            family.encode("another prompt")
            result["next_call"] = None
        except SliceError as exc:
            result["next_call"] = str(exc)
            result["next_call_seconds"] = time.monotonic() - start
        result["alive"] = True
        report["kill"] = result
print("REPORT " + json.dumps(report), flush=True)
if os.environ.get("SHOW_REPORT"):
    print(json.dumps(report, indent=1), file=sys.stderr)
