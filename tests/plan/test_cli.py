import io
import json
import subprocess
import sys

import pytest

from lightning_roundpipe.plan.cli import main


def run(args):
    out = io.StringIO()
    code = main(args, out=out)
    return code, out.getvalue()


def test_partition_inline_costs():
    code, text = run(
        ["partition", "--forward", "1x12,3", "--backward", "2x12,6", "-N", "4", "-M", "8"]
    )
    assert code == 0
    assert text.splitlines()[0] == "6,6|1|3,3,3,3"
    assert "objective (M*S + N*(N-1)) * t_max = 612" in text
    assert "B1  forward+loss+backward  layer 12" in text


def test_partition_with_task_overhead(tmp_path):
    args = ["partition", "--forward", "1x64", "--backward", "2x64", "-N", "4", "-M", "8"]
    assert run(args)[1].splitlines()[0].count(",") > 60  # one-layer backward stages
    code, text = run([*args, "--task-overhead", "3"])
    assert code == 0
    assert text.splitlines()[0] == "48|16|16,16,16"
    assert "t_max 51," in text
    path = tmp_path / "costs.json"  # the JSON form, as a measured run saves it
    path.write_text(json.dumps({"forward": [1] * 64, "backward": [2] * 64, "task_overhead": 3}))
    code, text = run(["partition", "--costs", str(path), "-N", "4", "-M", "8"])
    assert text.splitlines()[0] == "48|16|16,16,16"


def test_partition_from_json_with_memory(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"forward": [1] * 8, "backward": [2] * 8, "memory": [2] * 8}))
    code, text = run(
        ["partition", "--costs", str(path), "-N", "2", "-M", "4", "--memory-limit", "4"]
    )
    assert code == 0
    assert "memory 4" in text


def test_simulate_table_and_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "t.png"
    code, text = run(
        [
            "simulate",
            "--forward",
            "1x12,3",
            "--backward",
            "2x12,6",
            "-N",
            "4",
            "-M",
            "8",
            "--schedule",
            "roundpipe",
            "--schedule",
            "looped-bfs",
            "--async",
            "--png",
            str(png),
        ]
    )
    assert code == 0
    lines = text.splitlines()
    assert lines[0].split() == [
        "schedule",
        "makespan",
        "bubble",
        "fill",
        "drain",
        "steady",
        "async",
        "stages",
    ]
    assert lines[2].startswith("roundpipe ")
    assert lines[3].startswith("looped-bfs ")
    assert (tmp_path / "t-roundpipe.png").exists() and (tmp_path / "t-looped-bfs.png").exists()


def test_simulate_all_by_default():
    code, text = run(
        [
            "simulate",
            "--forward",
            "1x8",
            "--backward",
            "2x8",
            "-N",
            "2",
            "-M",
            "4",
            "--plan",
            "4,3|1|4,3",
        ]
    )
    assert code == 0
    assert [ln.split()[0] for ln in text.splitlines()[2:7]] == [
        "roundpipe",
        "gpipe",
        "1f1b",
        "interleaved-1f1b",
        "looped-bfs",
    ]
    assert "4,3|1|4,3" in text
    assert text.splitlines()[7].startswith("roundpipe: 4 of 4 micro-batches per round")


def test_errors_exit_2_with_message(capsys):
    code, _ = run(
        [
            "partition",
            "--forward",
            "1,1",
            "--backward",
            "1,1",
            "--memory",
            "1,9",
            "--memory-limit",
            "4",
            "-N",
            "2",
            "-M",
            "2",
        ]
    )
    assert code == 2
    assert "layer 1 needs 9 of device memory" in capsys.readouterr().err
    code, _ = run(["partition", "-N", "2", "-M", "2"])
    assert code == 2
    assert "--costs FILE, or --forward and --backward" in capsys.readouterr().err


def test_bad_number_list_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["partition", "--forward", "1,x", "--backward", "1,1", "-N", "1", "-M", "1"])
    assert exc.value.code == 2
    assert "is not a number or VALUExCOUNT" in capsys.readouterr().err
    # an empty entry is refused, not dropped (a layer would go missing)
    for given in ("1,,2", "1,2,"):
        with pytest.raises(SystemExit) as exc:
            main(["partition", "--forward", given, "--backward", "1x3", "-N", "1", "-M", "1"])
        assert exc.value.code == 2
        assert f"argument --forward: {given!r} has an empty entry" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--forward=1x-4,1x4", "--backward", "2x4"],
            "the COUNT of VALUExCOUNT must be an integer",
        ),
        (["--forward", "1x4", "--backward", "2x4", "--comm-time", "inf"], "finite number >= 0"),
    ],
)
def test_counts_and_times_that_mean_nothing_are_argparse_errors(capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        main(["simulate", *args, "-N", "2", "-M", "4"])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_memory_limit_without_memory_and_a_scalar_cost_are_refused(capsys, tmp_path):
    code, _ = run(
        [
            "partition",
            "--forward",
            "1x4",
            "--backward",
            "2x4",
            "-N",
            "2",
            "-M",
            "4",
            "--memory-limit",
            "1",
        ]
    )
    assert code == 2
    assert "--memory-limit needs the layers' memory: give --memory" in capsys.readouterr().err
    path = tmp_path / "scalar.json"
    path.write_text('{"forward": [1, 2], "backward": [1, 2], "memory": 7}')
    code, _ = run(["partition", "--costs", str(path), "-N", "2", "-M", "4"])
    assert code == 2
    assert "LayerCosts.memory must be a list of numbers" in capsys.readouterr().err


def test_simulating_every_schedule_skips_the_baselines_a_case_does_not_fit():
    code, text = run(
        ["simulate", "--forward", "1x12,3", "--backward", "2x12,6", "-N", "3", "-M", "4"]
    )
    assert code == 0
    assert text.splitlines()[2].startswith("roundpipe")
    assert "interleaved-1f1b: not simulated: interleaved-1f1b needs num_microbatches (4)" in text


def test_module_entry_point():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_roundpipe.plan",
            "partition",
            "--forward",
            "1x4",
            "--backward",
            "2x4",
            "-N",
            "1",
            "-M",
            "2",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert proc.stdout.splitlines()[0] == "|4|"


def test_the_estimate_names_the_model_by_its_config_file_or_folder(tmp_path):
    from lightning_roundpipe.plan.cli import _model_name

    folder = tmp_path / "Llama-3.1-8B"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (tmp_path / "mistral.json").write_text("{}")
    assert _model_name(str(folder / "config.json")) == "Llama-3.1-8B"
    assert _model_name(str(tmp_path / "mistral.json")) == "mistral"
    assert _model_name("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"  # a cached name


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--schedule", "roundpipe", "--stages", "4,4"], "--stages applies to none of the"),
        (["--schedule", "gpipe", "--round-size", "2"], "--round-size applies to none of the"),
        (["--schedule", "gpipe", "--async"], "--async applies to none of the"),
        (["--schedule", "1f1b", "--stages-per-device", "2"], "--stages-per-device applies to"),
        (["--schedule", "gpipe", "--plan", "4|1|3"], "--plan applies to none of the"),
        (["--round-size", "9"], "--round-size 9 is more than the 8 micro-batches"),
    ],
)
def test_simulate_refuses_options_no_simulated_schedule_uses(extra, message, capsys):
    """An option of a schedule that is not simulated would be ignored: it is
    refused, naming the flag."""
    args = ["simulate", "--forward", "1x8", "--backward", "2x8", "-N", "2", "-M", "8"]
    code, _ = run(args + extra)
    assert code == 2
    assert message in capsys.readouterr().err


def test_a_layer_over_the_memory_limit_is_refused_naming_the_flags(capsys):
    argv = "partition --forward 1x4,3 --backward 2x4,6 -N 2 -M 4 --memory 1x5 --memory-limit 0.5"
    code, _ = run(argv.split())
    assert code == 2
    err = capsys.readouterr().err
    assert "layer 0 needs 1 of device memory" in err
    assert "Raise --memory-limit, or give the --memory of a smaller micro-batch" in err
    assert "device_memory_limit" not in err  # (the strategy's option, not a flag here)


QWEN3_1_7B = [  # the paper's Qwen3-1.7B case: 28 blocks and the LM head, its hop time
    "--forward",
    "7.429x28,22.0655",
    "--backward",
    "15.831x28,43.707",
    "-N",
    "8",
    "-M",
    "16",
    "--comm-time",
    "1.6",
    "--schedule",
    "roundpipe",
]


def test_simulate_chooses_the_round_as_the_runtime_does():
    """Without --round-size, RoundPipe runs in the round the runtime would
    choose (choose_round over the plan's simulated step): on the paper's
    Qwen3-1.7B case rounds of 8, 19.07% of bubble (the reference's figure),
    where whole-batch rounds idle 24.48%."""
    from lightning_roundpipe.plan import LayerCosts, choose_plan, choose_round, simulated_period

    code, text = run(["simulate", *QWEN3_1_7B])
    assert code == 0
    row, note = text.splitlines()[2], text.splitlines()[3]
    assert row.split()[:3] == ["roundpipe", "2286.02", "19.07%"]
    assert note.startswith("roundpipe: 8 of 16 micro-batches per round: a simulated step 7%")
    assert "as the runtime chooses (--round-size to fix it)" in note
    # the runtime's own choice, as the engine makes it for this plan
    costs = LayerCosts([7.429] * 28 + [22.0655], [15.831] * 28 + [43.707])
    plan = choose_plan(costs, 8, 16, async_optimizer=False, comm_time=1.6)
    assert str(plan) in row

    def period(g):
        return simulated_period(costs, plan, 8, 16, async_optimizer=False, round_size=g)

    assert choose_round(16, num_devices=8, period=period).round_size == 8
    # a fixed round is taken as given
    code, text = run(["simulate", *QWEN3_1_7B, "--round-size", "16"])
    assert text.splitlines()[2].split()[:3] == ["roundpipe", "2449.78", "24.48%"]
    assert text.splitlines()[3] == "roundpipe: 16 of 16 micro-batches per round (--round-size)"


MEMORY = ["--forward", "1x8", "--backward", "2x8", "--memory", "1x8", "-N", "2", "-M", "4"]


def test_simulate_checks_a_given_plan_against_the_memory_limit(capsys):
    """--plan with --memory-limit: the plan's stages are checked against the
    limit (it used to be ignored)."""
    argv = ["simulate", *MEMORY, "--schedule", "roundpipe", "--plan", "4,3|1|4,3"]
    code, _ = run([*argv, "--memory-limit", "3"])
    assert code == 2
    err = capsys.readouterr().err
    assert (
        "--plan 4,3|1|4,3 does not fit --memory-limit 3: stage F1 (layers 0-3) needs 4 of "
        "device memory for one micro-batch; give a --plan whose stages fit, drop --plan (the "
        "plan chosen within the limit), or raise --memory-limit"
    ) in err
    code, text = run([*argv, "--memory-limit", "4"])  # every stage fits
    assert code == 0 and "4,3|1|4,3" in text
    code, text = run(["simulate", *MEMORY, "--schedule", "roundpipe", "--memory-limit", "3"])
    assert code == 0  # the plan chosen within the limit
    row = text.splitlines()[2].split()
    assert max(map(int, row[-1].replace("|", ",").split(","))) <= 3


def test_the_library_checks_a_given_plan_against_the_memory_limit():
    from lightning_roundpipe.plan import LayerCosts, PlanError, simulate

    costs = LayerCosts([1.0] * 8, [2.0] * 8, memory=[1.0] * 8)
    with pytest.raises(PlanError, match=r"plan 4,3\|1\|4,3 does not fit memory_limit 3: stage F1"):
        simulate("roundpipe", costs, 2, 4, plan="4,3|1|4,3", memory_limit=3)
    assert simulate("roundpipe", costs, 2, 4, plan="4,3|1|4,3", memory_limit=4).makespan > 0


def test_simulate_png_without_a_suffix_says_the_file_it_wrote(tmp_path):
    """(It printed the path given while the plot was saved with .png added.)"""
    pytest.importorskip("matplotlib")
    base = ["simulate", "--forward", "1x4", "--backward", "2x4", "-N", "2", "-M", "4"]
    code, text = run([*base, "--schedule", "roundpipe", "--png", str(tmp_path / "one")])
    assert code == 0 and f"wrote {tmp_path / 'one.png'}" in text.splitlines()
    assert (tmp_path / "one.png").exists() and not (tmp_path / "one").exists()
    code, text = run(
        [*base, "--schedule", "gpipe", "--schedule", "1f1b", "--png", str(tmp_path / "t")]
    )
    assert code == 0 and f"wrote {tmp_path / 't-1f1b.png'}" in text.splitlines()
    assert (tmp_path / "t-gpipe.png").exists() and (tmp_path / "t-1f1b.png").exists()
