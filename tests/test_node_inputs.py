"""What the page shows of the nodes: a tooltip on every input, display names ComfyUI's node search finds whole,
widgets that can only hold values the family's models take (sizes and lengths stepped by the family's rules,
ComfyUI's own input names, no magic "unset" values), and the compilation cache folder as a setting of the server,
not an input of each node."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest
from conftest import ROOT

# ComfyUI's node search (comfyui-frontend-package's NodeSearchService) is Fuse.js over name, display_name and
# search_aliases, with useExtendedSearch and threshold 0.3 and Fuse's default location 0 and distance 100: the query
# is cut at spaces into words that must all be found, and an exact match of a word found at index i of the display
# name scores i / distance, so a word first found past index 30 is no match and the whole name finds nothing
# ("LTX-2 Loader from ComfyUI files (TPU)": its "(tpu)" sits at 32). Extended search also gives a word a meaning by
# its first or last character (=, ', !, ^ in front, $ at the end) and splits the query at |.
SEARCH_THRESHOLD, SEARCH_DISTANCE = 0.3, 100
WIDGETS = ("INT", "FLOAT", "STRING", "BOOLEAN")
RENAMED = {"frames": "length", "guidance": "cfg", "guidance_2": "cfg_2", "audio_guidance": "audio_cfg"}


def found_whole(display_name: str) -> bool:
    """Whether ComfyUI's node search, given the whole display name, matches it (the rule above)."""
    text = display_name.lower()
    for word in text.split():
        if word[0] in "='!^" or word.endswith("$") or "|" in word or '"' in word:
            return False
        if text.find(word) / SEARCH_DISTANCE > SEARCH_THRESHOLD:
            return False
    return True


@pytest.fixture(scope="module")
def pack():
    """The folder imported as ComfyUI imports it."""
    name = "tpu_video_nodes_inputs_under_test"
    spec = importlib.util.spec_from_file_location(name, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _inputs(cls):
    for section in ("required", "optional"):
        for name, spec in cls.INPUT_TYPES().get(section, {}).items():
            yield section, name, spec[0], (spec[1] if len(spec) > 1 else None) or {}


def test_every_input_of_every_node_has_a_tooltip(pack):
    missing = [f"{node}.{name}" for node, cls in pack.NODE_CLASS_MAPPINGS.items()
               for _, name, _, options in _inputs(cls) if not str(options.get("tooltip", "")).strip()]
    assert not missing, f"inputs without a tooltip: {missing}"
    assert sum(1 for cls in pack.NODE_CLASS_MAPPINGS.values() for _ in _inputs(cls)) > 150  # every node walked


def test_the_search_rule_is_the_pinned_frontends():
    """The rule above, read from the frontend ComfyUI pins: the node search's Fuse options, and what the issue saw
    in the page (the full name of the LTX-2 files loader found nothing; without " (TPU)" it was found)."""
    try:
        import comfyui_frontend_package
    except ImportError:
        pytest.fail("comfyui-frontend-package is missing: pip install -e \".[test]\" (the test extra pins it)")
    assets = Path(comfyui_frontend_package.__file__).parent / "static" / "assets"
    options = None
    for script in assets.glob("*.js"):
        text = script.read_text(errors="ignore")
        at = text.find("nodeFuseSearch")
        while at != -1 and options is None:
            found = re.search(r"fuseOptions\s*:\s*\{(.*?)\}", text[at:at + 2000], re.S)
            if found and "display_name" in found.group(1):
                options = found.group(1)
            at = text.find("nodeFuseSearch", at + 1)
        if options:
            break
    assert options, f"no node search options found in {assets}"
    assert re.search(r"threshold\s*:\s*0?\.3\b", options) and re.search(r"useExtendedSearch\s*:\s*(true|!0)", options)
    assert not re.search(r"ignoreLocation|distance|location", options), options  # Fuse's defaults: 0 and 100
    assert not found_whole("LTX-2 Loader from ComfyUI files (TPU)") and found_whole("LTX-2 Loader from ComfyUI files")


def test_every_display_name_is_found_whole_by_the_node_search(pack):
    names = pack.NODE_DISPLAY_NAME_MAPPINGS
    assert set(names) == set(pack.NODE_CLASS_MAPPINGS)
    assert [name for name in names.values() if not found_whole(name)] == []
    assert len(set(names.values())) == len(names)
    # "TPU" finds every node: each class name starts with it (a match at index 0)
    assert all(key.startswith("TPU") for key in names)


def test_sizes_and_lengths_step_by_the_family_rules(pack):
    """The sampler's and Image Encode's width, height and length widgets snap (ComfyUI's page rounds an INT to
    min + k * step) to the family's rule: multiples of its size step from it, length_step * N + 1 frames."""
    from tpu_runtime.families import registry

    expected = {"cogvideox": (16, 8), "wan": (16, 4), "ltx2": (32, 8)}  # Wan's TI2V-5B (32) is refused by the model
    for spec in registry.FAMILIES:
        size_step, length_step = expected[spec.name]
        sampler = spec.nodes.sampler
        assert (sampler.size_step, sampler.length_step) == (size_step, length_step), spec.name
        for kind in ("Sampler", "ImageEncode"):
            required = pack.NODE_CLASS_MAPPINGS[spec.nodes.prefix + kind].INPUT_TYPES()["required"]
            for name in ("width", "height"):
                options = required[name][1]
                assert (options["min"], options["step"]) == (size_step, size_step), (kind, name)
                assert options["default"] % size_step == 0 and options["max"] % size_step == 0
            options = required["length"][1]
            assert (options["min"], options["step"]) == (1, length_step), kind
            assert (options["default"] - 1) % length_step == 0 and (options["max"] - 1) % length_step == 0
            assert "frames" not in required


def test_the_grid_holds_every_size_a_model_takes_and_nothing_every_model_refuses(tiny_models, tiny_wan, tiny_ltx2):
    """For each family, every frame count and height a generation of it takes lies on the widget grid, and every
    grid value near the native size is taken by one of its generations (the finer rule where they differ)."""
    from tpu_runtime.errors import InputError
    from tpu_runtime.families import registry

    folders = {"cogvideox": [tiny_models[g] for g in ("2b", "1.5")],
               "wan": [tiny_wan[g] for g in ("2.1", "2.2-TI2V-5B")], "ltx2": [tiny_ltx2["2.0"]]}
    for spec in registry.FAMILIES:
        step, length_step = spec.nodes.sampler.size_step, spec.nodes.sampler.length_step
        models = [registry.open_model(str(folder), dtype="float32") for folder in folders[spec.name]]

        def takes(model, height=None, frames=None):
            native_h, native_w, native_f = model.native_size()
            try:
                model.validate(height or native_h, native_w, frames or native_f)
            except InputError:
                return False
            return True

        for frames in range(1, 42):
            on_grid = (frames - 1) % length_step == 0
            assert on_grid or not any(takes(m, frames=frames) for m in models), (spec.name, frames)
            assert not on_grid or any(takes(m, frames=frames) for m in models), (spec.name, frames)
        for height in range(8, 4 * step + 1, 8):
            on_grid = height % step == 0
            assert on_grid or not any(takes(m, height=height) for m in models), (spec.name, height)
            assert not on_grid or any(takes(m, height=height) for m in models), (spec.name, height)


def test_comfyui_names_and_no_magic_unset_values(pack):
    """cfg and length (ComfyUI's names); a number the model decides is an input left unconnected (no widget, so
    no value that secretly means "unset"); no input holds a -1 or 0 meaning "the model's"."""
    m = pack.NODE_CLASS_MAPPINGS
    for node, cls in m.items():
        for section, name, kind, options in _inputs(cls):
            assert name not in RENAMED, f"{node}.{name}: ComfyUI calls it {RENAMED.get(name)}"
            assert name != "cache_dir", f"{node}.cache_dir: a process-wide setting, in the settings dialog"
            tip = str(options.get("tooltip", ""))
            magic = re.search(r"(-1|\b0(\.0)?) *: *(the model|the method|diffusers|the schedule|same|the guid)", tip)
            assert not magic and options.get("default") != -1, f"{node}.{name}: a magic value: {tip}"
            if options.get("forceInput"):
                assert section == "optional" and kind in ("INT", "FLOAT") and "unconnected" in tip, (node, name)
    wan = m["TPUWanSampler"].INPUT_TYPES()
    assert {"cfg", "length"} <= set(wan["required"])
    for name in ("shift", "cfg_2", "boundary"):
        assert wan["optional"][name][1]["forceInput"] and "default" not in wan["optional"][name][1]
    assert m["TPULTX2Sampler"].INPUT_TYPES()["optional"]["noise_scale"][1]["forceInput"]
    assert "audio_cfg" in m["TPULTX2Sampler"].INPUT_TYPES()["required"]
    threshold = m["TPUWanStepCache"].INPUT_TYPES()["required"]["threshold"][1]
    assert threshold["default"] == 0.06 and threshold["min"] == 0.0  # the value shown is the value used


def test_the_sampler_takes_unconnected_inputs_as_the_models(pack, tiny_wan):
    """Left unconnected, shift and cfg_2 are not passed (ComfyUI passes no value): the model's own; a value given
    reaches the engine under its own name, and a refusal speaks the node's names."""
    from tpu_runtime.errors import InputError

    from nodes.kinds import said_in_node_names
    from tpu_runtime.families import registry

    wan = registry.spec_named("wan")
    with pytest.raises(InputError, match=r"^length=10 must be 4\*N\+1 .*leave cfg_2 unset$"):
        with said_in_node_names(wan):
            raise InputError("frames=10 must be 4*N+1 for Wan 2.1 (nearest: 9 or 13); leave guidance_2 unset")
    with pytest.raises(InputError, match=r"^the image was encoded for 9 frames of 64x64$"):
        with said_in_node_names(wan):  # prose keeps its words
            raise InputError("the image was encoded for 9 frames of 64x64")
    from nodes.common import setting_values

    assert setting_values(wan, "sample", {}) == {}
    assert setting_values(wan, "sample", {"cfg_2": 3.0, "shift": 5.0}) == {"guidance_2": 3.0, "shift": 5.0}


def test_the_cache_folder_is_a_setting_the_runtime_starts_with(tmp_path, monkeypatch):
    """web/ adds TPUVideo.CacheDir to ComfyUI's settings dialog; the runtime, when a node first starts it, takes
    the folder the dialog saved in ComfyUI's settings store."""
    import json
    import types

    from tpu_runtime.bridge import settings_store

    script = (ROOT / "web" / "tpu_video_widgets.js").read_text()
    assert re.search(r'id:\s*"TPUVideo\.CacheDir"', script) and settings_store.CACHE_DIR_SETTING == "TPUVideo.CacheDir"
    store = tmp_path / "user" / "default" / "comfy.settings.json"
    store.parent.mkdir(parents=True)
    store.write_text(json.dumps({"TPUVideo.CacheDir": str(tmp_path / "xla")}))
    folder_paths = types.ModuleType("folder_paths")
    folder_paths.get_user_directory = lambda: str(tmp_path / "user")
    monkeypatch.setitem(sys.modules, "folder_paths", folder_paths)
    assert settings_store.comfy_setting("TPUVideo.CacheDir") == str(tmp_path / "xla")
    started = {}
    monkeypatch.setattr("tpu_runtime.engine.runtime.runtime_started", lambda: False)
    monkeypatch.setattr("tpu_runtime.engine.runtime.get_runtime", lambda cache_dir=None: started.update(dir=cache_dir))
    settings_store.runtime()
    assert started == {"dir": str(tmp_path / "xla")}
