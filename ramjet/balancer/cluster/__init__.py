"""The replicas: who they are (topology.py), their state (fleet.py, replica.py), probes (prober.py), and the
engines' own load (engine_load.py)."""
