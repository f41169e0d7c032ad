"""Conformance runners: one per connector (a package so their basenames may repeat)."""
