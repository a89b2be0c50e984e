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
