import importlib.util
from pathlib import Path

import pytest

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
