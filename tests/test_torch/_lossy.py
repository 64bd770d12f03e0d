"""A Checkpointer whose first save must say the weights are stored lossy, for tests that
make Checkpointers without eval_fn on purpose (the warning comes with the first save, not
construction: issue 43, item 8)."""

from __future__ import annotations

from typing import Any

import pytest

from inshrink_store.torch import Checkpointer


class SaysLossy(Checkpointer):
    """Its first save is checked for the "no eval_fn" warning; later saves run as usual."""

    _said = False

    def save(self, *args: Any, **kwargs: Any) -> Any:
        if self._said:
            return super().save(*args, **kwargs)
        self._said = True
        with pytest.warns(UserWarning, match="no eval_fn"):
            return super().save(*args, **kwargs)
