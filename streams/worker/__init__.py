"""The stream worker (``trajbus worker``): the Faust app that turns step events into ready prompt groups.

``process`` runs it as a process, with its chores (``chores``: policy watcher, statistics, metrics
endpoint); ``assembler`` is its one agent, which owns the typed state (``state_store``), the applier,
emission, reconciliation, recovery, positions, the step bodies and the held partitions' locks.
"""
