"""`ramjet replay`: re-score recorded routing journals under other policies and settings, offline.

A live benchmark cell takes a minute or more; a replay of its journal under a dozen
settings takes seconds, so settings are searched here and only the winners confirmed
live (docs/replay.md).

  journal.py     read a journal back: the recording's settings and every request, in arrival order
  placements.py  parse --placements (policy names with settings)
  decisions.py   re-decide every request under one placement, with a real Router
  cache.py       the simulated engine cache, calibrated on the journal's usage
  prefill.py     the per-replica prefill queue: balance in seconds
  figures.py     one placement's figures over the counted window
  run.py         a whole replay: the recording's row and every placement's
  report.py      Markdown or JSON
  cli.py         the command
"""
