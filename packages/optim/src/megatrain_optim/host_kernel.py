"""The host's AdamW, built for this CPU on first use: `host_adamw_`.

It does torch's fused CPU AdamW's arithmetic in the same order (its results equal the fused kernel's but for the last
bit of a few elements past its vector lanes), with two differences that the host's memory bandwidth makes matter:
- A clip coefficient (`grad_scale`) scales each gradient as it is read and leaves it as it was. The fused kernel
  stores the scaled gradient back: 32 bytes of traffic a parameter, not 28 (its clipped update took 6-33% longer
  than its unclipped one on three H200 hosts).
- Threads take 64k-element chunks as they finish (OpenMP's dynamic schedule), not one equal share each (static,
  torch's `parallel_for`): a thread whose core the GPU's launch thread or the copies take a while no longer holds
  the update up. On an H200 host, 15 threads, 540M parameters: 105.7 ms alone against the fused kernel's 127.2
  (static: 127.3), and 143.1 ms beside a GPU's work and copies both ways, as in a step, against 176.5
  (benchmarks/results/host-adamw-h200.json).

The kernel is C, compiled once per machine with the system's compiler ($CC, else `cc`) into MEGATRAIN_CACHE and
called through ctypes, which releases the GIL. Its threads are OpenMP's, linked to the OpenMP runtime torch loaded,
so they are the threads torch's own kernels use: a second runtime's threads, or a Python pool beside torch's, spun
against torch's idle-spinning threads (on 2 cores a Python pool ran 60% slower than the fused kernel). Where no
compiler builds it, or torch runs no OpenMP, `available()` says so once and the fused kernel does the update
(`adamw_update_`).
"""

import ctypes
import hashlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from megatrain_store import MACHINE_CACHE

# torch's fused kernel, element by element: its lerp (both forms) and its fused multiply-adds, no other contraction
# (-ffp-contract=off), IEEE division and square root (no -ffast-math; -fno-math-errno lets sqrtf vectorize). The
# chunks (64k elements, 256 KiB a buffer) are small enough to balance 15 threads over a 50M-parameter layer.
SOURCE = r"""
#include <math.h>
#include <stdint.h>

void adamw(float *restrict p, const float *restrict g, float *restrict m, float *restrict v, int64_t n,
           int threads, float grad_scale, float decay, float beta1_weight, float beta2, float sq_weight,
           float bias2_sqrt, float eps, float neg_step) {
    #pragma omp parallel for simd num_threads(threads) if(n >= 65536) schedule(dynamic, 65536)
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i] / grad_scale;
        float mi = beta1_weight < 0.5f ? fmaf(beta1_weight, gi - m[i], m[i])
                                       : fmaf(beta1_weight - 1.0f, gi - m[i], gi);
        float vi = fmaf(sq_weight * gi, gi, v[i] * beta2);
        m[i] = mi;
        v[i] = vi;
        p[i] = p[i] * decay + neg_step * mi / (sqrtf(vi) / bias2_sqrt + eps);
    }
}
"""
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-fopenmp")


def _cpu_signature() -> str:
    """What -march=native compiles for: a library built on one CPU may not run on another sharing the cache."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def _torch_openmp() -> str | None:
    """The OpenMP runtime torch loaded (GNU's libgomp, or Intel's libiomp5, which serves GNU's calls too): the one
    process has, or, where another library brought its own (scikit-learn's, which transformers' generation imports),
    the file whose `omp_get_max_threads` torch's CPU library binds; None where it cannot be told."""
    mapped = _mapped_files()
    paths = {path for path in mapped if "/libgomp" in path or "/libiomp5" in path}
    if len(paths) <= 1:
        return paths.pop() if paths else None
    torch_cpu = next((path for path in mapped if path.endswith("/libtorch_cpu.so")), None)
    bound = _file_defining("omp_get_max_threads", torch_cpu) if torch_cpu else None
    return bound if bound in paths else None


def _mapped_files() -> list[str]:
    """The files this process has mapped (its libraries among them)."""
    try:
        return [line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "/" in line]
    except OSError:
        return []


class _DlInfo(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("dli_fname", "dli_fbase", "dli_sname", "dli_saddr")]


def _file_defining(symbol: str, library: str) -> str | None:
    """The file of the `symbol` that `library` (loaded) binds: its own or its dependencies' first, as the dynamic
    linker resolves it (dlsym on its handle, then dladdr)."""
    try:
        address = ctypes.cast(getattr(ctypes.CDLL(library, os.RTLD_NOLOAD | os.RTLD_LAZY), symbol), ctypes.c_void_p)
        info = _DlInfo()
        if not ctypes.CDLL(None).dladdr(address, ctypes.byref(info)) or not info.dli_fname:
            return None
    except (OSError, AttributeError):
        return None
    return os.path.realpath(ctypes.string_at(info.dli_fname).decode())


def _build(compiler: str, openmp: str, target: Path) -> None:
    """Compile with OpenMP, then link against torch's runtime (not the compiler's -lgomp): the library's
    NEEDED entry then names the runtime already in the process."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        source, objects, library = (Path(work) / name for name in ("adamw.c", "adamw.o", "adamw.so"))
        source.write_text(SOURCE)
        for command in (
            [compiler, *FLAGS, "-c", "-o", str(objects), str(source)],
            [compiler, "-shared", "-o", str(library), str(objects), openmp],
        ):
            subprocess.run(command, check=True, capture_output=True, text=True)
        os.replace(library, target)  # whole or absent: another process may be building it too


@cache
def _kernel():
    """The compiled kernel, or None (said once) where it cannot be built or loaded."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return _without(f"no C compiler ({os.environ.get('CC', 'cc')}); set CC to one")
    openmp = _torch_openmp()
    if openmp is None:
        return _without("torch's OpenMP runtime is not one loaded libgomp or libiomp5 here")
    key = "\n".join((SOURCE, " ".join(FLAGS), compiler, openmp, _cpu_signature()))
    target = MACHINE_CACHE / "kernels" / f"adamw-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    try:
        if not target.exists():
            _build(compiler, openmp, target)
        function = ctypes.CDLL(str(target)).adamw
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", None) or error
        return _without(f"its build failed: {str(detail).strip().splitlines()[-1]}")
    function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int] + [ctypes.c_float] * 8
    function.restype = None
    return function


def _without(reason: str) -> None:
    print(
        f"megatrain: the host's AdamW uses torch's fused kernel ({reason}); it takes ~20% longer in a step",
        file=sys.stderr,
    )


def available() -> bool:
    """Whether `host_adamw_` can run here (builds the kernel on the first call)."""
    return _kernel() is not None


def kernel_name() -> str:
    """What runs the host's fp32 AdamW here (a measured rate is this kernel's): megatrain's, named by its source's
    digest, or torch's fused one."""
    return f"megatrain {hashlib.sha256(SOURCE.encode()).hexdigest()[:8]}" if _runs_here() else TORCH_FUSED


TORCH_FUSED = "torch's fused kernel"
# torch's threads from which the kernel runs the host's updates. Its gain is many threads' balance beside a GPU's
# work and bytes on a host bound by its memory; on 2 cores, over buffers its caches hold (CI's tests, a small model
# on the CPU), torch's fused kernel ran 25-40% faster (1M parameters: 0.68 ms against 0.93) and the CPU test suite's
# training tests 3x faster (36 s against 114 s).
MIN_THREADS = 8


def takes(tensor: Tensor) -> bool:
    """Whether `adamw_update_` runs this kernel for updates of `tensor`'s kind: fp32 on the CPU, with at least
    MIN_THREADS of torch's threads, where it builds."""
    return tensor.device.type == "cpu" and tensor.dtype == torch.float32 and _runs_here()


def _runs_here() -> bool:
    return torch.get_num_threads() >= MIN_THREADS and available()


def host_adamw_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    step: float,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: float = 1.0,
) -> None:
    """AdamW of fp32 CPU tensors, each gradient divided by `grad_scale` as it is read and left as it was;
    `step` is the already-incremented count. Needs `available()`."""
    kernel = _kernel()
    constants = (
        grad_scale,
        1 - lr * weight_decay,
        1 - beta1,
        beta2,
        1 - beta2,
        math.sqrt(1 - beta2**step),
        eps,
        -lr / (1 - beta1**step),
    )
    threads = torch.get_num_threads()
    for run in zip(params, grads, exp_avgs, exp_avg_sqs):
        p, g, m, v = (t.view(-1) for t in run)  # view: a tensor that is not contiguous raises
        kernel(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel(), threads, *constants)
