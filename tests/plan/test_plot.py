import sys

import pytest

from lightning_roundpipe.plan import LayerCosts, plot_timeline, simulate


def test_png_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    res = simulate("roundpipe", LayerCosts.uniform(7), 2, 4, async_optimizer=True, iterations=2)
    out = plot_timeline(res, tmp_path / "sub" / "timeline.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 5000


def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch):
    res = simulate("gpipe", LayerCosts.uniform(4), 2, 2)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'lightning_roundpipe\[plot\]'"):
        plot_timeline(res, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
