"""Routing: pure functions and state, no I/O. Request body -> fingerprint -> overlaps -> policy -> ranking.

Imports nothing from the balancer (an import contract in pyproject.toml).
"""
