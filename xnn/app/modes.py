"""Checks of the user's parallel section that belong to no library entry: the degrees of
``xnn md`` / ``relax`` (one simulation decomposed over every rank)."""

from __future__ import annotations

from xnn.errors import InputError


def check_md_degrees(dd: int, world_size: int) -> None:
    """``xnn md`` / ``relax`` decompose one simulation over every rank: ``parallel.dd`` must
    be -1 (inferred) or the world size."""
    if dd not in (-1, world_size):
        raise InputError(f"parallel.dd={dd} but the launch has {world_size} ranks: xnn md and "
                         "relax decompose one simulation over every rank; set parallel.dd: -1 "
                         f"or {world_size}")
