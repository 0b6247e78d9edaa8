"""One balancer: its parts built and wired, started and stopped (build.py), and its memory across restarts
(memory.py)."""
