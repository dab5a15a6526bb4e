"""Compile once: N steps cost one sampler program, a new seed or prompt costs none, a second process loads the
programs the first saved (nothing traced or compiled; the persistent XLA cache alone: test_wan_checks.py). Compiles
are counted from JAX's own monitoring events, traces and loads by the runtime."""

import json
import subprocess
import sys

from conftest import SIZES, subprocess_env

from tpu_runtime.tools.cli import GenerateRequest, generate
from tpu_runtime.families.cogvideox.model import CogVideoXFamily, SampleSettings
from tpu_runtime.engine.runtime import compile_stats


def _cli_generate(model, out, cache_dir, steps):
    h, w, f = SIZES["2b"]
    cmd = [sys.executable, "-m", "tpu_runtime", "generate", "--model", str(model), "--prompt", "a cat",
           "--height", str(h), "--width", str(w), "--frames", str(f), "--steps", str(steps), "--dtype", "float32",
           "--output-dir", str(out), "--cache-dir", str(cache_dir)]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "generation_config.json").read_text())["timings"]["all"]


def test_steps_do_not_add_compiles_and_cache_is_reused_across_processes(tiny_models, tmp_path):
    two = _cli_generate(tiny_models["2b"], tmp_path / "two", tmp_path / "cache", steps=2)
    # A fresh cache: every program compiled for real, the sampler's among them.
    assert two["persistent_cache_hits_total"] == 0 and two["xla_compiles"]["sample"] >= 1
    assert two["programs_loaded_total"] == 0
    # A second process on the same cache with 5 steps: it needs exactly the programs the 2-step run made (the step
    # count adds none), and loads every one as the first process saved it: nothing traced, nothing compiled.
    five = _cli_generate(tiny_models["2b"], tmp_path / "five", tmp_path / "cache", steps=5)
    assert five["xla_compiles_total"] == 0 and five["traces_total"] == 0
    assert five["programs_loaded"] == two["xla_compiles"]
    assert any((tmp_path / "cache" / "programs").iterdir())


def test_new_seed_and_prompt_compile_nothing(tiny_models, tmp_path):
    h, w, f = SIZES["5b"]
    family = CogVideoXFamily(tiny_models["5b"], dtype="float32")
    first = GenerateRequest(model="", output_dir=str(tmp_path / "a"), prompt="a cat", height=h, width=w, frames=f,
                            steps=2, seed=1)
    generate(first, family=family)
    before = compile_stats()
    second = GenerateRequest(model="", output_dir=str(tmp_path / "b"), prompt="a dog on the moon",
                             negative_prompt="blurry", height=h, width=w, frames=f, steps=3, seed=7,
                             scheduler="ddim", dynamic_cfg=True)
    generate(second, family=family)
    delta = compile_stats().since(before)
    assert delta.backend_compiles == 0, f"second generation built {delta.backend_compiles} XLA programs"


def test_program_table_has_one_sampler_per_shape(tiny_models):
    family = CogVideoXFamily(tiny_models["2b"], dtype="float32")
    emb = family.encode("a cat")
    count = family.runtime.program_count
    for steps in (1, 3):  # sizes no other test uses, so the programs are new here
        family.sample(emb, SampleSettings(48, 80, 9, steps=steps, guidance=5.0, seed=steps))
    assert family.runtime.program_count == count + 1
    family.sample(emb, SampleSettings(80, 48, 9, steps=1, guidance=5.0))  # a new shape: one more program
    assert family.runtime.program_count == count + 2
