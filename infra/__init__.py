"""The Kafka broker a user runs, topic provisioning and deployment files.

Imports nothing of the rest of trajbus: every other package builds on it.
"""
