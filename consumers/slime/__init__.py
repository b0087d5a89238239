"""slime's side of the trainer: a prompt group assembled by the stream worker as the ``Sample``s slime trains
on (``samples.py``), slime's own ``Sample`` where slime is installed, else trajbus's of the same fields
(``sample.py``, ``sample_kind.py``). The data source and rollout functions that slime runs are
``pipelines.slime``'s."""
