"""ComfyUI's dynamic VRAM (``ModelPatcherDynamic``, newer ComfyUI on a GPU machine without ``--cpu``): such a patcher
applies LoRAs only while casting each layer for its GPU and never merges them into the host weights the TPU nodes
place, so the nodes refuse it before any step, naming the flags that avoid it; the automatic mode leaves such a
model on the host (where ComfyUI applies its LoRA) and says so. A LoRA is never dropped silently.

ComfyUI only builds a dynamic patcher for a GPU device; the tests build one for the host the way ComfyUI's
constructor would, with comfy-aimdo's pinned host buffers (GPU memory) stubbed out."""

import logging

import pytest
import torch
from comfy_native import comfyui_session, load, load_pack, save_diffusion_model, tiny_wan, versions_param

pytestmark = pytest.mark.comfy_versions("0.33")  # older ComfyUI has no dynamic patcher


@pytest.fixture(scope="module", params=versions_param())
def pack(request):
    with comfyui_session(request.param):
        yield load_pack()


class _HostBuffer:  # comfy-aimdo's pinned buffer, not needed on the host
    def __init__(self, *args, **kwargs):
        pass


def dynamic(patcher, monkeypatch):
    """A ``ModelPatcherDynamic`` of ``patcher``'s model, with ``patcher``'s weight patches."""
    import comfy.model_patcher
    import comfy_aimdo.host_buffer

    monkeypatch.setattr(comfy_aimdo.host_buffer, "HostBuffer", _HostBuffer)
    cls = comfy.model_patcher.ModelPatcherDynamic
    out = object.__new__(cls)  # the constructor hands a host device to the classic patcher
    cls.__init__(out, patcher.model, patcher.load_device, patcher.offload_device)
    out.patches = dict(patcher.patches)
    out.patches_uuid = patcher.patches_uuid
    assert out.is_dynamic()
    return out


@pytest.fixture(scope="module")
def wan_file(pack, tmp_path_factory):
    return save_diffusion_model(tiny_wan("t2v", layers=1), tmp_path_factory.mktemp("dyn") / "wan.safetensors", seed=3)


def _with_lora(model):
    import comfy.sd

    g = torch.Generator().manual_seed(1)
    lora = {}
    for name, weight in model.model.diffusion_model.named_parameters():
        if ".self_attn.q." in name and name.endswith(".weight"):
            key = "diffusion_model." + name[: -len(".weight")]
            lora[f"{key}.lora_up.weight"] = torch.randn(weight.shape[0], 2, generator=g)
            lora[f"{key}.lora_down.weight"] = torch.randn(2, weight.shape[1], generator=g)
    return comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0)[0]


def test_the_tpu_nodes_refuse_a_dynamic_patcher_naming_the_flags(pack, wan_file, monkeypatch):
    from tpu_runtime.errors import InputError

    model = dynamic(_with_lora(load(wan_file)), monkeypatch)
    with pytest.raises(InputError) as refused:
        pack.NODE_CLASS_MAPPINGS["TPUDiffusionModel"]().apply(model)
    message = str(refused.value)
    assert "WanModel" in message and "--cpu" in message and "--disable-dynamic-vram" in message


def test_the_automatic_mode_leaves_a_dynamic_model_on_the_host(pack, wan_file, monkeypatch, caplog):
    from tpu_runtime.bridge import auto

    model = dynamic(_with_lora(load(wan_file)), monkeypatch)
    with caplog.at_level(logging.WARNING, logger="tpu_runtime.bridge.auto"):
        out = auto.on_runtime("model", model, "UNETLoader")
    assert out is model and not any(k.startswith("diffusion_model.") for k in out.object_patches)
    assert "stays on the host" in caplog.text and "--disable-dynamic-vram" in caplog.text
