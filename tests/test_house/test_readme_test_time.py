"""The README says how long the test suite takes, beside the test command (issue 33 item 11):
someone about to run it should know it is minutes, not seconds or an hour."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_says_how_long_the_tests_take_beside_the_test_command() -> None:
    text = README.read_text()
    command = text.index('-e ".[torch,s3,gcs,test]" && python -m pytest -q\n```')
    after = text[command:].split("```", 2)[1]  # from the block's end to the next block
    sentence = after.strip().split("\n\n")[0]
    assert re.search(r"a few minutes on 2 cores", sentence), sentence
