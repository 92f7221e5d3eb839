"""Assertions on the errors xnn raises for bad input (shared by the bad-input test modules)."""

from __future__ import annotations

import pytest

from xnn.errors import XnnError


def raises_one_line(exc, fn, *args, match=None, **kw) -> str:
    """``fn(*args, **kw)`` raises ``exc`` (an xnn error) whose message is a single line;
    returns the message."""
    with pytest.raises(exc, match=match) as info:
        fn(*args, **kw)
    assert isinstance(info.value, XnnError)
    msg = str(info.value)
    assert msg and "\n" not in msg, repr(msg)
    return msg
