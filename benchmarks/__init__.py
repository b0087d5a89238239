"""Measured runs: each compares against a baseline in the same run and prints a table."""
