"""End-to-end: ``kvgate serve`` as users deploy it, in subprocesses, against real servers."""
