"""The README's complete example runs against the real daemon."""
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(daemon, monkeypatch, capsys):
    text = README.read_text()
    section = text.split("## A complete example", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.setenv("KVCD_TARGET", daemon.grpc)
    exec(compile(code, str(README), "exec"), {"__name__": "readme_example"})
    out = capsys.readouterr().out
    assert "ignored_tokens=2" in out and "step 2: o (1, 4, 16)" in out
    assert "health SERVING" in out
