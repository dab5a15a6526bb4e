"""What ComfyUI Manager and the Comfy Registry read: the registry metadata (``[tool.comfy]`` with an icon that ships
with the pack, ``[project.urls]``), and requirements.txt the same as the project's dependencies without torch (the
pack never replaces the torch a ComfyUI install has). The registry's own validation (``comfy node validate``) runs
in the CI script."""

import json
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
    assert '"torch"' in _pyproject_text() and '"torch>' not in _pyproject_text()  # no version: any torch satisfies it


def _pyproject_text() -> str:
    return (ROOT / "pyproject.toml").read_text()


def test_the_registry_reads_the_comfyui_versions_classifiers_links_and_license():
    """What the Comfy Registry reads (comfy-cli's pyproject parser): ``requires-comfyui`` in ``[tool.comfy]`` from the
    oldest tested ComfyUI, its OS and accelerator classifiers (it drops them all for one it does not know), the link
    names it reads, and a LICENSE file holding the Apache 2.0 text the project declares."""
    project, comfy = _pyproject()["project"], _pyproject()["tool"]["comfy"]
    assert comfy["requires-comfyui"] == ">=0.3.64"
    assert re.fullmatch(r"(==|>=|<=|!=|~=|>|<)?\d+\.\d+\.\d+", comfy["requires-comfyui"])  # the registry's pattern
    registry_os = ("Microsoft", "POSIX", "MacOS", "OS Independent")
    registry_accelerators = {"GPU :: NVIDIA CUDA", "GPU :: AMD ROCm", "GPU :: Intel Arc", "NPU :: Huawei Ascend",
                             "GPU :: Apple Metal"}
    classifiers = project["classifiers"]
    systems = [c.removeprefix("Operating System :: ") for c in classifiers if c.startswith("Operating System :: ")]
    accelerators = [c.removeprefix("Environment :: ") for c in classifiers if c.startswith("Environment ::")]
    assert systems == ["POSIX :: Linux"] and all(s.startswith(registry_os) for s in systems)
    assert accelerators == ["GPU :: NVIDIA CUDA"] and set(accelerators) <= registry_accelerators
    assert set(project["urls"]) == {"Homepage", "Repository", "Documentation", "Issues"}
    assert project["urls"]["Issues"] == project["urls"]["Repository"] + "/issues"
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"] and "END OF TERMS AND CONDITIONS" in text
    assert len(text.splitlines()) > 170  # the whole license, its 9 sections


# --- installing the pack never changes the torch a Python has --------------------------------------------------------
def _wheel(folder: Path, name: str, version: str, requires=()) -> None:
    """A minimal wheel of distribution ``name`` ``version`` requiring ``requires`` (a stand-in: no code)."""
    import zipfile

    stem = f"{re.sub(r'[-.]+', '_', name)}-{version}"
    info = f"{stem}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    files = {f"{info}/METADATA": metadata, f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: "
             "true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{stem}-py3-none-any.whl", "w") as archive:
        for path, content in files.items():
            archive.writestr(path, content)


def _lowest(specifier) -> str:
    """The lowest version a specifier names (``>=0.42.1,<0.43``: 0.42.1), or 1.0."""
    bounds = [s.version for s in specifier if s.operator in (">=", "==", "~=")]
    return min(bounds, key=lambda v: tuple(int(p) for p in re.findall(r"\d+", v))) if bounds else "1.0"


def test_installing_the_pack_never_changes_an_installed_torch(tmp_path):
    """A Python holding another torch build (a stand-in torch 2.4.0, as ComfyUI's own could be) and an index offering
    torch 2.11.0: pip's resolution of the pack with its declared dependencies (every one a stand-in wheel on that
    index) installs the pack and its libraries and leaves torch as it is. The same resolution with a versioned
    requirement (``torch>=2.5``) would replace it: the check can fail."""
    import subprocess
    import sys

    from packaging.requirements import Requirement

    wheels = tmp_path / "index"
    wheels.mkdir()
    dependencies = _pyproject()["project"]["dependencies"]
    for line in dependencies:
        requirement = Requirement(line)
        if requirement.name != "torch":
            _wheel(wheels, requirement.name, _lowest(requirement.specifier))
    _wheel(wheels, "torch", "2.11.0")
    python = tmp_path / "comfyui-python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(python)], check=True, timeout=120)
    site = next((python / "lib").glob("python3*/site-packages"))
    installed = site / "torch-2.4.0.dist-info"
    installed.mkdir()
    (installed / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.4.0\n")
    (installed / "RECORD").write_text("")

    def resolve(torch_requirement: str) -> dict:
        _wheel(wheels, "tpu-video-nodes", "0.1.0",
               [torch_requirement] + [d for d in dependencies if Requirement(d).name != "torch"])
        report = tmp_path / "report.json"
        out = subprocess.run([sys.executable, "-m", "pip", "--python", str(python / "bin" / "python"), "install",
                              "--dry-run", "--quiet", "--report", str(report), "--no-index", "--find-links",
                              str(wheels), "tpu-video-nodes"], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return {item["metadata"]["name"]: item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}

    [torch_line] = [d for d in dependencies if Requirement(d).name == "torch"]
    chosen = resolve(torch_line)
    assert "torch" not in chosen, chosen
    assert chosen["tpu-video-nodes"] == "0.1.0" and {"torchax", "jax", "diffusers"} <= set(chosen), chosen
    assert resolve("torch>=2.5")["torch"] == "2.11.0"  # a version in the requirement would have replaced it


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


# --- which slice each model needs: the docs' table, made only of numbers docs/plan.md has ---------------------------
def _slice_rows(path: Path) -> list[list[str]]:
    """The rows of the slice table in ``path`` (between its ``slice-table`` markers), as lists of cells."""
    text = path.read_text()
    table = text.split("<!-- slice-table", 1)[1].split("<!-- /slice-table -->", 1)[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in table.splitlines() if line.startswith("| ")]
    return rows[1:]  # the header out; the |---| line does not start with "| "


def test_the_slice_tables_are_rows_plan_measured():
    """README's table is rows of docs/tpu-vm.md's; every figure in them (GiB per chip, the lower bound of a step) is
    one docs/plan.md gives, and every row's command is a plan command the CLI takes, for a model it knows."""
    from tpu_runtime.bridge.architectures import ARCHITECTURES
    from tpu_runtime.families import registry
    from tpu_runtime.tools.cli import build_parser

    full, readme = _slice_rows(ROOT / "docs" / "tpu-vm.md"), _slice_rows(ROOT / "README.md")
    assert len(full) >= 15 and len(readme) >= 6
    assert all(row in full for row in readme), [row for row in readme if row not in full]
    plan_text = (ROOT / "docs" / "plan.md").read_text()
    parser = build_parser()
    for model, size, slice_, fits, memory, bound, command in full:
        for number in re.findall(r"\d+\.\d+", memory) + re.findall(r"\d+\.\d+ s", bound):
            assert number in plan_text, (model, slice_, number)
        assert re.search(r"\d+\.\d+", memory) or memory == "not recorded", (model, slice_)
        assert bound == "not planned" or re.fullmatch(r"\d+\.\d+ s", bound), (model, slice_, bound)
        argv = command.split("`")[1].split()
        args = parser.parse_args(argv)
        assert args.command == "plan" and slice_ in args.topology.split(","), (model, command)
        assert args.model in registry.known_models() or args.comfy_model in ARCHITECTURES, command
        assert size.count("×") == 2 and fits.split()[0].rstrip(";:") in ("yes", "no", "not"), (model, fits)
