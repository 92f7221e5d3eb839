"""Spatial domain decomposition: each rank owns the atoms of its box (``state``), receives
ghosts pushed by their owners (``local``, ``halo``), migrates atoms between steps
(``migrate``) and evaluates through ``DomainPotential`` (``potential``); ``DomainDecomposed``
(``decomposed``) is the single-point wrapper."""
