"""Runtime pieces: the torchax import workaround, the mesh, the compilation-cache directory, transfers."""

import subprocess
import sys

import pytest
import torch
from conftest import subprocess_env


def test_torchax_imports_and_runs_on_this_torch(runtime):
    from tpu_runtime._torchax_compat import import_torchax

    torchax = import_torchax()
    env = torchax.default_env()
    with env:
        a = torch.arange(6, dtype=torch.float32, device="jax").reshape(2, 3)
        total = (a @ a.T).sum()
    cpu = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert float(runtime.to_cpu(env.t2j_iso(total))) == float((cpu @ cpu.T).sum())


_SIMULATE_NEWER_TORCH = r"""
# Simulate a torch build that dropped whole ops torchax 0.0.13 names (as torch 2.15 dropped aten::cholesky/qr).
# Only torchax's own lookups see the ops as missing; torch's internals keep working as on that newer build.
import sys, torch, torch._ops as ops
real = ops._OpNamespace.__getattr__
def without(self, name):
    frame = sys._getframe(1)
    if frame.f_globals.get("__name__") == "tpu_runtime._torchax_compat":  # the workaround's own wrapper
        frame = frame.f_back
    from_torchax = frame.f_globals.get("__name__", "").split(".")[0] == "torchax"
    if self.name == "aten" and name in ("cholesky", "qr") and from_torchax:
        raise AttributeError(f"'_OpNamespace' 'aten' object has no attribute '{name}'")
    return real(self, name)
ops._OpNamespace.__getattr__ = without
cached = {n: torch.ops.aten.__dict__.pop(n) for n in ("cholesky", "qr") if n in torch.ops.aten.__dict__}
from tpu_runtime._torchax_compat import import_torchax, tolerated_missing_ops
tx = import_torchax()
env = tx.default_env()
with env:
    x = (torch.ones(3, device="jax") * 2).sum()
print("OK", float(env.t2j_iso(x)), sorted(set(n for n in tolerated_missing_ops if n in ("aten::cholesky", "aten::qr"))))
"""


def test_torchax_import_tolerates_ops_missing_from_newer_torch():
    proc = subprocess.run([sys.executable, "-c", _SIMULATE_NEWER_TORCH], env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK 6.0 ['aten::cholesky', 'aten::qr']" in proc.stdout


def test_compat_leaves_torch_ops_untouched_after_import(runtime):
    import torch._ops as ops

    from tpu_runtime import _torchax_compat

    assert ops.OpOverloadPacket.__getattr__.__qualname__ == "OpOverloadPacket.__getattr__"
    with pytest.raises(AttributeError):
        torch.ops.aten.prod.dim_Dimname_does_not_exist  # noqa: B018 - lookups fail normally again
    assert all(isinstance(n, str) for n in _torchax_compat.tolerated_missing_ops)


def test_mesh_must_match_device_count(runtime):
    from tpu_runtime.errors import InputError
    from tpu_runtime.engine.sharding import MeshSpec

    with pytest.raises(InputError, match=r"mesh dp=2,sp=1,tp=1 uses 2 devices but 1 are available"):
        runtime.make_mesh(MeshSpec(dp=2))
    assert runtime.make_mesh(MeshSpec()).axis_names == ("dp", "sp", "tp")


def test_eight_devices_in_a_subprocess(tmp_path):
    code = ("from tpu_runtime.engine.runtime import get_runtime; from tpu_runtime.engine.sharding import MeshSpec; "
            "r = get_runtime(); print(len(r.devices), dict(r.make_mesh(MeshSpec(2, 1, 4)).shape))")
    proc = subprocess.run([sys.executable, "-c", code],
                          env=subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=8",
                                             TPU_VIDEO_CACHE_DIR=tmp_path / "new" / "cache"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "8 {'dp': 2, 'sp': 1, 'tp': 4}" in proc.stdout
    assert (tmp_path / "new" / "cache").is_dir()  # created when missing


def test_one_cache_dir_per_process(runtime, tmp_path):
    from tpu_runtime.engine.runtime import get_runtime

    assert get_runtime() is runtime
    with pytest.raises(ValueError, match="a process has one cache directory"):
        get_runtime(cache_dir=tmp_path)


def test_transfers_round_trip_bfloat16(runtime):
    x = torch.randn(3, 5).to(torch.bfloat16)
    back = runtime.to_cpu(runtime.put(x))
    assert back.dtype == torch.bfloat16 and torch.equal(back, x)
