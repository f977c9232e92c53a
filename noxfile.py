"""The test matrix: each package alone (with only its sibling dependencies), the
integration tests across packages, lint, and the GPU tests. Plain `nox` runs the CPU
sessions; `nox -s gpu` runs the GPU-marked tests on a machine with CUDA."""

import os
import re
import shutil
from pathlib import Path

import nox

nox.options.sessions = [
    "store",
    "optim",
    "sched",
    "templates",
    "zoo",
    "data",
    "plan",
    "megatrain",
    "integration",
    "examples",
    "lint",
]
nox.options.default_venv_backend = "virtualenv"

# torch==2.13.0 is the CPU wheel on the project machines; set MEGATRAIN_TORCH to choose another.
TORCH = os.environ.get("MEGATRAIN_TORCH", "torch==2.13.0")
DEPENDS = {
    "store": [],
    "templates": [],
    "optim": ["store"],
    "sched": ["store"],
    "zoo": ["store", "templates"],
    "data": ["store"],
    "plan": ["store", "optim", "sched", "templates", "zoo"],
    "megatrain": ["store", "optim", "sched", "templates", "zoo", "data", "plan"],
}


EXTRAS = {"megatrain": "[plot]"}  # the loss-curve PNG is part of what a run writes
# what a package's tests check against, its `test` extra: the templates' kernels under Triton's CPU interpreter, the
# store's packed weights against bitsandbytes'
TEST_EXTRAS = {"templates": "[test]", "store": "[test]"}
# pytest-xdist: the sessions whose tests take long run them in two processes (CI's two cores; templates' kernels
# under Triton's interpreter: 44 -> 37 s)
TWO_PROCESSES = {"templates", "plan", "megatrain"}


# The tests' processes write the bytecode of what they import (the next process reads it), which installing
# with --no-compile leaves to them: where PYTHONDONTWRITEBYTECODE is set (these machines set it), each of the
# integration tests' processes compiled torch again (7.4 -> 12 min).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def share_torch(session: nox.Session) -> None:
    """torch, with its own requirements, unpacked once under .nox for every session, each virtualenv reading it
    through a .pth file: the wheel was unpacked in each of ten sessions (9 s each on two cores) and its modules
    compiled again by each session's first import. The packages and what the tests need go into each virtualenv."""
    shared = Path(".nox", "shared-" + re.sub(r"[^A-Za-z0-9.]+", "-", TORCH)).resolve()  # (TORCH: a name or a path)
    if not shared.exists():
        partial = shared.with_name(shared.name + ".partial")  # (a session stopped while unpacking leaves no half)
        shutil.rmtree(partial, ignore_errors=True)
        session.run("python", "-m", "pip", "install", "-q", "--no-compile", "--target", str(partial), TORCH)
        partial.rename(shared)
    site = session.run("python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", silent=True)
    Path(site.strip(), "shared-torch.pth").write_text(f"{shared}\n")


def install(session: nox.Session, *packages: str, extra: tuple[str, ...] = (), extras: dict | None = None) -> None:
    # --no-compile: pip byte-compiles every module it installs (torch's install: 25 s with it, 7.6 s without, on
    # two cores); the tests compile only the modules they import. --no-build-isolation: the packages build with the
    # venv's own setuptools instead of one installed afresh for each (five packages: 15.5 s -> 6.4 s): the one
    # virtualenv seeds for Python 3.11 (84.2 in 2026-11), which lets torch and the packages go in one pip call (one
    # resolution: 15.6 -> 12.6 s a session)
    share_torch(session)  # (then pip finds TORCH installed)
    local = [f"./packages/{p}{(extras or EXTRAS).get(p, '')}" for p in packages]
    session.install("--no-compile", "--no-build-isolation", TORCH, "setuptools>=61", *local, "pytest", *extra)


def _package_session(name: str):
    @nox.session(name=name, python="3.11")
    def run(session: nox.Session) -> None:
        parallel = name in TWO_PROCESSES
        extra = ("pytest-xdist",) if parallel else ()
        extras = EXTRAS | ({name: TEST_EXTRAS[name]} if name in TEST_EXTRAS else {})  # (its own, not its deps')
        install(session, *DEPENDS[name], name, extra=extra, extras=extras)
        processes = ("-n", "2") if parallel else ()
        session.run("pytest", "-q", *processes, "-m", "not gpu", f"packages/{name}/tests", *session.posargs)

    return run


for _name in DEPENDS:
    globals()[f"test_{_name.replace('-', '_')}"] = _package_session(_name)


@nox.session(python="3.11")
def integration(session: nox.Session) -> None:
    """Tests across packages, against plain PyTorch and Hugging Face transformers."""
    # accelerate: FP8 checkpoints; peft: LoRA adapters in and out; the store's test extra (bitsandbytes): QLoRA
    # checkpoints as transformers saves them; pytest-xdist: the tests in two processes (CI's two cores)
    # peft >= 0.22: it adapts a MoE's fused experts and router as megatrain does (docs/guide.md, the LoRA section)
    extra = ("transformers", "accelerate", "peft>=0.22", "pillow", "pytest-xdist")
    install(session, *DEPENDS["megatrain"], "megatrain", extra=extra, extras=EXTRAS | {"store": TEST_EXTRAS["store"]})
    session.run("pytest", "-q", "-n", "2", "-m", "not gpu", "tests", *session.posargs)


@nox.session(python="3.11")
def examples(session: nox.Session) -> None:
    """The custom trainer of examples/, composed from the six packages it uses (not `plan`, not `megatrain`), against
    plain PyTorch."""
    install(session, "store", "optim", "sched", "templates", "zoo", "data")
    session.run("pytest", "-q", "examples", *session.posargs)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")


# The GPU tests in groups that each finish in one device call (an engine change passes every group; `nox -s gpu`
# runs them all, `nox -s gpu -- engine` one). The tests marked two_gpus run where there are two GPUs.
# (each group's minutes on one H200, sharing it in tests/gpu_lanes.sh's lanes: docs/benchmarks.md#exactness-on-the-gpu)
GPU_GROUPS = {
    "engine": ["tests/test_gpu_exactness.py"],
    "dense": ["tests/test_dense_families.py", "tests/test_llama4.py"],
    "generic": ["tests/test_generic.py"],
    "moe": ["tests/test_moe.py"],
    "objectives": [
        "tests/test_dpo.py",
        "tests/test_grpo.py",
        "tests/test_generate.py",
        "tests/test_finetune.py",
        "tests/test_loss_curves.py",
        "tests/test_image_text.py",
    ],
    "kernels": [
        "packages/templates/tests/test_expert_kernels.py",
        "packages/templates/tests/test_templates.py::test_gpu_kernel_attention_equals_the_written_out_attention",
        "packages/templates/tests/test_templates.py::test_gpu_fused_elementwise_kernels_follow_float64",
        "packages/templates/tests/test_templates.py::test_gpu_swiglu_kernels_follow_float64",
        "packages/templates/tests/test_templates.py::test_swiglu_backward_over_its_input_gives_what_the_plain_one_gives",
    ],
    "recurrence": [
        "packages/templates/tests/test_templates.py::test_gpu_chunked_recurrence_equals_float64",
        "packages/templates/tests/test_templates.py::test_gpu_kept_recurrence_gives_the_recomputed_gradients",
        "packages/templates/tests/test_templates.py::test_gpu_kept_attention_gives_the_recomputed_gradients",
    ],
    # (apart from `recurrence`, which took 6.5 min with them in a lane beside three others)
    "chunk-kernels": ["packages/templates/tests/test_templates.py::test_gpu_chunk_kernels_equal_the_eager_functions"],
    "decoding": ["tests/test_compiled_decoding.py"],  # (compiling each family's decoding step: 10-65 s)
    "lora": ["tests/test_lora.py", "tests/test_lora_export.py", "tests/test_qlora.py"],
    "quant": ["packages/store/tests/test_quant.py", "packages/store/tests/test_packed.py"],  # needs bitsandbytes
    "ranks": ["tests/test_distributed.py"],
}


@nox.session(python=False)
def gpu(session: nox.Session) -> None:
    """GPU-marked tests with the current environment's (CUDA) torch and the packages on PYTHONPATH: every group, or
    the groups named (`nox -s gpu -- engine moe`; GPU_GROUPS), with pytest's own arguments after them."""
    paths = [f"packages/{p}/src" for p in DEPENDS]
    env = {"PYTHONPATH": os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")])}
    gpus = int(session.run("python", "-c", "import torch; print(torch.cuda.device_count())", silent=True, env=env))
    selection = "gpu" if gpus >= 2 else "gpu and not two_gpus"
    if gpus < 2:
        session.warn(f"{gpus} GPU(s) here: the tests marked two_gpus need a machine with two and are not run")
    groups = [arg for arg in session.posargs if arg in GPU_GROUPS] or list(GPU_GROUPS)
    files = [path for group in groups for path in GPU_GROUPS[group]]
    pytest_args = [arg for arg in session.posargs if arg not in GPU_GROUPS]
    session.run("python", "-m", "pytest", "-q", "-m", selection, *files, *pytest_args, env=env)
