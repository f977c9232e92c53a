"""The host AdamW kernel against float64 AdamW and torch's fused kernel, built fresh for each test; its fallbacks."""

import pytest
import torch

from megatrain_optim import adamw_update_, host_kernel

# (a run parallel over OpenMP's threads, one under its threshold, one of a single element)
SIZES = (200_003, 1_000, 1)


@pytest.fixture
def fresh_kernel(tmp_path, monkeypatch):
    """The kernel built into an empty cache, and forgotten after the test."""
    monkeypatch.setattr(host_kernel, "MACHINE_CACHE", tmp_path)
    monkeypatch.setattr(host_kernel, "MIN_THREADS", 1)  # (CI's 2 cores: tested there as it runs on a GPU's host)
    host_kernel._kernel.cache_clear()
    yield
    host_kernel._kernel.cache_clear()


def state(seed: int) -> list[list[torch.Tensor]]:
    """Weights, gradients (a clip's worth too large) and moments of a step after the first, one tensor a run."""
    generator = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(n, generator=generator) * scale for n in SIZES]
        for scale in (1.0, 3.0, 0.1)  # weights, gradients, first moments
    ] + [[torch.rand(n, generator=generator) * 0.01 for n in SIZES]]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def float64_adamw(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay):
    """torch.optim.AdamW's step in float64 on already-clipped gradients."""
    p, m, v = p.double(), m.double(), v.double()
    p = p * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    denom = (v.sqrt() / (1 - beta2**step) ** 0.5) + eps
    return p - lr / (1 - beta1**step) * m / denom, m, v


@pytest.mark.parametrize("beta1", [0.9, 0.3])  # torch's lerp takes its other form where 1 - beta1 >= 0.5
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_clipped_update_equals_float64_adamw_and_keeps_the_gradient(fresh_kernel, beta1, weight_decay):
    torch.set_num_threads(2)
    p, g, m, v = state(seed=int(beta1 * 10) + int(weight_decay * 100))
    clip = 0.37
    hyper = dict(lr=1e-2, beta1=beta1, beta2=0.95, eps=1e-8, weight_decay=weight_decay)
    expected = [float64_adamw(*run, 5, **hyper) for run in zip(p, (x.double() * clip for x in g), m, v)]
    grads = [x.clone() for x in g]
    fused = [[x.clone() for x in tensors] for tensors in (p, g, m, v)]
    assert host_kernel.available()
    adamw_update_(p, g, m, v, torch.tensor(5.0), grad_scale=torch.tensor(1 / clip), **hyper)
    torch._fused_adamw_(*fused, [], [torch.tensor(5.0)] * len(SIZES), grad_scale=torch.tensor(1 / clip),
                        amsgrad=False, maximize=False, **hyper)  # fmt: skip
    assert all(torch.equal(x, y) for x, y in zip(g, grads))  # the fused kernel would have stored them scaled
    for got, of_fused, want in zip(zip(p, m, v), zip(fused[0], fused[2], fused[3]), expected):
        for name, x, y, z in zip(("weight", "exp_avg", "exp_avg_sq"), got, of_fused, want):
            assert rel_err(x, z) < 1e-6, name
            # the fused kernel's arithmetic: at most the last bit apart (its scalar tail rounds differently)
            assert ((x - y).abs() <= y.abs() * 2**-23).all(), name


def test_without_a_compiler_the_fused_kernel_updates(fresh_kernel, monkeypatch, capsys):
    monkeypatch.setenv("CC", "no-such-compiler")
    assert not host_kernel.available()
    assert not host_kernel.available()  # (said once)
    assert capsys.readouterr().err.count("no C compiler (no-such-compiler); set CC to one") == 1
    p, g, m, v = state(seed=7)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    expected = [float64_adamw(*run, 5, **hyper) for run in zip(p, (x.double() * 0.5 for x in g), m, v)]
    adamw_update_(p, g, m, v, torch.tensor(5.0), grad_scale=torch.tensor(2.0), **hyper)
    for x, want in zip(p, expected):
        assert rel_err(x, want[0]) < 1e-6


def test_with_few_threads_torch_s_fused_kernel_updates(monkeypatch):
    monkeypatch.setattr(host_kernel, "MIN_THREADS", 8)
    torch.set_num_threads(2)
    assert not host_kernel.takes(torch.zeros(3))
    monkeypatch.setattr(host_kernel, "MIN_THREADS", 2)
    assert host_kernel.takes(torch.zeros(3)) == host_kernel.available()
    assert not host_kernel.takes(torch.zeros(3, dtype=torch.float64))


def test_without_torch_s_one_openmp_runtime_the_fused_kernel_updates(fresh_kernel, monkeypatch, capsys):
    """Where the process holds no OpenMP runtime, or two that cannot be told apart, the kernel's threads would not
    be torch's: not built."""
    monkeypatch.setattr(host_kernel, "_torch_openmp", lambda: None)
    assert not host_kernel.available() and host_kernel.kernel_name() == host_kernel.TORCH_FUSED
    assert "torch's OpenMP runtime is not one loaded libgomp or libiomp5 here" in capsys.readouterr().err


def test_torch_s_openmp_runtime_is_told_from_another_library_s(monkeypatch):
    """Beside a second runtime (scikit-learn's, which transformers' generation imports), torch's own is the one whose
    `omp_get_max_threads` torch's CPU library binds; beside none, the one mapped."""
    mapped = host_kernel._mapped_files()
    own = host_kernel._torch_openmp()
    if own is None or not any(path.endswith("/libtorch_cpu.so") for path in mapped):
        pytest.skip("torch here has no OpenMP runtime of its own, or no libtorch_cpu.so")
    other = "/elsewhere/scikit_learn.libs/libgomp-0123abcd.so.1.0.0"
    monkeypatch.setattr(host_kernel, "_mapped_files", lambda: [other, *mapped])
    assert host_kernel._torch_openmp() == own
    monkeypatch.setattr(host_kernel, "_file_defining", lambda symbol, library: None)
    assert host_kernel._torch_openmp() is None  # (where the binding cannot be found: not told)


def test_a_failed_build_says_why_in_one_line(fresh_kernel, tmp_path, monkeypatch, capsys):
    compiler = tmp_path / "cc"
    compiler.write_text("#!/bin/sh\necho 'cc: error: unrecognized option' >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    assert not host_kernel.available()
    assert "its build failed: cc: error: unrecognized option" in capsys.readouterr().err
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-built left


def test_every_element_rounds_alike_wherever_it_falls(fresh_kernel):
    """Vector lanes and the scalar remainder do the same IEEE operations: a run updated whole and updated from an odd
    offset (as `update_rows` updates an embedding's rows apart from their group) agree to the bit."""
    torch.set_num_threads(2)
    p, g, m, v = (tensors[0] for tensors in state(seed=3))
    apart = [t[5:].clone() for t in (p, g, m, v)]
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_scale=torch.tensor(2.0))
    adamw_update_([p], [g], [m], [v], torch.tensor(2.0), **hyper)
    adamw_update_(*([t] for t in apart), torch.tensor(2.0), **hyper)
    assert all(torch.equal(whole[5:], part) for whole, part in zip((p, m, v), (apart[0], apart[2], apart[3])))
