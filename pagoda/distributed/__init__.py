"""Tensor parallelism across processes: the collectives its ranks run (communicator.py)."""
