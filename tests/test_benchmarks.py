"""Benchmark scripts run (tiny settings) so they do not rot."""

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_partition_benchmark_table():
    mod = load("partition")
    table = mod.run(reference=False)
    lines = table.splitlines()
    assert lines[0].startswith("| layers | plan slots | fast (ms)")
    assert [ln.split("|")[1].strip() for ln in lines[2:]] == ["28", "64", "94", "200"]


def test_engine_overhead_benchmark_table():
    import torch

    threads = torch.get_num_threads()
    try:
        table = load("engine").overhead(devices=(1, 2), microbatches=4)
    finally:
        torch.set_num_threads(threads)
    assert len(table.splitlines()) == 2 + 4


def test_host_memory_table():
    table = load("host_memory").table()
    assert "| Qwen3-1.7B | 3.78 | 3.78 GiB (+0.0%)" in table


def test_bubbles_benchmark_table(tmp_path):
    from lightning_roundpipe.plan import LayerCosts

    mod = load("bubbles")
    table = mod.run(
        LayerCosts.uniform(9, head_forward=3, head_backward=6),
        2,
        devices=(1, 2, 4),
        png_dir=tmp_path,
    )
    lines = table.splitlines()
    assert lines[0].startswith("| schedule | N=1 bubble")
    assert len(lines) == 2 + 6
    assert (tmp_path / "bubbles-roundpipe-n4.png").exists()


def test_bubbles_synchronous_paper_table():
    mod = load("bubbles")
    if not mod.CASES.exists():
        pytest.skip("the paper's reference cases are not beside the checkout")
    table, results = mod.paper_sync()
    assert table.splitlines()[0].startswith("| model | reference | whole-batch rounds")
    assert len(results) == 5
    for _, reference, ours in results:
        assert ours <= reference + 0.02


def test_overhead_benchmark_parts():
    mod = load("overhead")
    per_param, n = mod.host_bytes_per_param(64, 2)
    assert n == 2 * (64 * 64 + 64) + 65
    # 4 (fp32 parameters) + 2 (bf16 master) + 4 (gradient buffer) + 8 (AdamW); the
    # step releases its gradients, so nothing else stays between steps
    assert sum(per_param.values()) == pytest.approx(18.0, abs=0.01)
    opt_ms, sync_ms, async_ms, _ = mod.optimizer_hiding(64, 2, iters=2, workers=1)
    assert opt_ms > 0 and sync_ms > 0 and async_ms > 0


def test_lm_runner_runs_each_roundpipe_setting_and_skips_what_needs_cuda():
    """The fit a trial's process runs, here (a fresh interpreter spends most
    of a tiny trial importing torch and Lightning; the GPU session script's
    parts run trials in processes of their own, through ``trial``): each
    RoundPipe setting, LoRA on the Llama shape, reports its rate and steps;
    a peer that needs CUDA is skipped without a process."""
    pytest.importorskip("transformers")
    import torch

    mod = load("lm_runner")
    threads = torch.get_num_threads()
    try:
        ok = mod.run_one("roundpipe_sync", "tiny", 32, 4, 1, 2, 2)
        one = mod.run_one("roundpipe_one_copy", "tiny", 32, 4, 1, 2, 1)
        lora = mod.run_one("roundpipe", "llama-tiny", 32, 4, 1, 3, 1, lora=4)
    finally:
        torch.set_num_threads(threads)
    assert ok.get("tokens_per_second", 0) > 0 and len(ok["step_seconds"]) == 2, ok
    assert one.get("tokens_per_second", 0) > 0, one
    assert lora.get("tokens_per_second", 0) > 0 and len(lora["step_seconds"]) == 3, lora
    if not torch.cuda.is_available():
        assert mod.trial("fsdp_offload", "tiny", 32, 4, 1, 2, 1) == {
            "skipped": "FSDP CPU offload needs CUDA"
        }


def test_throughput_table_and_bars_from_results(tmp_path):
    mod = load("throughput")
    results = {
        "0.6b": {
            "roundpipe": {"tokens_per_second": 9000.0},
            "roundpipe_sync": {"tokens_per_second": 8000.0},
            "auto": {"tokens_per_second": 10000.0},
            "fsdp_offload": {"tokens_per_second": 3000.0},
            "deepspeed_offload": {"skipped": "deepspeed is not installed"},
        },
        "8b": {
            "roundpipe": {"tokens_per_second": 1000.0},
            "roundpipe_sync": {"tokens_per_second": 900.0},
            "auto": {"oom": True},
            "fsdp_offload": {"tokens_per_second": 250.0},
            "deepspeed_offload": {"tokens_per_second": 500.0},
        },
    }
    rows = mod.table(results).splitlines()[2:]
    assert rows[0] == "| 0.6b | roundpipe | 9,000 | 90% | 3.00x |"
    assert rows[3] == "| 0.6b | fsdp_offload | 3,000 | 30% | - |"
    assert rows[4] == "| 0.6b | deepspeed_offload | deepspeed is not installed | - | - |"
    assert rows[5] == "| 8b | roundpipe | 1,000 | - | 2.00x |"  # no baseline: it ran out
    assert rows[7] == "| 8b | auto | out of memory | - | - |"
    png = mod.bars(results, "test", tmp_path / "bars.png")
    assert png.stat().st_size > 1000


def test_gpu_session_script_parts(tmp_path):
    import subprocess

    def session(part):
        env = {**__import__("os").environ, "OUT": str(tmp_path), "SMOKE": "1"}
        return subprocess.run(
            ["bash", str(BENCH / "gpu_session.sh"), part],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )

    bad = session("everything")
    assert bad.returncode == 2 and "give tests, throughput, profile, lora, seqlen" in bad.stderr
    assert not any(tmp_path.iterdir())  # refused before it wrote anything
    ok = session("seqlen")
    assert ok.returncode == 0, ok.stderr[-2000:]
    table = (tmp_path / "max_seqlen.md").read_text()
    assert "| roundpipe | 1 | >= 128 |" in table
    assert "lightning 2." in (tmp_path / "machine.txt").read_text()
    # the profile of two steps: its summary, trace and timeline
    ok = session("profile")
    assert ok.returncode == 0, ok.stderr[-2000:]
    result = json.loads((tmp_path / "profile.json").read_text().strip().splitlines()[-1])
    summary = result["profile"]
    assert summary["window_seconds"] > 0 and summary["optimizer_step_seconds"] > 0
    assert "RP wait weights (rule 2)" in summary["waits"]
    assert {"trace.json.gz", "timeline.png"} <= {p.name for p in (tmp_path / "profile").iterdir()}


def test_the_longest_sequence_is_bisected_between_low_and_high(monkeypatch):
    """max_seqlen's search, with trials that fit up to a known length: the
    lengths it tries, what it reports, and a range with nothing above --low."""
    mod = load("max_seqlen")
    tried, ranks = [], set()

    def fits_up_to(limit):
        def trial(strategy, size, seq, *args, lora=0):
            tried.append(seq)
            ranks.add(lora)
            return {"tokens_per_second": 1.0} if seq <= limit else {"oom": True}

        return trial

    monkeypatch.setattr(mod, "trial", fits_up_to(700))
    assert mod.longest("roundpipe", "tiny", 64, 1024, 64, 1) == "640"
    assert tried == [64, 1024, 512, 768, 640, 704]
    monkeypatch.setattr(mod, "trial", fits_up_to(5000))
    assert mod.longest("roundpipe", "tiny", 64, 1024, 64, 1) == ">= 1024"
    assert mod.longest("roundpipe", "tiny", 128, 128, 64, 1) == ">= 128"
    monkeypatch.setattr(mod, "trial", fits_up_to(32))
    assert mod.longest("roundpipe", "tiny", 64, 1024, 64, 1) == "< 64"
    assert ranks == {0}
    assert mod.longest("roundpipe", "tiny", 64, 1024, 64, 1, lora=32) == "< 64"
    assert ranks == {0, 32}  # the LoRA rank reaches every trial
    monkeypatch.setattr(mod, "trial", lambda *a, **k: {"skipped": "needs CUDA"})
    assert mod.longest("auto", "tiny", 64, 1024, 64, 1) == "needs CUDA"


def test_a_trial_that_runs_out_of_time_is_reported(monkeypatch):
    mod = load("lm_runner")
    monkeypatch.setenv("ROUNDPIPE_TRIAL_TIMEOUT", "0.01")
    assert mod.trial("roundpipe", "tiny", 64, 8, 2, 1, 1) == {"error": "timed out after 0 s"}


def test_experts_benchmark_table():
    table = load("experts").run(
        hidden=64,
        experts=4,
        top_k=2,
        tokens=32,
        vocab=64,
        iters=1,
        implementations=("eager", "grouped_mm"),
    )
    lines = table.splitlines()
    assert lines[0].startswith("| experts implementation | own fwd+bwd (ms)")
    assert [ln.split("|")[1].strip() for ln in lines[2:]] == ["eager", "grouped_mm"]


def test_activation_per_token_measures_a_block_untiled_and_tiled():
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=224,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=500,
    )
    bench = load("activation_per_token")
    per_token, tiled = bench.saved_per_token(config, 80 * 2**30)
    # tiling keeps a block's input-sized values, not its MLP's and norms' working set
    assert 0 < per_token["tiled"] < per_token["never tiled"] / 2
    # what its backward works with at 1M tokens, moment by moment, on CUDA
    value = (1 << 20) * config.hidden_size * 2
    rows = bench.working_rows(tiled, 1 << 20, 0.5 * value, value)
    assert rows[0].startswith("| moment of the backward |") and len(rows) == 5
    assert all(float(r.rsplit("|", 2)[1]) > 0 for r in rows[2:])


def test_frozen_base_measures_both_bases_in_their_own_processes():
    pytest.importorskip("peft")
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            str(BENCH / "frozen_base.py"),
            "--hidden",
            "256",
            "--layers",
            "2",
            "--vocab",
            "1000",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    rows = [ln for ln in done.stdout.splitlines() if ln.startswith(("| float32", "| bfloat16"))]
    assert len(rows) == 2
    shared = [float(r.split("|")[-2]) for r in rows]
    assert shared[0] == 0 and shared[1] > 0  # only the bf16 base is its own master


def test_layered_benchmark_reports_fewer_boundary_bytes_and_the_same_loss():
    """The layered benchmark at a tiny size: the trial with less
    activation_memory gets a layered plan that holds fewer boundary bytes
    and reaches the same loss, and so does that plan rewalked."""
    one, limited, rewalked = load("layered").compare(dict(seq=512, layers=4, hidden=32, vocab=200))
    assert limited["plan"].endswith("|layered")
    assert rewalked["plan"] == limited["plan"].replace("|layered", "|rewalk")
    assert 0 < limited["peak"] <= 0.4 * one["peak"]
    assert rewalked["peak"] == limited["peak"]
    assert limited["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert rewalked["losses"] == pytest.approx(one["losses"], rel=1e-5)


def test_long_context_gpu_runs_its_trials_and_reports_them():
    """The GPU long-sequence benchmark's wiring, on CPU with a tiny model (no
    device memory to measure here): a trial fits and reports its plan and
    tokens/s, the part keeps to its budget, and the tables say what ran."""
    mod = load("long_context_gpu")
    got = mod.run_trial(dict(model="tiny", layers=2, lora=4, seq=96, steps=2))
    assert got["plan"] and got["tokens_per_second"] > 0 and len(got["step_seconds"]) == 2
    assert "measured_bytes" not in got  # (CUDA only)
    calls = []

    def fake(spec, timeout):
        calls.append(timeout)
        return {"tokens_per_second": 10.0, "measured_bytes": 3 * 2**30} if spec["seq"] else {}

    out = mod.run_part([{"seq": 1}, {"seq": 2}], 60.0, 100.0, runner=fake)
    assert calls == [60.0, 60.0] and len(out) == 2
    skipped = mod.run_part([{"seq": 1}], 60.0, 10.0, runner=fake)
    assert skipped == [{"skipped": "the part's 10 s budget was spent"}]
    rows = mod.memory_rows(
        [1024, 2048],
        [
            {
                "plan": "1|1|1",
                "predicted_bytes": 2**31,
                "measured_bytes": 2**30,
                "step_seconds": [1.0],
            },
            {"oom": True},
        ],
    )
    assert rows[2] == "| 1024 | `1\\|1\\|1` | 2.00 | 1.00 | 0.500 | 1.0 | ran |"
    assert rows[3].endswith("| out of memory |")
    rows = mod.throughput_rows([8192], [{"tokens_per_second": 1234.4, "measured_bytes": 2**30}])
    assert rows[2] == "| 8192 | 1234 | 1.00 | ran |"


def test_the_trace_summary_counts_overlapping_work_once(tmp_path):
    """Kernels on two streams that overlap count once; copies give bytes over
    the window and over their own time; RoundPipe ranges are summed by kind."""
    summary = load("trace_summary")

    def x(name, cat, ts, dur, **args):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "args": args}

    events = [
        x("gemm", "kernel", 0, 400, stream=7),
        x("gemm", "kernel", 300, 300, stream=8),  # overlaps: busy 0..600
        x("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 600, 100, bytes=5_000_000),
        x("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", 800, 200, bytes=2_000_000),
        x("RP optimizer step 3", "user_annotation", 0, 250),
        x("RP wait weights (rule 2)", "user_annotation", 600, 100),
        x("RP wait act0 mb3", "user_annotation", 700, 50),
        {"ph": "M", "name": "thread_name", "tid": 1, "args": {"name": "main"}},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    got = summary.summary(summary.load(path))
    assert got["window_seconds"] == 0.001  # 0..1000 us
    assert got["gpu_busy_fraction"] == 0.6 and got["gpu_idle_seconds"] == 0.0004
    assert got["h2d_gb"] == 0.005 and got["h2d_gb_per_s"] == 5.0
    assert got["h2d_gb_per_s_while_copying"] == 50.0 and got["d2h_busy_fraction"] == 0.2
    assert got["optimizer_step_seconds"] == 0.00025
    assert got["waits"] == {"RP wait act0": 0.00005, "RP wait weights (rule 2)": 0.0001}
    summary.picture(summary.load(path), tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 0


def test_the_trace_summary_names_gpu_gaps_and_blocking_host_calls(tmp_path):
    """A stretch without kernels of 0.1 s or more is listed, and so is a
    runtime call that blocked a thread (a pinned allocation), by the thread's
    role; waits for the device (synchronize) are not stalls."""
    summary = load("trace_summary")

    def x(name, cat, ts, dur, tid=0, **args):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "args": args}

    events = [
        x("gemm", "kernel", 0, 1000),
        x("gemm", "kernel", 500_000, 1000),  # 0.499 s after the first ended
        x("gemm", "kernel", 550_000, 1000),  # 0.049 s: too short to list
        x("RP 2:0.B1@0:0-15", "user_annotation", 400_000, 200_000, tid=5),
        x("cudaHostAlloc", "cuda_runtime", 1000, 399_000, tid=5),
        x("cudaEventSynchronize", "cuda_runtime", 1000, 300_000, tid=6),
        x("cudaMalloc", "cuda_runtime", 1000, 40_000, tid=6),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    got = summary.summary(summary.load(path))
    assert got["gpu_gaps"] == [[0.001, 0.499]]
    assert got["host_stalls"] == [
        {"call": "cudaHostAlloc", "thread": "device worker 5", "start": 0.001, "seconds": 0.399}
    ]
    summary.picture(summary.load(path), tmp_path / "t.png")


def test_protocol_delays_reports_both_optimizers(capsys):
    load("protocol_delays").main(
        ["--compute", "0.04", "--step", "0.02", "--weight-copy", "0.01", "--grad-copy", "0.01",
         "--steps", "3"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "| synchronous |" in out
    assert "| asynchronous, one master copy |" in out
    assert "| asynchronous, two master copies |" in out


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="/proc: Linux")
def test_sliding_window_benchmark_tiles_with_less_memory_and_the_same_loss():
    """The sliding-window benchmark at a tiny size: both trials in their own
    processes, the same loss, the tiled one's peak below the dense mask's."""
    mod = load("sliding_window")
    dense, tiled = (mod.trial(2048, 64, d) for d in (True, False))
    assert tiled["loss"] == pytest.approx(dense["loss"], rel=1e-5)
    assert 0 < tiled["grown"] < dense["grown"]


def test_small_layers_benchmark_table():
    table, result = load("small_layers").run(
        num=12, width=8, microbatches=4, steps=1, rounds=1, warmup=4
    )
    lines = table.splitlines()
    assert lines[2].startswith("| profiler | plan | slots")
    assert [ln.split("|")[1].strip() for ln in lines[4:]] == ["without overhead", "with overhead"]
    assert set(result) == {"without overhead", "with overhead"}
