"""Data sources, rollout loops, the orchestrated demo and the `trajbus` CLI."""
