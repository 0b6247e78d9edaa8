"""Agent-swarm load generator (`ramjet bench swarm`), placement comparison (`ramjet bench compare`) and trace
replay (`ramjet bench trace`).

Modules, one per concern:
  workload.py  the simulated team's public face (pure, seeded): re-exports the four modules below
  text.py      filler text per (salt, id), sized at 4 bytes a token
  sampling.py  the seeded distributions (Zipf popularity, geometric lengths, lognormal sizes)
  world.py     WorkloadConfig, and the harnesses and repositories the whole team shares
  agent.py     conversations, Turn (one request) and Agent (one developer's state machine)
  swarm.py     drives that team against an OpenAI-compatible URL and records every request
  summary.py   the maths over the records (warm-up filter, percentiles, stickiness, buckets)
  compare.py   cells of placements x team sizes x HiCache against fresh simulators
  sims.py      the fresh simulators behind a cell or a trace run (compare's flags), and their CPU share
  precise.py   the `precise` placement: simulators publishing KV events, the balancer in precise mode
  scrape.py    figures read from the balancer's /metrics at the end of a cell
  report.py    the comparison's table, summary.md/json, and the spread and paired differences of --repeats
  plots.py     PNG plots of a comparison
  trace_load.py      Mooncake-format traces: parse and validate, strictly
  trace_prompt.py    one deterministic 512-token text block per hash id, prompts cut to input_length
  trace_schedule.py  the replay window, speedup and time scale: when each request is sent
  ceilings.py        a trace's cached-share ceilings: one infinite shared cache, private per-rank LRU caches
  trace_replay.py    run_trace: one placement's open-loop replay against given URLs, every request recorded
  trace_report.py    a replay's figures, summary.md/json and requests.jsonl
  trace_cells.py     `--placements`: the window through each placement (and repeat), on fresh simulators
  trace_cells_report.py  those runs' table, summary.md/json, and report.py's repeat tables for the trace
  trace_cli.py       `ramjet bench trace FILE`: against running targets, or through placements
  cli.py       `ramjet bench swarm|compare|trace`
"""
