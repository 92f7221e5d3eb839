"""A performance model of decomposed runs past one node: ghost plans at scale (without
running a model) and a calibrated cost of one decomposed step (issue 47)."""
