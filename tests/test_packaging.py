"""What ComfyUI Manager and the Comfy Registry read: the registry metadata (``[tool.comfy]`` with an icon that ships
with the pack, ``[project.urls]``), and requirements.txt the same as the project's dependencies without torch (the
pack never replaces the torch a ComfyUI install has). The registry's own validation (``comfy node validate``) runs
in the CI script."""

import re
import tomllib
from pathlib import Path

from conftest import ROOT


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_registry_metadata_names_the_repository_and_an_icon_that_ships():
    project, comfy = _pyproject()["project"], _pyproject()["tool"]["comfy"]
    repository = project["urls"]["Repository"]
    assert repository.startswith("https://github.com/") and project["version"]
    assert comfy["PublisherId"] and comfy["DisplayName"]
    icon = comfy["Icon"]
    assert icon.startswith(repository.replace("https://github.com/", "https://raw.githubusercontent.com/"))
    path = ROOT / icon.split("/main/", 1)[1]
    assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_requirements_are_the_dependencies_without_torch():
    def names(lines):
        return {re.split(r"[<>=\[ ]", line.strip(), maxsplit=1)[0].lower() for line in lines
                if line.strip() and not line.startswith("#")}

    dependencies = names(_pyproject()["project"]["dependencies"])
    requirements = names((ROOT / "requirements.txt").read_text().splitlines())
    assert "torch" in dependencies and "torch" not in requirements
    assert requirements == dependencies - {"torch"}
    assert Path(ROOT / "pyproject.toml").read_text().count('"torch>=') == 1  # never a pin that replaces torch


# --- the test environment: the README's commands, CI's script, both ComfyUI trees -------------------------------------
def _quick_start() -> list[str]:
    """The shell commands of the README's Quick start block."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _ci_lines() -> list[str]:
    return [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_ci_installs_and_runs_what_the_readme_says():
    """The README's two commands stay true: the torch it pins for the demo is the tests', the tests' install line is
    the pins CI installs with the test extra, and CI ends with the README's test command."""
    demo, tests = _quick_start()
    install, run = tests.split(" && ")
    pins = install.removeprefix("pip install ").removesuffix(' -e ".[test]"').split()
    assert {p.split("==")[0] for p in pins} == {"torch", "torchvision", "torchaudio"}, pins
    assert demo == f"pip install {pins[0]} -e . && python -m tpu_runtime demo", demo
    ci = _ci_lines()
    assert f'TORCH="{" ".join(pins)}"' in ci
    assert 'python -m pip install -q $TORCH -e ".[test]"' in ci
    assert ci[-1] == run == "python -m pytest -q"


def _test_extra() -> dict:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    requirements = [Requirement(r) for r in _pyproject()["project"]["optional-dependencies"]["test"]]
    return {canonicalize_name(r.name): r for r in requirements}


# What the test extra leaves out of a ComfyUI tree's requirements.txt: torch (the README's install line pins it) and
# the libraries only 0.33's 3D and GLSL nodes import, which no test runs.
NOT_IN_THE_TEST_EXTRA = {"torch", "pyopengl", "comfy-angle"}


def test_the_test_extra_installs_what_each_comfyui_tree_requires():
    """Every requirement of each ComfyUI tree the tests run is in the test extra (or the pack's own dependencies)
    and installed at a version the tree accepts, except the frontend packages, of which one version can be
    installed: the extra pins one tree's, and that one is installed."""
    from importlib.metadata import version

    from comfy_native import COMFYUI_TREES
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    extra = _test_extra()
    dependencies = {canonicalize_name(Requirement(r).name) for r in _pyproject()["project"]["dependencies"]}
    frontend_pins = {}
    for tree_version, tree in COMFYUI_TREES.items():
        for line in (tree / "requirements.txt").read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            wanted = Requirement(line)
            name = canonicalize_name(wanted.name)
            if name in NOT_IN_THE_TEST_EXTRA:
                continue
            assert name in extra or name in dependencies, f"ComfyUI {tree_version} requires {line}: not installed"
            installed = version(name)
            if name in extra:  # this environment is the one the test extra makes
                assert extra[name].specifier.contains(installed, prereleases=True), (extra[name], installed)
            if name.startswith("comfyui-"):
                frontend_pins.setdefault(name, set()).add(str(wanted.specifier))
                continue
            assert wanted.specifier.contains(installed, prereleases=True), (tree_version, line, installed)
    assert frontend_pins, "no ComfyUI tree read"
    for name, pins in frontend_pins.items():
        assert str(extra[name].specifier) in pins, (name, extra[name], pins)
        assert extra[name].specifier.contains(version(name)), (name, version(name))
