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


def cli_fails(capsys, args, *words) -> str:
    """``xnn ARGS`` (in process) exits 2 with exactly one line on stderr (no traceback, no
    terminal escape) holding every one of ``words``; returns that line."""
    from xnn.cli.main import main

    capsys.readouterr()
    assert main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err and "\x1b" not in err, err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]
