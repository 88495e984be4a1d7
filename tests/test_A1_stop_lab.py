"""Appendix A1: the stop-strings lab checker (notebook 10's `StopStrings`) passes the course's finder and names the
right check for realistic broken ones."""
from lab_helpers import failed_names

from nanovllm_edu.engine.completion import IncrementalDetokenizer, StopStrings
from nanovllm_edu.labs.stop_checks import TOK, check_stop_strings

ONE = "a stop string of one token is found"
SPANS = "a stop string across three tokens is found"
SPLIT = "a stop beside a split UTF-8 character"
EARLIEST = "overlapping stops: the earliest match wins"
FALSE_START = "text that only began a stop is kept"


def test_our_finder_passes():
    report = check_stop_strings(StopStrings)
    assert report.passed is True, str(report)
    assert [c.name for c in report.checks] == [ONE, SPANS, SPLIT, EARLIEST, FALSE_START]
    assert report.stage == "stop strings (10)"


def test_the_split_character_is_two_tokens():
    detokenizer = IncrementalDetokenizer(TOK)
    assert [detokenizer.add(t) for t in TOK.ids(b"caf", b"\xc3", b"\xa9")] == ["caf", "", "é"]


# --- deliberately broken finders ---------------------------------------------------------------------

class NewestTokenOnly(StopStrings):
    """Looks for the stops in the newest token's text only: right whenever a stop arrives in one token."""

    def add(self, token):
        new = self.detokenizer.add(token)
        found = [(index, stop) for stop in self.stops if (index := new.find(stop)) >= 0]
        if not found:
            self.text += new
            return None
        index, stop = min(found)
        self.text += new[:index]
        return stop


class PerTokenDetokenizer:
    """Decodes each token on its own: right for whole characters, U+FFFD for the bytes of a split one."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def add(self, token):
        return self.tokenizer.decode([token])


class PerTokenDecode(StopStrings):
    """The course's finder over a detokenizer that decodes each token on its own."""

    def __init__(self, tokenizer, stops):
        super().__init__(tokenizer, stops)
        self.detokenizer = PerTokenDetokenizer(tokenizer)


class FirstInList(StopStrings):
    """Returns the first stop of the list that is found, wherever it starts."""

    def add(self, token):
        new = self.detokenizer.add(token)
        start = max(0, len(self.text) - max(map(len, self.stops)) + 1)
        self.text += new
        for stop in self.stops:
            if new and (index := self.text.find(stop, start)) >= 0:
                self.text = self.text[:index]
                return stop
        return None


class CutsAtPrefix(StopStrings):
    """Holds back in the text itself: a text that ends with the start of a stop is cut there, and the cut part
    is never put back when the next token rules the stop out."""

    def add(self, token):
        stop = super().add(token)
        if stop is None:
            for s in self.stops:
                for k in range(len(s) - 1, 0, -1):
                    if self.text.endswith(s[:k]):
                        self.text = self.text[:-k]
                        self.detokenizer.text = self.text
                        return None
        return stop


def test_newest_token_only_misses_the_spanning_stop():
    report = check_stop_strings(NewestTokenOnly)
    assert SPANS in failed_names(report) and ONE not in failed_names(report), str(report)
    assert "not only the newest token's text" in str(report)  # the hint


def test_per_token_decoding_breaks_the_split_character():
    report = check_stop_strings(PerTokenDecode)
    assert failed_names(report) == {SPLIT}, str(report)
    assert "\ufffd" in str(report)


def test_first_in_list_fails_overlapping_stops():
    report = check_stop_strings(FirstInList)
    assert failed_names(report) == {EARLIEST}, str(report)


def test_cutting_a_possible_stop_loses_text():
    report = check_stop_strings(CutsAtPrefix)
    assert FALSE_START in failed_names(report) and ONE not in failed_names(report), str(report)
