"""Whole-file tools behind the facade and the CLI: inspect, verify, diff and convert."""
