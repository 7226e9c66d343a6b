"""Grammar-constrained decoding: a request's JSON schema, regex, choice or grammar becomes a token bitmask
per step (pagoda/structured/manager.py), from a backend behind one small interface (backend.py)."""
from pagoda.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
