"""One request through the balancer: decide (decide.py), attempt (forward.py, attempts.py), relay (relay.py),
record (outcome.py, journal.py); the listeners that learn from each attempt (events.py)."""
