"""Bridges to other atomistic toolkits; each imports its toolkit only when used.

* :mod:`xnn.interop.torchsim`: an xnn model as a torch-sim ``ModelInterface``
  (:class:`~xnn.interop.torchsim.XnnTorchSimModel`) and a torch-sim model as an xnn
  potential (:class:`~xnn.interop.torchsim.TorchSimPotential`).
* :mod:`xnn.interop.lammps`: an xnn model as the force field of a serial LAMMPS run through
  ``fix external`` (:class:`~xnn.interop.lammps.XnnFixExternal`).
"""
