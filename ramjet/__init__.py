"""Ramjet: a session-affine, prefix-cache-aware load balancer for LLM inference engines."""

__version__ = "0.1.0"
