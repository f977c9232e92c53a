"""Every GPU test is in a group of `noxfile.GPU_GROUPS`: `nox -s gpu` and `tests/gpu_lanes.sh` run the groups, so a
test outside them would never run on a GPU, and the groups a change must pass would not check it."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_MARKS = ("mark.gpu", "mark.two_gpus")


def gpu_groups() -> dict[str, list[str]]:
    """noxfile.GPU_GROUPS, read without importing nox."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "GPU_GROUPS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("noxfile.py has no GPU_GROUPS")


def gpu_tests() -> list[tuple[str, str]]:
    """(file, test) of each test function marked for a GPU, by a decorator or a parameter's marks."""
    found = []
    for path in sorted([*ROOT.glob("tests/test_*.py"), *ROOT.glob("packages/*/tests/test_*.py")]):
        source = path.read_text()
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                decorators = "".join(ast.get_source_segment(source, d) or "" for d in node.decorator_list)
                if any(mark in decorators for mark in GPU_MARKS):
                    found.append((path.relative_to(ROOT).as_posix(), node.name))
    return found


def test_every_gpu_test_is_in_a_gpu_group():
    named = {entry for entries in gpu_groups().values() for entry in entries}
    tests = gpu_tests()
    assert len(tests) > 30, f"found only {len(tests)} GPU tests: is the scan still reading the marks?"
    outside = [f"{path}::{name}" for path, name in tests if path not in named and f"{path}::{name}" not in named]
    assert not outside, (
        f"GPU tests in no group of noxfile.GPU_GROUPS (add each to the group of what it checks): {outside}"
    )
