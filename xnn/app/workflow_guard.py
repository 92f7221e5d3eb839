"""``safety.max_force_uncertainty`` in ``xnn run``: the committee's uncertainty guard of
``xnn md`` and ``xnn relax``, per system and stage.

Every system of a stage has its own :class:`~xnn.dynamics.safety.UncertaintyGuard`, checked
at each of its steps (the first included) on the system alone, so the message and the
decision are those ``xnn relax`` / ``xnn md`` give for that structure. ``stop``: the system
fails its stage (its row's reason is the guard's message; its frame is in its trajectory,
``final.xyz`` and ``uncertain.xyz``) and leaves the campaign while the others go on;
``warn``: an :class:`~xnn.dynamics.safety.UncertaintyWarning` once per excursion, counted in
the row's reason. The guards' state travels in the campaign's checkpoint.
"""

from __future__ import annotations

import warnings

import torch

from xnn.data import keys as K
from xnn.dynamics import slots
from xnn.dynamics.safety import SimulationError, UncertaintyGuard, UncertaintyWarning
from xnn.dynamics.state import MDState

#: the phrase of every row reason the guard writes (``summary.json`` counts them)
GUARD = "safety.max_force_uncertainty"


class SystemGuards:
    """The uncertainty guards of the systems of one stage.

    Args:
        threshold: eV/Å (``safety.max_force_uncertainty``); ``None``: no guard.
        action: ``"stop"`` or ``"warn"`` (``safety.on_uncertainty``).
        stage: the stage's name (in the messages).
    """

    def __init__(self, threshold: float | None, action: str, stage: str):
        self.threshold, self.action, self.stage = threshold, action, stage
        self.guards: dict[int, UncertaintyGuard] = {}
        self.first: dict[int, str] = {}  # a warned system's first message in this stage

    def check(self, state: MDState, ids: list[int]) -> dict[int, str]:
        """Look at every system of the batch ``state`` (system ``k`` has id ``ids[k]``);
        warns (``"warn"``) and returns ``{k: why}`` of the systems that must stop."""
        g = state.graph
        if self.threshold is None or K.FORCES_STD not in g:
            return {}
        std = g[K.FORCES_STD].detach()
        top = torch.zeros(g.n_systems, dtype=std.dtype, device=std.device).scatter_reduce(
            0, g.batch, torch.nan_to_num(std, nan=float("inf")), "amax", include_self=True)
        own = slots.own_steps(state).tolist()
        stops = {}
        for k, i in enumerate(ids):
            guard = self.guards.setdefault(i, UncertaintyGuard(self.threshold, self.action))
            if not float(top[k]) > self.threshold:
                guard.above = False  # what the guard's own check does below the threshold
                continue
            one = slots.select(state, [k]).replace(step=own[k])
            try:
                msg = guard.check(one)
            except SimulationError as err:
                stops[k] = f"stage {self.stage}, {err}; stopped (frame in uncertain.xyz)"
                continue
            if msg is not None:
                msg = f"system {i}, stage {self.stage}, {msg}"
                self.first.setdefault(i, msg)
                warnings.warn(msg, UncertaintyWarning, stacklevel=2)
        return stops

    def leave(self, system_id: int) -> str:
        """Forget a system leaving the stage; the note of its row (``""``: never warned)."""
        guard, first = self.guards.pop(system_id, None), self.first.pop(system_id, "")
        if guard is None or not guard.excursions:
            return ""
        return (f"warned: {guard.excursions} excursion(s) above {GUARD}={self.threshold}, "
                f"the first: {first}")

    def state_dict(self, ids: list[int]) -> dict[str, list]:
        """The guards of the systems ``ids`` (checkpoint meta)."""
        return {str(i): [self.guards[i].above, self.guards[i].excursions, self.first.get(i, "")]
                for i in ids if i in self.guards}

    def load(self, saved: dict) -> None:
        """Restore guards written by :meth:`state_dict`."""
        for i, (above, excursions, first) in saved.items():
            guard = UncertaintyGuard(self.threshold, self.action)
            guard.above, guard.excursions = bool(above), int(excursions)
            self.guards[int(i)] = guard
            if first:
                self.first[int(i)] = first
