"""begins_with: whether a token sequence starts with another, token arrays compared in place."""

from array import array

import pytest

from trajbus.streams.wire import token_prefix
from trajbus.streams.wire.token_prefix import begins_with

CONTEXT = array("I", range(100_000, 132_000))  # a 32k-token context


def test_a_context_extended_begins_with_it_and_one_changed_anywhere_does_not():
    prompt = CONTEXT + array("I", [7, 8, 9])
    assert begins_with(prompt, CONTEXT)
    for position in (0, len(CONTEXT) // 2, len(CONTEXT) - 1):  # the first, a middle and the last token
        edited = array("I", prompt)
        edited[position] += 1
        assert not begins_with(edited, CONTEXT)


def test_a_prefix_longer_than_the_ids_is_not_their_beginning_and_an_empty_one_always_is():
    assert not begins_with(CONTEXT[:10], CONTEXT[:11])
    assert begins_with(CONTEXT, array("I")) and begins_with(array("I"), array("I"))
    assert begins_with(CONTEXT, CONTEXT)


def test_arrays_are_compared_by_the_c_library_and_other_sequences_item_by_item(monkeypatch):
    assert token_prefix._MEMCMP is not None  # on Linux and macOS the C library's memcmp is found
    assert begins_with([1, 2, 3], array("I", [1, 2])) and begins_with(array("I", [1, 2, 3]), [1, 2])
    assert not begins_with([1, 2, 3], array("I", [2]))
    assert begins_with([{"role": "user", "content": "a"}, {"role": "assistant"}], [{"role": "user", "content": "a"}])
    assert not begins_with(array("i", [-1, 2]), array("I", [1]))  # another kind of array: compared by value
    monkeypatch.setattr(token_prefix, "_MEMCMP", None)  # no C library: the same answers by slicing
    assert begins_with(CONTEXT + array("I", [1]), CONTEXT) and not begins_with(CONTEXT[1:] + array("I", [1, 1]),
                                                                                 CONTEXT)


@pytest.mark.parametrize("typecode", ["I", "i", "B", "q"])
def test_every_integer_array_kind_compares_by_its_bytes_as_by_its_values(typecode):
    ids = array(typecode, [1, 2, 3, 4])
    assert begins_with(ids, array(typecode, [1, 2, 3]))
    assert not begins_with(ids, array(typecode, [1, 2, 4]))


def test_float_arrays_compare_by_value_not_by_bytes():
    assert begins_with(array("d", [0.0, 1.0]), array("d", [-0.0]))  # equal values, other bytes
    assert not begins_with(array("d", [float("nan")]), array("d", [float("nan")]))
