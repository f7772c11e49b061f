"""The README's test command is the one CI runs."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^(python -m pytest[^\n#]*?)\s*(?:#.*)?$", readme, flags=re.M)
    assert commands, "README.md must give the test command"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands[0].strip() in [line.strip() for line in ci]
    assert "torch==2.13.0" in "\n".join(ci)
