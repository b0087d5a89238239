"""A group filter loaded by dotted path in the worker tests (slime's dynamic-sampling shape)."""

from trajbus.streams.wire.records import ReadyGroup


def drop_marked(group: ReadyGroup) -> tuple[bool, str]:
    """Drop groups whose prompt_uid ends in ``-drop``, naming why."""
    if group.prompt_uid.endswith("-drop"):
        return False, "marked"
    return True, ""


def keep_even(group: ReadyGroup) -> tuple[bool, str]:
    """Keep groups whose prompt_uid ends in an even digit (replay tests re-filter history with it)."""
    return (int(group.prompt_uid[-1]) % 2 == 0), "odd"


def drop_every_13th(group: ReadyGroup) -> tuple[bool, str]:
    """Drop the prompts at dataset offsets 0, 13, 26, ... (uids ``...-o<offset>[~attempt]``)."""
    return int(group.prompt_uid.split("-o")[-1].split("~")[0]) % 13 != 0, "every_13th"
