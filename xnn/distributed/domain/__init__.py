"""Spatial domain decomposition: each rank owns the atoms of its box (``state``), receives
ghosts pushed by their owners (``local``, ``halo``) and migrates atoms between steps
(``migrate``): the :class:`~xnn.distributed.domain.layout.SpatialLayout` of the one
decomposed potential (:mod:`xnn.distributed.potential`)."""
