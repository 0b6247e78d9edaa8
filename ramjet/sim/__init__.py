"""A simulated SGLang v0.5.20 engine with per-DP-rank prefix caches (`ramjet sim`).

`build_app(SimConfig(...))` (ramjet.sim.server) is the ASGI app; docs/simulator.md
describes the model and its calibration.
"""
