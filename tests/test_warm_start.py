"""Warm starts (``engine/program_store.py``): every program the runtime compiles is saved with the key of what it
depends on, and a later process with the same key loads it without tracing or compiling, giving the same bits; a
changed key rebuilds and says why in one line; a damaged file is named, removed and rebuilt; the folder keeps to its
size limit, least recently used out first; ``cache show|clear``; ``plan --save`` for a TPU slice (written, read back,
its key the one the slice computes) and for this CPU (loaded by a fresh ``generate``); and ``bench --restart``'s
fresh processes through the native bridge (ComfyUI's Wan and LTX-2 classes).

A program compiled again under a new in-memory key stands for a new process in the store tests (the runtime's own
table misses; only the saved program can help); the last tests start real fresh processes."""

import itertools
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import WAN_SIZE, subprocess_env

from tpu_runtime.engine.program_key import ProgramKey, complete, describe_module
from tpu_runtime.engine.program_store import ProgramStore, file_name, read_file
from tpu_runtime.engine.runtime import compile_stats

_calls = itertools.count()


class Mlp(torch.nn.Module):
    def __init__(self, layers: int = 2, width: int = 8):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
        self.scale = 0.5  # a plain attribute a trace bakes in

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x)) * self.scale
        return x


@pytest.fixture
def store(runtime, tmp_path, monkeypatch):
    """A store of this test's own in place of the run's (the runtime's saved programs)."""
    own = ProgramStore(tmp_path / "programs", limit_bytes=10 ** 9)
    monkeypatch.setattr(runtime, "_saved_store", own)
    return own


def run_program(runtime, module: torch.nn.Module, batch: int = 2, seed: int = 0) -> np.ndarray:
    """``module`` compiled (or loaded) as a stage program under a key no earlier call used (a new process, as far
    as the runtime's own table knows), run on a fixed input."""
    fn = runtime.module_function(module)
    state = runtime.module_state(module)
    dtype = next(module.parameters()).dtype
    x = runtime.put(torch.randn(batch, 8, generator=torch.Generator().manual_seed(seed)).to(dtype))
    key = ProgramKey("test mlp", {"program": "mlp forward", "model": describe_module(module)})
    executable = runtime.compiled(("warm start test", next(_calls)), fn, state, x, describe="test mlp", saved=key)
    return np.asarray(runtime.to_cpu(executable(state, x)).float())


def reasons(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("no saved program fits")]


# --- the store's promises, in this process --------------------------------------------------------------------------
def test_a_saved_program_is_loaded_without_tracing_and_gives_the_same_bits(runtime, store):
    torch.manual_seed(0)
    module = Mlp()
    first = run_program(runtime, module)
    assert len(list(store.folder.iterdir())) == 1
    before = compile_stats()
    again = run_program(runtime, module)
    delta = compile_stats().since(before)
    assert (delta.traces, delta.backend_compiles, delta.programs_loaded) == (0, 0, 1)
    assert again.tobytes() == first.tobytes()
    # new weight values (what a LoRA changes) keep the key: loaded, and computed with the new values
    with torch.no_grad():
        module.layers[0].weight.add_(0.25)
    before = compile_stats()
    changed = run_program(runtime, module)
    assert compile_stats().since(before).traces == 0
    expected = module(torch.randn(2, 8, generator=torch.Generator().manual_seed(0))).detach().numpy()
    assert np.abs(changed - expected).max() < 1e-5 and np.abs(changed - first).max() > 1e-3


def test_a_changed_key_rebuilds_and_says_why_in_one_line(runtime, store, caplog, monkeypatch):
    import jax

    torch.manual_seed(0)
    run_program(runtime, Mlp())
    caplog.set_level(logging.INFO, logger="tpu_runtime")
    changes = {
        "dtype": (lambda: run_program(runtime, Mlp().to(torch.bfloat16)), "bfloat16"),
        "shape": (lambda: run_program(runtime, Mlp(), batch=3), "3x8"),
        "structure": (lambda: run_program(runtime, Mlp(layers=3)), "now also [0]['layers.2.bias']"),
        "attribute": (lambda: run_program(runtime, _scaled(Mlp(), 0.25)), "model.attributes"),
    }
    for name, (rerun, said) in changes.items():
        caplog.clear()
        before = compile_stats()
        rerun()
        assert compile_stats().since(before).traces == 1, name  # rebuilt
        lines = reasons(caplog)
        assert len(lines) == 1 and said in lines[0], (name, lines)
    caplog.clear()
    monkeypatch.setattr(jax, "__version__", "0.0.1+not.this.one")
    run_program(runtime, Mlp())
    assert reasons(caplog) and f"software.jax: was {jax.__version__}" not in reasons(caplog)[0]
    assert "now 0.0.1+not.this.one" in reasons(caplog)[0] and "software.jax" in reasons(caplog)[0]
    before = compile_stats()
    run_program(runtime, Mlp())  # the program rebuilt for that version was saved: loaded now
    assert compile_stats().since(before).programs_loaded == 1


def test_a_program_taken_from_a_cache_is_compiled_afresh_before_it_is_saved(runtime, store):
    """XLA:CPU cannot serialize an executable it deserialized (the copy fails: "Function ... not found"): a program
    whose compile came from the persistent XLA cache is compiled again before it is saved, so the saved copy runs,
    as the bridge saves its programs itself (``to_save``)."""
    torch.manual_seed(0)
    module = Mlp()
    first = run_program(runtime, module, seed=3)  # compiled here and saved: the XLA cache has it too
    state = runtime.module_state(module)
    x = runtime.put(torch.randn(2, 8, generator=torch.Generator().manual_seed(3)))
    before = compile_stats()
    executable = runtime.compiled(("afresh", next(_calls)), runtime.module_function(module), state, x, to_save=True)
    delta = compile_stats().since(before)
    assert delta.persistent_cache_hits == 1 and delta.xla_compiles == 1  # from the cache, then compiled afresh
    key = complete(ProgramKey("saved by hand", {}), (state, x))
    store.save(key, "saved by hand", executable)
    loaded = store.find(key)
    assert np.asarray(runtime.to_cpu(loaded.executable(state, x))).tobytes() == first.tobytes()


def test_what_comfyuis_load_sets_on_a_module_keeps_its_key():
    """ComfyUI's model patcher sets bookkeeping attributes on the modules it loads and unloads (cast flags, empty
    weight-function lists where the class had none): a model keyed before such a load keeps its key after it, while
    an attribute a trace bakes in changes it."""
    torch.manual_seed(0)
    module = Mlp()
    before = describe_module(module)
    for layer in module.layers:
        layer.weight_function, layer.bias_function = [], []
        layer.comfy_force_cast_weights, layer.prev_comfy_cast_weights = True, False
        layer.comfy_patched_weights = True
    module.lowvram_patch = None
    assert describe_module(module) == before
    assert describe_module(_scaled(module, 0.25))["attributes"] != before["attributes"]


def test_a_program_calling_back_into_the_host_runs_and_is_not_saved(runtime, store, caplog):
    """A host callback names a function only this process has: such a program is not saved (said once), and runs."""
    import jax
    import jax.numpy as jnp

    def with_callback(x):
        return jax.pure_callback(lambda a: np.asarray(a) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x) + 1

    x = jnp.arange(4, dtype=jnp.float32)
    caplog.set_level(logging.INFO, logger="tpu_runtime")
    key = ProgramKey("callback test", {"program": "callback"})
    executable = runtime.compiled(("callback", next(_calls)), with_callback, x, describe="callback test", saved=key)
    assert np.asarray(executable(x)).tolist() == [1.0, 3.0, 5.0, 7.0]
    assert not (store.folder.exists() and any(store.folder.iterdir()))
    said = [r.getMessage() for r in caplog.records if "is not saved for later processes" in r.getMessage()]
    assert len(said) == 1 and "callback test" in said[0], said


class Masked(torch.nn.Module):
    """A model whose code indexes a device value with a boolean mask (as Qwen3-VL's DeepStack rows are placed)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x, mask=None):
        y = self.linear(x)
        return y[:, mask] * 2


def test_a_program_traced_with_one_constant_mask_is_never_loaded_for_another(runtime, store, caplog):
    """``device_constant_args``: the mask's values are part of the program (it sizes and picks the rows), so a later
    model with the same mask loads the program, one with another mask of the same shape builds its own and says why;
    each equals the model's own torch run."""
    from tpu_runtime.bridge.program import BridgedModule
    from tpu_runtime.bridge.rules import ArchRules

    torch.manual_seed(0)
    module = Masked()
    x = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(1))
    masks = torch.tensor([True, False, True, False]), torch.tensor([False, True, True, False])

    def fresh(mask):  # a new bridged module: a new process, as far as the runtime's own table knows
        bridged = BridgedModule(module=module, method=Masked.forward, rules=ArchRules(name="masked"),
                                options_arg=None, device_constant_args=("mask",), label="Masked")
        before = compile_stats()
        out = bridged(x, mask=mask)
        assert (out - module(x, mask=mask)).abs().max() < 1e-6
        return out, compile_stats().since(before)

    first, cold = fresh(masks[0])
    assert cold.traces >= 1 and cold.programs_loaded == 0
    again, warm = fresh(masks[0])
    assert (warm.traces, warm.programs_loaded) == (0, 1) and torch.equal(again, first)
    caplog.set_level(logging.INFO, logger="tpu_runtime")
    other, built = fresh(masks[1])
    assert built.traces >= 1 and built.programs_loaded == 0
    assert not torch.equal(other, first)
    (line,) = [text for text in reasons(caplog) if text.startswith("no saved program fits Masked")]
    assert "program.call" in line, line


def _scaled(module, scale):
    module.scale = scale
    return module


@pytest.mark.parametrize("ahead", [False, True], ids=["looked up", "read ahead"])
@pytest.mark.parametrize("damage, said", [
    ("cut", "cut short"), ("garbage", "not a saved program"), ("flipped", "checksum"), ("header", "header")])
def test_a_damaged_file_is_named_removed_and_rebuilt(runtime, store, caplog, damage, said, ahead):
    torch.manual_seed(0)
    module = Mlp()
    first = run_program(runtime, module)
    (path,) = store.folder.iterdir()
    data = path.read_bytes()
    if damage == "cut":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif damage == "flipped":
        path.write_bytes(data[:-10] + bytes(b ^ 0xFF for b in data[-10:]))
    else:
        path.write_bytes(data[:40] + b"{not json" + data[49:])
    if ahead:  # a file whose header still reads is read ahead, fails there, and is named when it is looked up
        store.read_ahead("test mlp", lambda fields: True)
    caplog.set_level(logging.INFO, logger="tpu_runtime")
    before = compile_stats()
    again = run_program(runtime, module)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and path.name in warnings[0] and said in warnings[0] and "removed" in warnings[0]
    assert compile_stats().since(before).traces == 1 and again.tobytes() == first.tobytes()
    header, _ = read_file(path)  # rebuilt whole under the same name
    assert header["describe"] == "test mlp"


def test_a_program_read_ahead_is_used_by_the_call_and_gives_the_same_bits(runtime, store, caplog, monkeypatch):
    """A wrapped model's saved programs load in the background (``read_ahead``) while its weights are placed: the
    call takes the one read ahead (nothing traced, compiled or loaded twice), with the same bits."""
    torch.manual_seed(0)
    module = Mlp()
    first = run_program(runtime, module)
    (path,) = store.folder.iterdir()
    assert runtime.read_ahead("test mlp") == [path]
    assert runtime.read_ahead("test mlp") == []  # already on its way: not loaded twice
    assert runtime.read_ahead("another role") == []
    caplog.set_level(logging.INFO, logger="tpu_runtime")
    before = compile_stats()
    again = run_program(runtime, module)
    delta = compile_stats().since(before)
    assert (delta.traces, delta.backend_compiles, delta.programs_loaded) == (0, 0, 1)
    assert again.tobytes() == first.tobytes()
    assert any("read ahead" in r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded test mlp"))
    assert not store._ahead  # handed over, not kept
    with monkeypatch.context() as m:
        m.setenv("TPU_VIDEO_READ_AHEAD", "0")  # off: each program loads when its call comes
        assert runtime.read_ahead("test mlp") == []
    # a program read ahead and then dropped (its module released) is loaded as usual when asked for
    runtime.read_ahead("test mlp")
    store.drop_read_ahead("test mlp")
    caplog.clear()
    assert run_program(runtime, module).tobytes() == first.tobytes()
    assert not any("read ahead" in r.getMessage() for r in caplog.records)


def test_a_program_of_other_software_or_devices_is_never_read_ahead(runtime, store, monkeypatch):
    """Reading ahead hands a file to the backend before the call's key is known: only files written for this
    software, these devices and this compiler are read (a program of another jaxlib could crash the loader)."""
    import jax

    torch.manual_seed(0)
    run_program(runtime, Mlp())
    with monkeypatch.context() as m:
        m.setattr(jax, "__version__", "0.0.1+not.this.one")
        assert runtime.read_ahead("test mlp") == []
    with monkeypatch.context() as m:
        m.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=false")
        assert runtime.read_ahead("test mlp") == []
    with monkeypatch.context() as m:
        m.setattr(runtime.devices[0].__class__, "device_kind", property(lambda self: "another kind"), raising=False)
        assert runtime.read_ahead("test mlp") == []
    assert len(runtime.read_ahead("test mlp")) == 1  # and for this software and these devices it is


_XLA_CACHE_RUN = """
import json, sys
import numpy as np, torch
from test_warm_start import Mlp, run_program
from tpu_runtime.engine.runtime import compile_stats, get_runtime
runtime = get_runtime(cache_dir=sys.argv[1])
torch.manual_seed(0)
out = run_program(runtime, Mlp(layers=3), seed=5)
stats = compile_stats()
print("RESULT " + json.dumps({"bits": out.tobytes().hex(), "compiles": stats.xla_compiles,
                              "hits": stats.persistent_cache_hits}))
"""


def test_a_damaged_xla_cache_entry_is_named_removed_and_compiled_again(tmp_path):
    """The persistent XLA cache's own files (JAX's), in fresh processes with saved programs off: one cut short is
    named in the log, removed and compiled again, with the same bits; the next process finds it whole (JAX alone
    warns with the program's name and leaves the file, so every start compiled it again)."""
    folder = tmp_path / "cache"
    env = subprocess_env(TPU_VIDEO_PROGRAM_CACHE_GB="0")
    env["PYTHONPATH"] = str(Path(__file__).parent) + os.pathsep + env["PYTHONPATH"]

    def run() -> tuple[dict, str]:
        proc = subprocess.run([sys.executable, "-c", _XLA_CACHE_RUN, str(folder)], env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
        return json.loads(line[len("RESULT "):]), proc.stderr

    first, _ = run()
    entries = sorted(folder.glob("*-cache"))
    assert entries and first["hits"] == 0
    for path in entries:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    again, log = run()
    warnings = [line for line in log.splitlines() if "compilation cache entry" in line]
    assert len(warnings) == len(entries) and all("is damaged" in w and "removed" in w for w in warnings), log[-3000:]
    assert all(any(path.name in w for w in warnings) for path in entries)
    assert again["bits"] == first["bits"] and again["hits"] == 0
    assert all(path.stat().st_size > 0 for path in entries)  # written whole again under the same names
    third, log = run()
    assert third["bits"] == first["bits"] and third["hits"] >= 1 and third["compiles"] == 0
    assert "compilation cache entry" not in log and "Error reading persistent compilation cache" not in log


def test_the_size_limit_removes_the_least_recently_used_first(runtime, store):
    torch.manual_seed(0)
    modules = {n: Mlp(layers=n) for n in (1, 2, 3)}
    run_program(runtime, modules[1])
    run_program(runtime, modules[2])
    files = sorted(store.folder.iterdir(), key=lambda p: p.stat().st_mtime)
    assert len(files) == 2
    for age, path in zip((2000.0, 1000.0), files):  # the first saved is the oldest
        os.utime(path, (age, age))
    oldest, newer = files
    store.limit_bytes = int(sum(p.stat().st_size for p in files) * 1.6)  # room for two programs
    run_program(runtime, modules[1])  # loading the oldest marks it used: the other becomes the least recently used
    run_program(runtime, modules[3])
    assert oldest.exists() and not newer.exists() and len(list(store.folder.iterdir())) == 2


def test_cache_show_and_clear(runtime, store, tmp_path, capsys):
    from tpu_runtime.tools.cli import main

    torch.manual_seed(0)
    run_program(runtime, Mlp())
    cache = tmp_path  # the store's folder is tmp_path/programs: the layout of a runtime's cache folder
    (cache / "jit_step-0123-cache").write_bytes(b"x" * 100)
    (cache / "programs" / f"{'0' * 10}-{'0' * 40}-{'0' * 10}.program").write_bytes(b"not a program")
    assert main(["cache", "show", "--cache-dir", str(cache)]) == 0
    shown = capsys.readouterr().out
    assert "XLA compilation cache: 1 program(s)" in shown and "saved programs" in shown
    assert "test mlp" in shown and "damaged:" in shown and "not a saved program" in shown
    assert main(["cache", "clear", "--programs-only", "--cache-dir", str(cache)]) == 0
    assert not list((cache / "programs").iterdir()) and (cache / "jit_step-0123-cache").exists()
    assert main(["cache", "clear", "--cache-dir", str(cache)]) == 0
    assert not (cache / "jit_step-0123-cache").exists()
    assert "removed 1 XLA compilation cache file(s)" in capsys.readouterr().out


_QR_CHILD = """
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from tpu_runtime.engine.program_key import ProgramKey, complete
from tpu_runtime.engine.program_store import ProgramStore

x = jnp.asarray(np.arange(64, dtype=np.float32).reshape(8, 8) % 7)
loaded = ProgramStore(None, read_only=[Path(sys.argv[1])]).find(complete(ProgramKey("qr", {"program": "qr"}), (x,)))
print(np.asarray(loaded.executable(x)).tobytes().hex())
"""


def test_a_program_calling_lapack_runs_in_a_process_that_traced_nothing(tmp_path):
    """XLA:CPU's QR (a LAPACK custom call, as ComfyUI's Wan Animate uses) in a fresh process that loads it and
    lowers nothing: jaxlib sets LAPACK up only when it lowers such an op (without it the program crashes)."""
    import jax
    import jax.numpy as jnp

    x = jnp.asarray(np.arange(64, dtype=np.float32).reshape(8, 8) % 7)
    compiled = jax.jit(lambda a: jnp.linalg.qr(a)[1]).lower(x).compile()
    path = ProgramStore(tmp_path).save(complete(ProgramKey("qr", {"program": "qr"}), (x,)), "qr", compiled)
    assert any(t.startswith("lapack_") for t in read_file(path)[0]["custom_calls"])
    proc = subprocess.run([sys.executable, "-c", _QR_CHILD, str(tmp_path)], env=subprocess_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert bytes.fromhex(proc.stdout.split()[-1]) == np.asarray(compiled(x)).tobytes()


# --- plan --save ---------------------------------------------------------------------------------------------------
def test_bad_saved_program_settings_are_refused_naming_the_fix(tmp_path, monkeypatch, capsys):
    from tpu_runtime.engine.program_store import limit_from_environment, read_ahead_from_environment, read_only_folders
    from tpu_runtime.errors import InputError
    from tpu_runtime.tools.cli import main

    monkeypatch.setenv("TPU_VIDEO_PROGRAMS", str(tmp_path / "absent"))
    with pytest.raises(InputError, match="TPU_VIDEO_PROGRAMS names .*absent, which is not a folder"):
        read_only_folders()
    monkeypatch.setenv("TPU_VIDEO_PROGRAM_CACHE_GB", "lots")
    with pytest.raises(InputError, match="TPU_VIDEO_PROGRAM_CACHE_GB='lots' is not a size in gigabytes"):
        limit_from_environment()
    monkeypatch.setenv("TPU_VIDEO_READ_AHEAD", "all")
    with pytest.raises(InputError, match="TPU_VIDEO_READ_AHEAD='all' is not a count: give how many"):
        read_ahead_from_environment()
    assert main(["plan", "--comfy-model", "wan2.1-t2v-1.3b", "--topology", "v6e-8", "--save", str(tmp_path)]) == 2
    assert "leave --save out" in capsys.readouterr().err


def test_plan_saves_a_slices_programs_with_the_key_the_slice_computes(tiny_wan, runtime, tmp_path, caplog):
    """For v6e-8 (no TPU here): the compiled step is written, read back whole, and its key is the one the runtime
    computes for that program on the slice's devices; a CPU process offered it does not take it and says why."""
    import jax

    from tpu_runtime.tools.plan import ModelSource, format_report, open_abstract, plan, planned_settings
    from tpu_runtime.tools.topology import parse_topology

    h, w, f = WAN_SIZE
    source, folder = ModelSource(str(tiny_wan["2.1"])), tmp_path / "v6e8"
    report = plan(source, "v6e-8", height=h, width=w, frames=f, steps=2, stages=("sample",), max_candidates=1,
                  save=str(folder))
    (path,) = [p for p in folder.iterdir()]
    assert report.saved == [str(path)] and f"TPU_VIDEO_PROGRAMS={folder}" in format_report(report)
    header, _ = read_file(path)
    devices = header["fields"]["devices"]
    assert header["kind"] == "executable" and devices["platform"] == "tpu" and devices["kind"] == "TPU v6 lite"
    assert devices["meshes"] == [f"{report.mesh} over 0 1 2 3 4 5 6 7"] and "libtpu" in header["fields"]["software"]

    def program_on(devices, mesh):
        family = open_abstract(source, devices, tmp_path, mesh=mesh)
        settings = planned_settings(family, source, h, w, f, None, 2)
        return family, next(p for p in family.plan_programs(settings) if p.stage == "sample")

    family, program = program_on(parse_topology("v6e-8").devices(), report.mesh)
    key = complete(family.saved_key(program), program.example)
    assert key.fields == header["fields"] and path.name == file_name(key)
    family, program = program_on(jax.devices("cpu")[:1], None)
    on_cpu = complete(family.saved_key(program), program.example)
    offered = ProgramStore(None, read_only=[folder])
    assert offered.find(on_cpu) is None
    assert offered.explain(on_cpu).startswith("devices.kind: was TPU v6 lite, now cpu")


def test_plan_for_this_cpu_saves_what_a_fresh_generate_loads(tiny_wan, runtime, tmp_path):
    """``plan --topology cpu --save``, then a fresh ``generate --programs`` of the planned sampling: the sampler step
    is loaded, nothing is traced or compiled (the text encode's stage file is written here first)."""
    from tpu_runtime.tools.cli import GenerateRequest, generate
    from tpu_runtime.tools.plan import ModelSource, plan

    h, w, f = WAN_SIZE
    folder, out = tmp_path / "cpu", tmp_path / "out"
    report = plan(ModelSource(str(tiny_wan["2.1"])), "cpu", height=h, width=w, frames=f, steps=2, dtype="float32",
                  stages=("sample",), save=str(folder))
    (saved,) = report.saved
    assert read_file(Path(saved))[0]["platform"] == "cpu"
    generate(GenerateRequest(model=str(tiny_wan["2.1"]), output_dir=str(out), prompt="a cat", height=h, width=w,
                             frames=f, dtype="float32", stage="encode"))
    cmd = [sys.executable, "-m", "tpu_runtime", "generate", "--model", str(tiny_wan["2.1"]), "--stage", "sample",
           "--steps", "2", "--dtype", "float32", "--output-dir", str(out), "--cache-dir", str(tmp_path / "fresh"),
           "--programs", str(folder)]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    timings = json.loads((out / "generation_config.json").read_text())["timings"]["sample"]
    assert timings["programs_loaded"] == {"sample": 1}
    assert timings["xla_compiles_total"] == 0 and timings["traces_total"] == 0
    assert "loaded Wan sampler step" in proc.stderr


# --- fresh processes through the native bridge: bench --restart ----------------------------------------------------
def test_bridged_models_load_their_programs_in_a_fresh_process(tmp_path):
    """``bench --restart`` on ComfyUI's LTX-2 class (the newest tree; its text connectors a program of their own, its
    latent a nested tensor of video and sound, its options read while traced): the warm process traces and compiles
    nothing, loads what the cold one saved (read ahead while ComfyUI prepares the model), and its first step equals the
    cold one's bit for bit. (The Wan scenario
    runs the same path with one program; ``bench --restart`` measures both.)"""
    from comfy_native import COMFYUI_TREES, NEWEST

    from tpu_runtime.tools.restart import format_restart, run_restart

    r = run_restart(str(COMFYUI_TREES[NEWEST]), ("ltx2-bridge",), ("cold", "warm, saved programs"),
                    layers=1, work=tmp_path, env=subprocess_env())
    assert list(r["scenarios"]) == ["ltx2-bridge"]
    for scenario, result in r["scenarios"].items():
        cold, warm = result["runs"]["cold"], result["runs"]["warm, saved programs"]
        assert cold["traces"] >= 1 and cold["xla_compiles"] >= 1 and cold["programs_loaded"] == 0, scenario
        assert (warm["traces"], warm["xla_compiles"]) == (0, 0), (scenario, warm["log"])
        assert warm["programs_loaded"] == cold["xla_compiles"] and warm["equal_to_cold"], scenario
        # each of the model's and its connectors' programs was read ahead when ComfyUI's model was wrapped
        loaded = [line for line in warm["log"] if "from the saved programs" in line]
        assert len(loaded) == warm["programs_loaded"] and all("read ahead" in line for line in loaded), loaded
    table = format_restart(r)
    assert "warm, saved programs" in table and "x cold" in table


def test_restart_rounds_give_each_modes_median_and_equal_only_where_every_round_was(capsys):
    """``bench --restart --restart-rounds N``: each mode's seconds, step and ratio are the medians over the rounds
    (the ratio taken within each round), and a warm mode is bit-equal only where it was in every round."""
    from tpu_runtime.tools.cli import main
    from tpu_runtime.tools.restart import _medians

    def run(seconds, ratio=None, equal=True):
        out = {"seconds": seconds, "first_step_s": seconds / 10, "traces": 0, "xla_compiles": 0, "programs_loaded": 1}
        return out if ratio is None else {**out, "ratio_to_cold": ratio, "equal_to_cold": equal}

    rounds = [{"cold": run(10.0, 1.0), "warm": run(1.0, 0.1)},
              {"cold": run(20.0, 1.0), "warm": run(4.0, 0.2, equal=False)},
              {"cold": run(12.0, 1.0), "warm": run(0.6, 0.05)}]
    medians = _medians(rounds)
    assert medians["cold"]["seconds"] == 12.0 and medians["warm"]["seconds"] == 1.0
    assert medians["warm"]["ratio_to_cold"] == 0.1 and medians["warm"]["first_step_s"] == 0.1
    assert medians["warm"]["equal_to_cold"] is False
    assert main(["bench", "--restart", "--restart-rounds", "0"]) == 2
    assert "--restart-rounds 0: give 1 or more" in capsys.readouterr().err
