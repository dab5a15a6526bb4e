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
