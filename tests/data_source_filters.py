"""Buffer filters the data-source tests load by dotted path."""


def newest_first(args, rollout_id, buffer, num_samples):
    taken = buffer[-num_samples:][::-1]
    del buffer[-num_samples:]
    return taken
