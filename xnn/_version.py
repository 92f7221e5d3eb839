"""The version of xnn (read by the package metadata and written into model files)."""

__version__ = "0.1.0"
