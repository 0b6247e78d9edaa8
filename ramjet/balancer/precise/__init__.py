"""Precise mode (RJ_KV_EVENTS=zmq): the engines' KV events (mode.py), requests tokenized as the engine does
(matcher.py), and each replica's standing (trust.py)."""
