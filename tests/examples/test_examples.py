import importlib.util
import json
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_figure1_timeline(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    mod = load("figure1_timeline")
    mod.main(["--out", str(tmp_path), "--head", "1"])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "figure1-head1-looped-bfs.png",
        "figure1-head1-roundpipe-async-2iter.png",
        "figure1-head1-roundpipe.png",
    ]
    text = capsys.readouterr().out
    # the paper's asymmetric split: 3-layer forward stages, 1-layer backward stages
    assert "RoundPipe plan 3,3,3,3|1|1,1,1,1,1,1,1,1,1,1,1,1" in text


def test_figure1_roundpipe_beats_looped_bfs():
    mod = load("figure1_timeline")
    for head in (1.0, 3.0):
        rp, bfs, *_ = mod.run(Path("unused"), head, png=False)
        assert rp.bubble_ratio < bfs.bubble_ratio


def test_main_job_trains_and_reports(tmp_path):
    pytest.importorskip("transformers")
    mod = load("train_tiny_lm")
    report = mod.main(["--steps", "40", "--out", str(tmp_path)])
    assert report["last_loss"] < report["first_loss"] - 1.0  # a visibly falling loss
    assert report["tokens_per_second"] > 0
    assert 0.0 <= report["bubble_ratio"] < 1.0
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_main_job_runs_steps_past_an_epoch(tmp_path):
    """A batch large enough that the steps take several epochs: it validates
    every third of the steps (it was refused: a validation interval longer
    than an epoch). 400 sentences are 197 sequences, 3 batches of 64: an
    epoch is shorter than the 4 steps between validations."""
    pytest.importorskip("transformers")
    mod = load("train_tiny_lm")
    argv = ["--steps", "12", "--batch-size", "64", "--sentences", "400", "--out", str(tmp_path)]
    report = mod.main(argv)
    assert report["steps"] == 12


@pytest.mark.parametrize("strategy", [None, "roundpipe_sync"])
def test_lightning_cli_yaml_config_runs(strategy, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("jsonargparse")
    mod = load("train_tiny_lm_cli")
    args = [
        "fit",
        "--config",
        str(EXAMPLES / "train_tiny_lm.yaml"),
        "--trainer.max_steps",
        "3",
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.val_check_interval",
        "3",
    ]
    if strategy:
        args += ["--trainer.strategy", strategy]
    cli = mod.main(args)
    from lightning_roundpipe import RoundPipeStrategy

    assert isinstance(cli.trainer.strategy, RoundPipeStrategy)
    assert cli.trainer.strategy.async_optimizer is (strategy is None)
    assert cli.trainer.global_step == 3


@pytest.mark.parametrize("name", ["finetune_hf", "lora_peft"])
def test_hugging_face_examples_train(name, tmp_path):
    pytest.importorskip("transformers")
    argv = ["--steps", "6", "--devices", "2"]
    if name == "lora_peft":
        pytest.importorskip("peft")
        argv += ["--save", str(tmp_path / "adapter")]
    trainer = load(name).main(argv)
    assert trainer.global_step == 6 and trainer.max_epochs >= 1
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    if name == "lora_peft":  # the trained adapter, in PEFT's format
        from peft import get_peft_model_state_dict
        from safetensors.torch import load_file

        saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
        trained = get_peft_model_state_dict(trainer.lightning_module.model)
        assert saved.keys() == trained.keys() and saved
        for key, value in saved.items():
            assert torch.equal(trained[key], value), key


def test_sequential_example_learns():
    trainer = load("sequential").main(["--steps", "60", "--devices", "2"])
    assert float(trainer.callback_metrics["train_loss"]) < 0.5


def test_pictures_regenerate_with_one_command(tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("transformers")
    results = tmp_path / "throughput.json"
    results.write_text(
        json.dumps(
            {
                "date": "2026-11-22",
                "device": "test",
                "setting": dict(seq=64, batch=8, micro=2, steps=4, devices=1),
                "results": {"tiny": {"roundpipe": {"tokens_per_second": 5.0}, "auto": {}}},
            }
        )
    )
    written = load("make_pictures").main(
        ["--out", str(tmp_path), "--steps", "3", "--throughput", str(results)]
    )
    assert {p.name for p in written} == {
        "bubbles-bars.png",
        "loss-curves.png",
        "throughput-bars.png",
        "protocol-rules.png",
    }
    assert len(list(tmp_path.glob("figure1-*.png"))) == 6


def test_reward_model_example_learns_the_preference():
    """A sequence classifier trained on pairs with a loss built from its
    rewards (no labels=): the preferred sequences end on even tokens."""
    pytest.importorskip("transformers")
    trainer = load("reward_model").main(["--steps", "40", "--devices", "2"])
    assert trainer.global_step == 40
    assert float(trainer.callback_metrics["val_accuracy"]) > 0.9
