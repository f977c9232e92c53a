"""The Triton kernels' arithmetic on the CPU, under Triton's interpreter: the chunked delta rule's kernels against
the eager functions they stand for, with the launches the engine takes and with small key steps and value blocks;
the experts' grouped weight-gradient kernel against float64 and their dispatch's copy against the gather
(`kernel_checks.py`, in a process of its own: the interpreter must be on before triton is imported). The GPU tests
hold the compiled kernels to the same; these keep the kernels' masks, tiles and sums tested where CI has no GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_checks import DELTA_CASES

SCRIPT = Path(__file__).with_name("kernel_checks.py")


@pytest.mark.parametrize("kernels", [*DELTA_CASES, "experts", "swiglu", "dispatch"])
def test_kernels_under_the_interpreter_equal_their_references(kernels):
    """Each case of the script's (documents starting inside chunks, value widths off the kernels' blocks, keys
    narrower than a tile, with and without beta; experts' row counts off the tiles, one with no rows; SwiGLU's width
    off its block; the dispatch's tokens and width off its blocks, a stage's experts only)."""
    env = os.environ | {"TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), kernels], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
