"""Fixtures that start real backend servers on loopback (one module per backend)."""
