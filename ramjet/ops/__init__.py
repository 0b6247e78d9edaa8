"""Operator tools that run before (or beside) the balancer: bundle validation, Compose parsing, KV capacity fitting.

They read files and print reports; they import nothing of the balancer but its configuration.
"""
