"""Decomposition by a host MD engine (LAMMPS): :class:`~.layout.HostLayout`."""
