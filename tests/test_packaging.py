"""Each package's README gives the line that installs it without the others: the package and exactly the packages
its pyproject says it builds on (with theirs), which pip cannot fetch (they are not on PyPI)."""

import re
import tomllib
from pathlib import Path

import pytest

PACKAGES = Path(__file__).parents[1] / "packages"


def local_dependencies(directory: str) -> list[str]:
    """The package directories the pyproject of `directory` depends on (megatrain-X: packages/X)."""
    project = tomllib.loads((PACKAGES / directory / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[\[<>=; ]", name)[0] for name in project["dependencies"]]
    return [name.removeprefix("megatrain-") for name in names if name.startswith("megatrain-")]


def closure(directory: str) -> set[str]:
    found = set()
    for dependency in local_dependencies(directory):
        found |= {dependency} | closure(dependency)
    return found


@pytest.mark.parametrize("directory", sorted(p.name for p in PACKAGES.iterdir() if (p / "pyproject.toml").exists()))
def test_a_packages_readme_installs_it_with_what_it_builds_on(directory):
    readme = (PACKAGES / directory / "README.md").read_text()
    lines = [
        line for line in readme.splitlines() if line.startswith("pip install ") and f"packages/{directory}" in line
    ]
    assert lines, f"packages/{directory}/README.md has no line that installs it"
    named = {m.group(1) for m in re.finditer(r"\./packages/([a-z]+)", lines[0])}
    assert named == closure(directory) | {directory}, lines[0]
    assert f"pytest -m 'not gpu' packages/{directory}/tests" in readme
