"""What the route families share: the black-box base path and the words of the ``wait`` query."""

BASE = "/{trajectory_uid}/{prompt_uid:path}/v1"
"""Where a trajectory's ``base_url`` points: ``{instance url}/{trajectory_uid}/{prompt_uid}/v1``."""
WAIT = "seconds a new trajectory may be held until admitted (pacing), else 429 at once"
PAUSED = "seconds a call may be held while generation is paused for a weight update, else 429 at once"
