"""Spatial domain decomposition: partition, halo exchange, and the decomposed evaluator."""
