"""The docs as reference: what they name exists. The package READMEs' examples run and name only what the
packages have, the CLI's docs list every command it has, the guide's contents reach every section, its table of
environment variables lists those the packages read, and the design's invariants name tests that exist. CPU only,
seconds."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGES = sorted(p for p in (ROOT / "packages").iterdir() if (p / "README.md").exists())


def snippets(readme: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)


def source_words(package: Path) -> set[str]:
    """Every identifier the package's source defines or uses."""
    return {word for path in (package / "src").rglob("*.py") for word in re.findall(r"\w+", path.read_text())}


@pytest.mark.parametrize("package", PACKAGES, ids=[p.name for p in PACKAGES])
def test_a_package_readme_s_examples_run(package):
    for code in snippets(package / "README.md"):
        exec(compile(code, f"{package.name}/README.md", "exec"), {})


NAMING_DOCS = [p / "README.md" for p in PACKAGES] + [ROOT / "docs" / "design.md"]
NOT_CODE = {"py", "nox", "noxfile", "pyproject", "toml"}  # file names in code spans


@pytest.mark.parametrize("doc", NAMING_DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_doc_names_only_what_the_packages_have(doc):
    """Each name in a doc's code spans (`name`, `Class.attribute`, `call(...)`) is in the packages' source (a README
    may name a neighbour's class); file paths and torch's own names aside."""
    words = set().union(*map(source_words, PACKAGES))
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    spans = [s for s in re.findall(r"`([^`\n]+)`", text) if "/" not in s and not s.startswith(("torch.", "nn."))]
    names = {part for span in spans for part in re.match(r"[\w.]*", span)[0].split(".") if part.isidentifier()}
    missing = sorted(name for name in names - words - NOT_CODE if not name.startswith("megatrain"))
    assert not missing, f"{doc.relative_to(ROOT)} names what no package has: {missing}"


def cli_commands() -> list[str]:
    """The commands `megatrain --help` lists, as a user sees them."""
    help_text = subprocess.run(
        [sys.executable, "-m", "megatrain", "--help"], capture_output=True, text=True, check=True
    ).stdout
    return re.search(r"\{([\w,-]+)\}", help_text)[1].split(",")


def test_the_cli_s_docstring_and_readme_list_every_command():
    commands = cli_commands()
    assert len(commands) >= 8
    docstring = ast.get_docstring(ast.parse((ROOT / "packages/megatrain/src/megatrain/cli.py").read_text()))
    listed = re.match(r"The `megatrain` command: ([\w, ]+)\.", docstring)[1].split(", ")
    assert listed == commands, f"cli.py's docstring lists {listed}; the parser has {commands}"
    readme = (ROOT / "packages/megatrain/README.md").read_text()
    assert not [c for c in commands if f"`{c}`" not in readme], "packages/megatrain/README.md misses a command"


def slug(heading: str) -> str:
    """A markdown heading's anchor as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_guide_s_contents_link_every_section_in_order():
    guide = (ROOT / "docs" / "guide.md").read_text()
    contents = re.search(r"^## Contents\n\n(.*?)\n\n", guide, re.S | re.M)[1]
    listed = re.findall(r"^ *- \[(.+)\]\(#([\w-]+)\)$", contents, re.M)
    sections = [h for h in re.findall(r"^###? (.+)$", guide, re.M) if h != "Contents"]
    assert [title for title, _ in listed] == sections, "docs/guide.md: the contents and the sections differ"
    assert all(anchor == slug(title) for title, anchor in listed)


def test_the_guide_s_environment_variables_are_those_the_packages_read():
    """The guide's table of environment variables lists every MEGATRAIN_* variable the packages' source reads (a
    name as a whole string literal, as `os.environ.get("MEGATRAIN_X")` reads it), and no other."""
    sources = (path.read_text() for package in PACKAGES for path in (package / "src").rglob("*.py"))
    read = {name for text in sources for name in re.findall(r"[\"'](MEGATRAIN_[A-Z0-9_]+)[\"']", text)}
    guide = (ROOT / "docs" / "guide.md").read_text()
    section = re.search(r"^## Environment variables\n(.*?)(?=^## |\Z)", guide, re.S | re.M)[1]
    listed = set(re.findall(r"^\| `(MEGATRAIN_[A-Z0-9_]+)` \|", section, re.M))
    assert read, "no MEGATRAIN_* variable found in the packages' source: the pattern no longer matches how they read"
    assert listed == read, f"docs/guide.md's environment variables {sorted(listed)}; the packages read {sorted(read)}"


DECISIONS = ROOT / "docs" / "decisions"


def test_every_decision_record_is_in_the_index_with_its_sections():
    records = sorted(p.name for p in DECISIONS.glob("[0-9][0-9][0-9]-*.md"))
    assert records and [p[:3] for p in records] == [f"{n:03d}" for n in range(1, len(records) + 1)]
    assert re.findall(r"^- \[\d{3}\]\(([\w.-]+)\)", (DECISIONS / "README.md").read_text(), re.M) == records
    for name in records:
        text = (DECISIONS / name).read_text()
        sections = re.findall(r"^## (\w+)$", text, re.M)
        assert sections == ["Context", "Decision", "Consequence"], f"docs/decisions/{name}: sections {sections}"


def named_tests(doc: Path) -> list[tuple[str, str | None]]:
    """(test file, test function or None) for each `path.py::function` or `path.py` a doc names; a bare
    `::function` is of the file named last before it."""
    named, last = [], None
    for path, function in re.findall(r"`(?:((?:tests|packages)/[\w/]+\.py)|(?=::))(?:::(\w+))?`", doc.read_text()):
        last = path or last
        named.append((last, function or None))
    return named


@pytest.mark.parametrize("doc", [ROOT / "docs" / "design.md", *sorted(DECISIONS.glob("0*.md"))], ids=lambda p: p.name)
def test_the_tests_a_doc_names_exist(doc):
    named = named_tests(doc)
    assert named, f"{doc.name} names no test"
    for path, function in named:
        assert (ROOT / path).exists(), f"{doc.name} names {path}, which does not exist"
        if function:
            assert re.search(rf"^def {function}\(", (ROOT / path).read_text(), re.M), (
                f"{doc.name}: no {path}::{function}"
            )


def package_version(package: Path) -> str:
    """A package's version: its pyproject.toml's, or (dynamic) its `__version__` that setuptools reads."""
    pyproject = (package / "pyproject.toml").read_text()
    static = re.search(r'^version = "(.+)"$', pyproject, re.M)
    if static:
        return static[1]
    attr = re.search(r'^version = \{attr = "(\w+)\.__version__"\}$', pyproject, re.M)[1]
    return re.search(r'^__version__ = "(.+)"$', (package / "src" / attr / "__init__.py").read_text(), re.M)[1]


def test_the_changelog_goes_by_version_unreleased_on_top_and_the_packages_share_one():
    sections = re.findall(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert sections[0] == "[Unreleased]", "CHANGELOG.md: the first section is [Unreleased]"
    released = [re.fullmatch(r"\[(\d+)\.(\d+)\.(\d+)\] - \d{4}-\d{2}-\d{2}", s) for s in sections[1:]]
    assert released and all(released), f"CHANGELOG.md: a section is not '[X.Y.Z] - YYYY-MM-DD': {sections[1:]}"
    versions = [tuple(map(int, m.groups())) for m in released]
    assert versions == sorted(versions, reverse=True), "CHANGELOG.md: versions go newest first"
    package_versions = {package_version(p) for p in PACKAGES}
    assert len(package_versions) == 1, f"the packages' versions differ: {package_versions}"
    assert tuple(map(int, package_versions.pop().split("."))) >= versions[0]
