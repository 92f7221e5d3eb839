"""Long-range terms: dispersion (DFT-D3)."""

from xnn.models.long_range.dispersion import D3

__all__ = ["D3"]
