"""Stop strings over streamed text deltas."""

from __future__ import annotations

import pytest

from gateway.stop import StopStringMatcher


def feed(stops, deltas):
    matcher = StopStringMatcher(stops)
    out = [matcher.push(d) for d in deltas]
    return out, matcher


def test_stop_string_split_across_deltas_truncates_before_it():
    out, matcher = feed(["STOP"], ["Hello S", "TO", "P and more", " never seen"])
    assert "".join(out) == "Hello "
    assert matcher.matched == "STOP"


def test_text_that_might_start_a_stop_string_is_held_back():
    out, matcher = feed(["</end>"], ["a <", "/e"])
    assert out == ["a ", ""]
    assert matcher.matched is None
    # It was not the stop string after all: released with the next delta.
    assert matcher.push("x") == "</ex"


def test_held_back_text_is_released_at_the_end():
    out, matcher = feed(["\nUser:"], ["Sure.", "\nUs"])
    assert "".join(out) == "Sure."
    assert matcher.flush() == "\nUs"
    assert matcher.matched is None


def test_earliest_of_several_stop_strings_wins():
    out, matcher = feed(["world", "lo w"], ["hello world"])
    assert out == ["hel"]
    assert matcher.matched == "lo w"


def test_stop_string_at_the_very_start_gives_empty_text():
    out, matcher = feed(["##"], ["#", "# heading"])
    assert "".join(out) == ""
    assert matcher.matched == "##"


def test_without_stop_strings_everything_passes_through():
    out, matcher = feed([], ["a", "b"])
    assert out == ["a", "b"] and matcher.flush() == ""


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError):
        StopStringMatcher([""])


def test_include_returns_the_matched_stop_string_with_the_text_before_it():
    matcher = StopStringMatcher(["STOP", "OP a"], include=True)
    assert [matcher.push(d) for d in ["Hello S", "TOP and more", "x"]] == ["Hello ", "STOP", ""]
    assert matcher.matched == "STOP"
