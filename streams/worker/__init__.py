"""The stream worker (``trajbus worker``): the Faust app that turns step events into ready prompt groups.

``process`` runs it as a process; ``assembler`` is its one agent, which owns the typed
state (``state_store``), emission, recovery, positions and the step bodies.
"""
