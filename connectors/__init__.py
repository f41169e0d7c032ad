"""kvgate's connectors: one module per backend, the module named after its URL scheme."""
