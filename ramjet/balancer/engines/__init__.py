"""Talking to engines: the HTTP client (upstream.py), small questions (client.py), and what the answers mean
(report.py, pure)."""
