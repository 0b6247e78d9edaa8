"""Agent-swarm load generator (`ramjet bench swarm`) and placement comparison (`ramjet bench compare`).

Modules, one per concern:
  workload.py  the simulated team: harnesses, repositories, tasks, conversations (pure, seeded)
  swarm.py     drives that team against an OpenAI-compatible URL and records every request
  summary.py   the maths over the records (warm-up filter, percentiles, stickiness, buckets)
  compare.py   cells of placements x team sizes x HiCache against fresh simulators
  plots.py     PNG plots of a comparison
  cli.py       `ramjet bench swarm|compare`
"""
