"""Real-server fixtures, shared by the conformance runners and the fault tests.

Each backend's fixtures live in ``tests/servers/<backend>.py``; they are imported here so that
every test module sees them.
"""
