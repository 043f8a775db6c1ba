"""``MODEL_VERSION`` keeps stored sweep results from an older simulator out of a new
sweep; its docstring lists what each bump changed. A change listed without the bump
(as once happened: the notes said 4 while the value stayed 3) would let results of the
old model be reused."""

from __future__ import annotations

import re
from pathlib import Path

import mori.sim
from mori.sim import MODEL_VERSION


def test_model_version_is_the_last_change_listed() -> None:
    src = Path(mori.sim.__file__).read_text(encoding="utf-8")
    doc = src.split("MODEL_VERSION = ", 1)[1]
    listed = [int(n) for n in re.findall(r"^(\d+): ", doc, flags=re.M)]
    assert listed, "the docstring lists no change"
    assert listed == sorted(listed) and listed == list(range(listed[0], listed[-1] + 1))
    assert listed[-1] == MODEL_VERSION
