"""Operator tools that run before (or beside) the balancer: validation of a Compose bundle or Kubernetes manifests
(rules/), Compose and manifest parsing, KV capacity fitting, the host cache tier check.

They read files and print reports; they import nothing of the balancer but its configuration.
"""
