"""Speculative decoding: cheap proposals verified by one target forward pass, lossless by rejection sampling."""
