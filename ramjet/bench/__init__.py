"""Agent-swarm load generator (`ramjet bench swarm`) and placement comparison (`ramjet bench compare`).

Modules, one per concern:
  workload.py  the simulated team's public face (pure, seeded): re-exports the four modules below
  text.py      filler text per (salt, id), sized at 4 bytes a token
  sampling.py  the seeded distributions (Zipf popularity, geometric lengths, lognormal sizes)
  world.py     WorkloadConfig, and the harnesses and repositories the whole team shares
  agent.py     conversations, Turn (one request) and Agent (one developer's state machine)
  swarm.py     drives that team against an OpenAI-compatible URL and records every request
  summary.py   the maths over the records (warm-up filter, percentiles, stickiness, buckets)
  compare.py   cells of placements x team sizes x HiCache against fresh simulators
  precise.py   the `precise` placement: simulators publishing KV events, the balancer in precise mode
  scrape.py    figures read from the balancer's /metrics at the end of a cell
  report.py    the comparison's table, summary.md/json, and the spread and paired differences of --repeats
  plots.py     PNG plots of a comparison
  cli.py       `ramjet bench swarm|compare`
"""
