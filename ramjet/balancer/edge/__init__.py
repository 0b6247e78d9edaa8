"""What clients and operators talk to: the client-facing app (app.py) and its limits (protocol.py, routes.py,
keys.py), and the operator API (admin.py)."""
