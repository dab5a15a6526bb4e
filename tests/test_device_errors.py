"""Never silently on the CPU, and out of device memory said in words.

A machine with TPU chips (found as a TPU VM shows them: Google's PCI TPU devices, /dev/accel*, /dev/vfio/*), or
``TPU_VIDEO_EXPECT=tpu``, whose runtime would end up on the CPU stops before any model loads, naming the cause (libtpu
missing, the chips held by process N, mismatched JAX releases, JAX's own error) and the fix; ``TPU_VIDEO_ALLOW_CPU=1``
accepts the CPU with one warning line. A faked machine (``TPU_VIDEO_HOST_ROOT``) stands in for a TPU VM.

RESOURCE_EXHAUSTED, simulated with XLA's own message texts at each place it can happen (placing weights, compiling a
stage, running it: the bridge's programs and the families' text encoder, sampling step and VAE), is an error naming
the part, what it needed against what a chip has, the mesh, and the fix (a larger slice, ``fsdp``, a smaller size,
``plan``).
"""

import importlib.util
import os
import subprocess
import sys
import time

import jax
import pytest
import torch
from conftest import ROOT, subprocess_env

from tpu_runtime.engine import accelerators, memory
from tpu_runtime.errors import AcceleratorUnavailable, DeviceMemoryError, InputError

GIB = 2 ** 30


# --- a machine as a TPU VM shows it ---------------------------------------------------------------------------------
def fake_machine(root, chips=4, pci=True, vfio=True, holder=None, gvnic=True):
    """A TPU VM's /sys, /dev and /proc under ``root``: ``chips`` v6e chips on PCI and as /dev/vfio/N (or /dev/accelN),
    Google's virtual NIC beside them (same vendor, no TPU), and ``holder`` = (pid, argv) holding /dev/vfio/0 (or
    accel0)."""
    devices = root / "sys" / "bus" / "pci" / "devices"
    devices.mkdir(parents=True)
    if pci:
        for i in range(chips):
            _pci(devices / f"0000:00:{4 + i:02x}.0", "0x1ae0", "0x006f", "0x120000")
    if gvnic:
        _pci(devices / "0000:00:03.0", "0x1ae0", "0x0042", "0x020000")
    dev = root / "dev"
    (dev / "vfio").mkdir(parents=True)
    (dev / "vfio" / "vfio").touch()  # the VFIO container file: no chip
    for i in range(chips):
        (dev / "vfio" / str(i) if vfio else dev / f"accel{i}").touch()
    (root / "proc" / "1" / "fd").mkdir(parents=True)
    os.symlink("/dev/null", root / "proc" / "1" / "fd" / "0")
    (root / "proc" / "1" / "cmdline").write_bytes(b"/sbin/init\0")
    if holder:
        pid, argv = holder
        fd = root / "proc" / str(pid) / "fd"
        fd.mkdir(parents=True)
        os.symlink("/dev/null", fd / "1")
        os.symlink("/dev/vfio/0" if vfio else "/dev/accel0", fd / "7")
        (root / "proc" / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    return root


def _pci(path, vendor, device, cls):
    path.mkdir()
    (path / "vendor").write_text(vendor + "\n")
    (path / "device").write_text(device + "\n")
    (path / "class").write_text(cls + "\n")


def test_chips_are_found_as_a_tpu_vm_shows_them(tmp_path):
    """v6e: four PCI TPU devices and /dev/vfio/0..3 (Google's NIC and the VFIO container file are no chips); v4:
    /dev/accel0..3 with sysfs hidden; a machine with /dev/vfio/N of another device (PCI visible, no Google TPU) has
    none; an empty root has none."""
    v6e = accelerators.find_chips(fake_machine(tmp_path / "v6e"))
    assert v6e.count == 4 and v6e.device_files == tuple(f"/dev/vfio/{i}" for i in range(4))
    assert v6e.describe().startswith("4 TPU v6e chips (PCI 0000:00:04.0")
    assert accelerators.find_chips(fake_machine(tmp_path / "v4", pci=False, vfio=False, gvnic=False)).count == 4
    other = fake_machine(tmp_path / "other", pci=False)
    assert accelerators.find_chips(other).count == 0
    assert accelerators.find_chips(tmp_path / "empty").count == 0


def test_the_processes_holding_the_chips_are_named(tmp_path):
    root = fake_machine(tmp_path, holder=(4242, ["python", "main.py", "--listen"]))
    holders, hidden = accelerators.chip_holders(accelerators.find_chips(root), root, own_pid=1)
    assert [(h.pid, h.command, h.device_file) for h in holders] == [(4242, "python main.py --listen", "/dev/vfio/0")]
    assert hidden == 0


def load_pack(name):
    """The pack's folder imported as ComfyUI imports it (a module spec on its __init__.py)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _expect(environ, root):
    return accelerators.expectation({k: str(v) for k, v in environ.items()}, root)


def test_a_machine_with_chips_stops_on_the_cpu_naming_every_cause_and_its_fix(tmp_path, monkeypatch):
    """JAX here runs on the CPU (the tests' JAX_PLATFORMS=cpu); on a faked v6e-4 whose chips another process holds,
    whose libtpu is missing and whose jaxlib is another release, starting the backend raises with each cause, its
    fix, and how to accept the CPU anyway."""
    from importlib import metadata

    root = fake_machine(tmp_path, holder=(4242, ["python", "main.py", "--listen"]))
    expected = _expect({}, root)
    assert expected.platform == "tpu" and "4 TPU v6e chips" in expected.why
    version = metadata.version
    monkeypatch.setattr(accelerators, "libtpu_installed", lambda: False)
    monkeypatch.setattr(metadata, "version", lambda name: "0.9.0" if name == "jaxlib" else version(name))
    with pytest.raises(AcceleratorUnavailable) as raised:
        accelerators.start_backend(expected)
    text = str(raised.value)
    assert text.startswith("the runtime would run on the CPU, not the TPU: this machine has 4 TPU v6e chips")
    assert "JAX started on the CPU" in text
    assert "JAX_PLATFORMS=cpu keeps JAX off the TPU: unset it" in text
    assert f"libtpu is not installed in this Python ({sys.executable})" in text and '"jax[tpu]"' in text
    assert "pid 4242 (`python main.py --listen`) has /dev/vfio/0 open" in text and "`kill 4242`" in text
    assert f"jax {jax.__version__} needs jaxlib" in text and "jaxlib 0.9.0 is installed" in text
    assert f'jax[tpu]=={jax.__version__}' in text
    assert "set TPU_VIDEO_ALLOW_CPU=1" in text
    assert not isinstance(raised.value, InputError)  # nothing may take it for bad input and fall back to the host


def test_allow_cpu_runs_on_the_cpu_with_one_warning_line(tmp_path, runtime):
    root = fake_machine(tmp_path, chips=1, holder=(77, ["comfyui"]))
    devices, warning = accelerators.start_backend(_expect({"TPU_VIDEO_ALLOW_CPU": 1}, root))
    assert devices[0].platform == "cpu"
    assert "this machine has 1 TPU v6e chip" in warning and "pid 77 (`comfyui`)" in warning
    assert "\n" not in warning


def test_a_cpu_chosen_on_a_machine_without_chips_stays_allowed(tmp_path):
    expected = _expect({"JAX_PLATFORMS": "cpu"}, tmp_path)
    assert expected.platform is None
    assert accelerators.start_backend(expected)[1] == ""
    assert _expect({"TPU_VIDEO_EXPECT": "cpu"}, fake_machine(tmp_path / "tpu")).platform is None
    with pytest.raises(InputError, match="TPU_VIDEO_EXPECT='tpu-v6e': use tpu, gpu or cpu"):
        _expect({"TPU_VIDEO_EXPECT": "tpu-v6e"}, tmp_path)


def test_a_platform_named_in_jax_platforms_is_expected(tmp_path):
    """``JAX_PLATFORMS=tpu`` on a machine JAX cannot start a TPU on is the same stop, not JAX's traceback."""
    assert _expect({"JAX_PLATFORMS": "tpu"}, tmp_path).why == "JAX_PLATFORMS=tpu"
    assert _expect({"JAX_PLATFORMS": "cuda,cpu"}, tmp_path).platform == "gpu"
    assert _expect({"JAX_PLATFORMS": "cpu,tpu"}, tmp_path).platform is None


def test_a_gpu_asked_for_names_the_missing_plugin_and_device(tmp_path):
    with pytest.raises(AcceleratorUnavailable) as raised:
        accelerators.start_backend(_expect({"TPU_VIDEO_EXPECT": "gpu"}, tmp_path))
    assert "not the GPU: TPU_VIDEO_EXPECT=gpu" in str(raised.value)
    assert "/dev/nvidia0" in str(raised.value)


def test_the_first_node_that_needs_the_runtime_shows_why_and_every_later_one_too(monkeypatch):
    """The runtime's start fails once and the process keeps the reason (JAX starts its backend once): the node that
    asked raises it, and so do the next ones, without starting anything again. The automatic mode does not take it
    for a model to leave on the host."""
    from tpu_runtime.bridge import auto, diffusion
    from tpu_runtime.engine import runtime as runtime_module

    starts = []

    def failing(*args, **kwargs):
        starts.append(1)
        raise AcceleratorUnavailable("the runtime would run on the CPU, not the TPU: test")

    monkeypatch.setattr(runtime_module, "_runtime", None)
    monkeypatch.setattr(runtime_module, "_start_failure", None)
    monkeypatch.setattr(runtime_module, "Runtime", failing)
    TPUDiffusionModel = load_pack("tpu_video_nodes_device_errors").NODE_CLASS_MAPPINGS["TPUDiffusionModel"]
    for _ in range(2):
        with pytest.raises(AcceleratorUnavailable, match="not the TPU: test"):
            TPUDiffusionModel().apply(model=object())
    assert starts == [1]
    monkeypatch.setattr(diffusion, "diffusion_model_on_runtime", lambda value, settings: value)
    monkeypatch.setattr(auto, "_with_fallback", lambda patcher: [])
    with pytest.raises(AcceleratorUnavailable):
        auto.on_runtime("model", object(), "UNETLoader")


def test_the_cli_stops_with_the_reason_within_seconds_before_any_model_is_built(tmp_path):
    """`TPU_VIDEO_EXPECT=tpu python -m tpu_runtime demo` on this machine (no chips), and on a faked v6e-4 whose chips
    another process holds (libtpu, installed here, tries and fails): status 2, the reason on stderr, no traceback, no
    demo model built."""
    env = subprocess_env(TPU_VIDEO_CACHE_DIR=tmp_path / "cache")
    env.pop("JAX_PLATFORMS")
    root = fake_machine(tmp_path / "machine", holder=(4242, ["python", "main.py", "--listen"]))
    runs = {"expect": dict(env, TPU_VIDEO_EXPECT="tpu"), "chips": dict(env, TPU_VIDEO_HOST_ROOT=str(root))}
    start = time.perf_counter()
    procs = {name: subprocess.Popen([sys.executable, "-m", "tpu_runtime", "demo", "--output-dir",
                                     str(tmp_path / name)], env=run_env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for name, run_env in runs.items()}
    # Measured alone on the 2-core development machine: 8-9 s each, most of it importing torch and JAX. The bound
    # catches a start that waits (a libtpu retrying, a metadata server), not a slow machine.
    results = {}
    for name, proc in procs.items():
        err = proc.communicate(timeout=180)[1]
        results[name] = (proc.returncode, err)
    seconds = time.perf_counter() - start
    for name, (code, err) in results.items():
        assert code == 2, (name, err[-3000:])
        assert "error: the runtime would run on the CPU, not the TPU" in err and "Traceback" not in err, err[-3000:]
        assert not list((tmp_path / name).glob("tiny_random_*")), name  # stopped before the model was built
    expect_err, chips_err = results["expect"][1], results["chips"][1]
    assert "TPU_VIDEO_EXPECT=tpu, but there is no TPU here to start" in expect_err
    assert "this machine shows no TPU chip" in expect_err
    assert "this machine has 4 TPU v6e chips" in chips_err and "JAX could not start the TPU" in chips_err
    assert "pid 4242 (`python main.py --listen`) has /dev/vfio/0 open" in chips_err
    assert "JAX said: Unable to initialize backend 'tpu'" in chips_err
    assert seconds < 180, seconds


# --- out of device memory -------------------------------------------------------------------------------------------
# XLA's own texts (TPU device buffers, TPU compiles, the runtime allocator on GPUs).
PLACING = ("RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 1.00G. That was not possible. "
           "There are 512.00M free.; (0x0x0_HBM0)")
COMPILING = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent error. Ran out of memory in "
             "memory space hbm. Used 20.53G of 15.48G hbm. Exceeded hbm capacity by 5.05G.")
RUNNING = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 25.81GiB"


def xla_error(text):
    return jax.errors.JaxRuntimeError(text)


@pytest.mark.parametrize("text, needed, there, what", [
    (PLACING, 1.0, 0.5, "free"),
    (COMPILING, 20.53, 15.48, "a chip has"),
    ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (17.12G) exceeds "
     "available HBM (15.75G).", 17.12, 15.75, "a chip has"),
    ("RESOURCE_EXHAUSTED: Attempting to reserve 10.51G at the bottom of memory. That was not possible. There are "
     "8.97G free, 0B reserved, and 8.97G reservable.", 10.51, 8.97, "free"),
    (RUNNING, 25.81, None, None),
    ("RESOURCE_EXHAUSTED: Failed to allocate request for 32.00MiB (33554432B) on device ordinal 0", 1 / 32, None,
     None),
    ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1073741824 bytes.", 1.0, None, None),
])
def test_xla_memory_messages_are_read(text, needed, there, what):
    found_needed, found_there, found_what = memory.reported_bytes(text)
    assert found_needed == pytest.approx(needed * GIB, rel=1e-3) and found_what == what
    assert found_there == (None if there is None else pytest.approx(there * GIB, rel=1e-3))
    assert memory.is_out_of_memory(xla_error(text))


def test_the_bridge_names_placement_and_call_out_of_memory(runtime, monkeypatch):
    """``BridgedModule``: placing the weights and a call, each out of device memory, against a chip of 16 GiB."""
    from tpu_runtime.bridge.program import BridgedModule
    from tpu_runtime.bridge.rules import GENERIC

    monkeypatch.setattr(memory, "chip_memory", lambda devices: (16 * GIB, 15 * GIB))
    module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    bridged = BridgedModule(module=module, method=type(module).forward, rules=GENERIC, options_arg=None,
                            label="UMT5XXL", memory_hint="Split the text encoder over more devices (a larger slice).")
    put = runtime.put

    def full(value, sharding=None):
        raise xla_error(PLACING)

    monkeypatch.setattr(runtime, "put", full)
    with pytest.raises(DeviceMemoryError) as raised:
        bridged(torch.randn(2, 7, 64))
    text = str(raised.value)
    weights = sum(t.numel() * 4 for t in module.parameters())
    assert text.startswith("UMT5XXL ran out of device memory while placing its weights on mesh dp=1,sp=1,tp=1 "
                           "(1 device, cpu): its weights are " + memory.gib(weights))
    assert "XLA asked for 1.00 GiB where 0.50 GiB were free; a chip has 16.00 GiB, 15.00 GiB of it in use" in text
    assert "Split the text encoder over more devices" in text
    assert "`python -m tpu_runtime plan --comfy-model MODEL --comfy COMFYUI_DIR --topology SLICE`" in text
    monkeypatch.setattr(runtime, "put", put)
    bridged(torch.randn(2, 7, 64))
    for variant in [v for variants in bridged._variants.values() for v in variants]:
        monkeypatch.setattr(variant, "executable", lambda *a: (_ for _ in ()).throw(xla_error(RUNNING)))
    with pytest.raises(DeviceMemoryError, match=r"UMT5XXL ran out of device memory for inputs 2x7x64 on mesh "
                       r"dp=1,sp=1,tp=1 .*: XLA asked for 25.81 GiB; a chip has 16.00 GiB"):
        bridged(torch.randn(2, 7, 64))


EIGHT_DEVICES = """
import jax, torch
from tpu_runtime.bridge.program import BridgedModule
from tpu_runtime.bridge.rules import GENERIC
from tpu_runtime.engine import memory
from tpu_runtime.engine.runtime import get_runtime
from tpu_runtime.errors import DeviceMemoryError

runtime = get_runtime()
module = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
bridged = BridgedModule(module=module, method=type(module).forward, rules=GENERIC, options_arg=None, label="Big")
placed = []

def fill(value, sharding=None):  # the slice's memory is full after the first weight
    if placed:
        raise jax.errors.JaxRuntimeError(PLACING)
    placed.append(sharding)
    return put(value, sharding)

put, runtime.put = runtime.put, fill
memory.chip_memory = lambda devices: (16 * 2 ** 30, 15 * 2 ** 30)  # what a v5e chip would report
try:
    bridged(torch.randn(4, 1024))
except DeviceMemoryError as error:
    print(error)
"""


def test_a_full_slice_of_eight_devices_is_named_with_its_mesh(tmp_path):
    """On a mesh of 8 (CPU) devices, a placement that finds the slice's memory full names the mesh the weights were
    being split over and its 8 devices."""
    out = subprocess.run([sys.executable, "-c", f"PLACING = {PLACING!r}\n" + EIGHT_DEVICES], capture_output=True,
                         text=True, timeout=300, env=subprocess_env(
                             XLA_FLAGS="--xla_force_host_platform_device_count=8",
                             TPU_VIDEO_CACHE_DIR=tmp_path / "cache"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("Big ran out of device memory while placing its weights on mesh dp=1,sp=8,tp=1 (8 "
                                 "devices, cpu): its weights are 8 MiB in all"), out.stdout
    assert "XLA asked for 1.00 GiB where 0.50 GiB were free; a chip has 16.00 GiB, 15.00 GiB of it in use" in out.stdout


@pytest.fixture
def family(tiny_models, runtime):
    from tpu_runtime.families.registry import open_model

    return open_model(tiny_models["2b"], dtype="float32")


def test_a_family_names_its_component_when_the_weights_do_not_fit(family, runtime, monkeypatch):
    def full(value, sharding=None):
        raise xla_error(PLACING)

    monkeypatch.setattr(runtime, "put", full)
    with pytest.raises(DeviceMemoryError) as raised:
        family.component("transformer")
    text = str(raised.value)
    assert text.startswith(f"{family.label}/transformer ran out of device memory while placing its weights on mesh "
                           "dp=1,sp=1,tp=1 (1 device, cpu): its weights are ")
    assert "(float32) in all; XLA asked for 1.00 GiB where 0.50 GiB were free" in text
    assert "a larger slice" in text and "`fsdp`" in text and "smaller height, width or frame count" in text
    assert f"`python -m tpu_runtime plan --model {family.path} --topology SLICE" in text
    assert "(XLA: RESOURCE_EXHAUSTED: Error allocating device buffer" in text


def test_a_family_names_the_stage_that_does_not_fit(family, runtime, monkeypatch):
    """The text encoder's program refused by the compiler; the sampling step and the VAE decode out of memory when
    they run."""
    from tpu_runtime.engine.stages import SampleSettings, VideoLatents

    compiled = runtime.compiled

    def refused(*args, **kwargs):
        raise xla_error(COMPILING)

    monkeypatch.setattr(runtime, "compiled", refused)
    with pytest.raises(DeviceMemoryError, match=rf"^{family.label}'s encode program \(.*\) ran out of device memory "
                       r"while compiling it on mesh dp=1,sp=1,tp=1 \(1 device, cpu\): XLA needed 20.53 GiB where a "
                       r"chip has 15.48 GiB\. Use a larger slice"):
        family.encode("a cat")
    monkeypatch.setattr(runtime, "compiled", compiled)
    embeddings = family.encode("a cat")

    def running(*args, **kwargs):
        def out_of_memory(*call_args):
            raise xla_error(RUNNING)
        return out_of_memory

    monkeypatch.setattr(runtime, "compiled", running)
    settings = SampleSettings(height=64, width=96, num_frames=9, steps=2, guidance=6.0, seed=1)
    with pytest.raises(DeviceMemoryError, match=rf"^{family.label}'s sampling step ran out of device memory at step 1 "
                       r"of 2 on mesh .*XLA asked for 25.81 GiB"):
        family.sample(embeddings, settings)
    z = torch.zeros(1, family.latent_channels(), 3, 8, 12)
    with pytest.raises(DeviceMemoryError, match=rf"^{family.label}'s decode stage \(.*\) ran out of device memory "
                       r"while running it on mesh .*XLA asked for 25.81 GiB"):
        family.decode(VideoLatents(z, 64, 96, 9, family.signature))
