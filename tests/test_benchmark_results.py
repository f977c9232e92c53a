"""The benchmark results and the docs made from them: every committed results file fits the one schema
(benchmarks/results_schema.py), the docs' generated tables are current (benchmarks/tables.py), and the
docs' links to each other's sections resolve. CPU only, no GPU, no timers."""

import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import results_schema  # noqa: E402
import tables  # noqa: E402

RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
LINKING_DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md"] + sorted(
    (ROOT / "docs").rglob("*.md")
)


def a_row(**fields) -> dict:
    row = {"system": "megatrain", "model": "qwen2.5-7b", "tokens_per_step": 32768, "step_time_s": 2.784}
    return row | {"tokens_per_s": 11770, "model_tflops": 528.3, "date": "2026-11-24 09:13"} | fields


def a_file(*rows) -> dict:
    machine = {"device": "NVIDIA H100 80GB HBM3", "gpu_memory_gib": 79.2, "host_memory_gib": 125.9, "cpu_cores": 16}
    machine |= {"torch": "2.11.0+cu130", "date": "2026-11-24 09:13"}
    return {
        "benchmark": "a question",
        "machine": machine,
        "commands": ["python x.py"],
        "notes": [],
        "results": list(rows),
    }


@pytest.mark.parametrize("path", RESULTS, ids=[p.name for p in RESULTS])
def test_every_results_file_fits_the_schema(path):
    assert results_schema.check_file(path) == []


def test_a_valid_file_has_no_problems():
    plan = a_row(system="megatrain plan", step_time_s=3.0, predicted_step_s=3.0)
    failed = a_row(
        system="pytorch-gpu", step_time_s=None, tokens_per_s=None, model_tflops=None, fits=False, error="OOM"
    )
    part = a_row(scope="one MoE layer, fwd + recompute+bwd", tokens_per_s=None, model_tflops=None)
    within = a_row(planned_host_gib=100.0, peak_rss_gib=102.9)  # within 3% of its plan
    assert results_schema.check_results(a_file(a_row(), plan, failed, part, within)) == []


@pytest.mark.parametrize(
    "broken, problem",
    [
        (a_file(a_row(system="pytorch")), "results[0].system: 'pytorch' is not one of"),
        (a_file(a_row(date="24 Nov")), "results[0].date: must read YYYY-MM-DD"),
        (a_file(a_row(step_time_s="2.8 s")), "results[0].step_time_s: has type str"),
        (a_file(a_row(step_time_s=None)), "a measured step needs step_time_s"),
        (a_file(a_row(system="megatrain plan", predicted_step_s=1.0)), "step_time_s equal to it"),
        (a_file(a_row(fits=False)), "says why in 'error'"),
        (a_file(a_row(placement=[0, 1])), "results[0].placement: has type list"),
        (a_file(a_row(planned_host_gib=100.0, peak_rss_gib=103.5)), "peak RSS 103.5 GiB passes the planned 100.0"),
        ({k: v for k, v in a_file(a_row()).items() if k != "commands"}, "missing top-level 'commands'"),
        (a_file(a_row()) | {"args": {}}, "unknown top-level 'args'"),
        (a_file(), "results: must be a non-empty list"),
    ],
)
def test_check_results_names_the_problem(broken, problem):
    assert any(problem in line for line in results_schema.check_results(broken)), results_schema.check_results(broken)


def test_normalize_puts_each_script_s_output_in_the_schema():
    machine = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-24 09:13", "torch": "2.11.0+cu130"}
    block = {
        "machine": machine,
        "model": "qwen2.5-7b",
        "tokens": 16384,
        "seq_len": 2048,
        "variants": {
            "default": {
                "forward_ms": 15.0,
                "recompute_backward_ms": 45.0,
                "forward_tflops": 519.6,
                "model_tflops_ceiling": 393.8,
            },
            "cudnn": {"error": "no kernel"},
        },
    }
    layer = {
        "machine": machine,
        "model": "olmoe-1b-7b",
        "tokens": 16384,
        "seq_len": 4096,
        "forward_ms": 5.9,
        "forward_recompute_backward_ms": 24.5,
        "hardware_tflops": 405.1,
        "model_tflops_ceiling": 303.8,
    }
    throughput = {
        "benchmark": "throughput",
        "machine": machine,
        "args": {"models": "qwen2.5-7b"},
        "results": [
            a_row(date=None) | {"placement": None},
            {"system": "pytorch-gpu", "model": "qwen2.5-7b", "micro_batch_seqs": 8, "fits": False, "error": "OOM"},
        ],
    }
    for payload in (block, layer, throughput):
        normalized = results_schema.normalize(payload, command="python benchmarks/x.py")
        assert results_schema.check_results(normalized) == []
        assert all(row["date"] == "2026-11-24 09:13" for row in normalized["results"])
    assert results_schema.normalize(block)["results"][0]["step_time_s"] == pytest.approx(0.06)
    assert results_schema.normalize(throughput)["configs"] == {"args": {"models": "qwen2.5-7b"}}


def test_normalize_leaves_a_file_in_the_schema_as_it_is():
    payload = a_file(a_row(engine="--kept-layers 0"))
    assert results_schema.normalize(payload) == payload


def test_the_docs_tables_are_current():
    assert tables.main(["--check"]) == 0, "run: python benchmarks/tables.py"


def test_every_table_marker_names_a_table():
    for doc in tables.DOCS:
        for name in re.findall(r"<!-- table: ([a-z][a-z0-9.-]*) -->\n", doc.read_text()):
            assert name in tables.TABLES, f"{doc.name}: unknown table {name}"


def test_the_readme_keeps_the_short_table_and_the_benchmark_docs_its_commands():
    readme = tables.REGION.search((ROOT / "README.md").read_text())
    assert readme["name"] == "headline" and "<details>" not in readme["body"] and "```bash" not in readme["body"]
    assert tables.README_SOURCES in readme["body"]
    in_docs = {m["name"]: m["body"] for m in tables.REGION.finditer((ROOT / "docs" / "benchmarks.md").read_text())}
    assert "python benchmarks/throughput.py" in in_docs["headline"]


def slug(heading: str) -> str:
    """A markdown heading's anchor as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_to_sections_of_the_docs_resolve():
    for doc in LINKING_DOCS:
        for target, anchor in re.findall(r"\]\(([^)#\s]*\.md)#([^)\s]+)\)", doc.read_text()):
            path = (doc.parent / target).resolve()
            headings = re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)
            assert anchor in {slug(h) for h in headings}, (
                f"{doc.relative_to(ROOT)}: {target}#{anchor} has no such section"
            )


SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_every_benchmark_script_imports(path):
    """What a script imports from megatrain exists (a moved function breaks a benchmark only on the GPU machine)."""
    importlib.import_module(path.stem)


def test_host_stalls_count_the_collector_s_pauses_by_generation_in_the_window_alone():
    """A row's `host_stalls_per_step`: a full collection inside the window is counted as generation 2's seconds;
    one after it is not; no CUDA here, so no allocator retries."""
    import gc

    import common

    with common.HostStalls() as stalls:
        garbage = [[] for _ in range(1000)]
        for a, b in zip(garbage, garbage[1:]):  # cycles, which only the collector frees
            a.append(b), b.append(a)
        del garbage, a, b
        gc.collect()
    gc.collect()
    per_step = stalls.per_step(2)
    assert per_step["gc_gen2_s"] > 0 and per_step["alloc_retries"] == per_step["device_waits"] == 0
    assert gc.callbacks.count(stalls._on_gc) == 0


def test_steady_steps_record_the_timed_steps_losses_and_gradient_norms(monkeypatch):
    """A row's `losses` and `grad_norms` are those of the timed steps, not the warm-up's (a norm above grad_clip
    says the row's updates were scaled), and the last step's updates are drained after the window."""
    from types import SimpleNamespace

    import common

    class Trainer:
        def __init__(self):
            self.steps, self.drained = 0, False

        def train_step(self, batch):
            self.steps += 1
            return SimpleNamespace(loss=10.0 + self.steps, grad_norm=0.5 * self.steps)

        def finish_updates(self):
            self.drained = True

    monkeypatch.setattr(common.torch.cuda, "synchronize", lambda: None)
    trainer = Trainer()
    timing = common.steady_steps(trainer, lambda: None, steps=2, warmup=1)
    assert timing["losses"] == [12.0, 13.0] and timing["grad_norms"] == [1.0, 1.5]
    assert trainer.drained and timing["step_s"] >= 0


def test_allocator_retries_names_the_allocation_that_found_no_room():
    """`allocator_retries.py` reads the allocator's history: each release of cached memory is printed with the
    allocation after it (the one that asked) and the one before, in the engine's frames alone."""
    import allocator_retries

    def entry(action, mib, stream=0, frames=()):
        return {"action": action, "size": mib * 2**20, "stream": stream, "frames": list(frames)}

    head = [{"filename": "/x/megatrain_sched/gradients.py", "line": 86, "name": "_new_buffer"}]
    torch_frame = [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"}]
    trace = [entry("alloc", 112, frames=torch_frame), entry("segment_unmap", 1024), entry("segment_unmap", 512, 7)]
    trace += [entry("segment_map", 2048), entry("alloc", 2079, frames=torch_frame + head), entry("free_requested", 1)]
    lines = allocator_retries.release_lines(trace)
    assert lines == [
        "release of 1.50 GiB (streams [0, 7])",
        "  after: 2079 MiB on stream 0: gradients.py:86 _new_buffer",
        "  before: 112 MiB on stream 0: ",
    ]
    assert allocator_retries.release_lines(trace[:1]) == ["no release of cached memory in the window"]


def test_host_arenas_times_both_kinds_of_arena_and_writes_rows_in_the_schema(tmp_path, monkeypatch):
    """`host_arenas.py` on a small size: a row for each kind of arena, in the one schema; the huge-page arena is
    zeroed and starts on a huge page's boundary."""
    import json

    import host_arenas

    out = tmp_path / "host-arenas.json"
    argv = ["host_arenas.py", "--params", "1000000", "--rounds", "2", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    host_arenas.main()
    payload = json.loads(out.read_text())
    assert results_schema.check_results(payload) == []
    rows = payload["results"]
    assert [row["engine"] for row in rows] == list(host_arenas.ALLOCATIONS)
    assert all(len(row["adamw_gbps_by_round"]) == 2 and row["adamw_gbps"] > 0 < row["triad_gbps"] for row in rows)
    huge = host_arenas.zeros_on_huge_pages(1 << 20)
    assert huge.data_ptr() % host_arenas.HUGE_PAGE == 0 and not huge.any()


def test_a_measured_row_is_planned_again_as_its_run_planned_it():
    """`benchmarks/replan.py` rebuilds a run's settings from its row (model, step shape, clipping, LoRA, experts in
    parts) and plans the placement the run executed at the rates it was planned with: an OLMoE row on an H200 whose
    placement's cost the model has not changed since comes out at its run's prediction."""
    import json

    import replan

    saved = json.loads((ROOT / "benchmarks" / "results" / "clipping-olmoe-1b-7b-h200.json").read_text())
    row = saved["results"][-1]
    again = replan.replanned(row, saved["machine"])
    assert again["planned_as_run_s"] == pytest.approx(row["predicted_step_s"], rel=0.01)
    assert again["parts"] == "whole" and again["bound"] == row["bound"]
    parts = json.loads((ROOT / "benchmarks" / "results" / "moe-parts-olmoe-32k-h100.json").read_text())
    lora_in_parts = replan.overrides(parts["results"][2])
    assert "model.adapter.r=16" in lora_in_parts and "engine.experts_per_stage=16" in lora_in_parts
