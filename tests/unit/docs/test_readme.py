"""README.md stays a first page: under 10 KB, the two set-up commands first."""

from __future__ import annotations

import re

from tests.helpers.paths import ROOT

README = ROOT / "README.md"


def test_readme_is_under_10_kb() -> None:
    assert len(README.read_bytes()) < 10_000


def test_readme_opens_with_the_two_commands() -> None:
    text = README.read_text()
    first_section = text.split("\n## ")[1]
    assert first_section.startswith("Two commands")
    blocks = re.findall(r"```bash\n(.*?)```", first_section, re.S)
    assert len(blocks) == 2
    assert "examples/train_gpt.py fit --config configs/quickstart.yaml" in blocks[0]
    assert "python -m pytest" in blocks[1] and "<!-- ci-test-command -->" in first_section
