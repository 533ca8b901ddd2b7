"""Resize and Upsample as PopART computes them (filled in by the Resize work)."""
