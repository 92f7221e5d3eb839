"""Bridges to other atomistic toolkits; each imports its toolkit only when used.

* :mod:`xnn.interop.torchsim`: an xnn model as a torch-sim ``ModelInterface``
  (:class:`~xnn.interop.torchsim.XnnTorchSimModel`) and a torch-sim model as an xnn
  potential (:class:`~xnn.interop.torchsim.TorchSimPotential`).
"""
