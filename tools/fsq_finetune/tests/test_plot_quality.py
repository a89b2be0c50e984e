"""tools/plot_quality.py draws a PNG from kvcd-eval --json output (no model needed)."""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..", "..")))

import plot_quality  # noqa: E402


def test_plot_from_eval_json(tmp_path):
    data = {"codecs": [
        {"name": "bf16", "compression_ratio": 1.0, "kl_mean": 1e-6, "out_rel_err": 0.002},
        {"name": "int2-oscar", "compression_ratio": 4.2, "kl_mean": 0.01, "out_rel_err": 0.2},
        {"name": "fsq-g16", "compression_ratio": 14.1, "kl_mean": 0.05, "out_rel_err": 0.4}]}
    js = tmp_path / "eval.json"
    js.write_text(json.dumps(data))
    png = tmp_path / "q.png"
    plot_quality.main([str(png), str(js), "--metric", "kl_mean"])
    head = png.read_bytes()[:8]
    assert head == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 5000


def test_plot_from_kvcd_llama_json_with_labels(tmp_path):
    """kvcd-llama --json files (history compression, codec-file names), two window
    settings in one plot with a legend; a wrong number of labels is refused."""
    rows = [{"name": "int2-hadamard", "compression_ratio": 4.5, "compression_ratio_history": 6.4,
             "kl_mean": 0.2, "kl_max": 0.8},
            {"name": "fsq=/some/folder/fsq-g48.st", "compression_ratio": 9.4,
             "compression_ratio_history": 32.0, "kl_mean": 0.3, "kl_max": 3.9}]
    paths = []
    for n in ("ci", "prod"):
        p = tmp_path / f"{n}.json"
        p.write_text(json.dumps({"codecs": rows}))
        paths.append(str(p))
    png = tmp_path / "q.png"
    plot_quality.main([str(png), *paths, "--metric", "kl_max", "--x",
                       "compression_ratio_history", "--labels", "CI,production"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import pytest

    with pytest.raises(SystemExit, match="labels"):
        plot_quality.main([str(png), *paths, "--labels", "one"])
