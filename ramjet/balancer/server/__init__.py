"""The processes of `ramjet serve`: listeners, signals and shutdown (serve.py), RJ_WORKERS (workers.py, shared.py)."""
