"""Appendix A1: the SSE-stream lab checker (notebook 23's `stream_events`) passes the course's server and names the
right check for realistic broken ones."""
from lab_helpers import failed_names

from nanovllm_edu.labs.sse_checks import check_sse_stream
from nanovllm_edu.serve.app import outputs_of, stream_events
from nanovllm_edu.serve.protocol import sse

FRAMING = "each event is 'data: <json>' and a blank line"
DONE = "the stream ends with 'data: [DONE]'"
INDICES = "each choice carries its own index (n > 1)"
TEXTS = "each choice's texts add up to its completion"
HOLDBACK = "no text is sent while it may still begin a stop"


def test_our_server_passes():
    report = check_sse_stream(stream_events)
    assert report.passed is True, str(report)
    assert [c.name for c in report.checks] == [FRAMING, DONE, INDICES, TEXTS, HOLDBACK]
    assert report.stage == "SSE stream (23)"


# --- a learner's short version, and deliberately broken ones --------------------------------------------

def learner_events(index=lambda request, p, out: p * request.n + out.index, text=lambda out, tokenizer: out.text,
                   done: bool = True, event=sse):
    """A completions stream written from scratch (one chunk per output that shows something), with one of its
    parts swapped for a broken one."""
    async def events(request, streams, tokenizer):
        async for p, out in outputs_of(streams):
            shown = text(out, tokenizer)
            if shown or out.finish_reason:
                choice = {"index": index(request, p, out), "text": shown, "logprobs": None,
                          "finish_reason": out.finish_reason}
                yield event(request.envelope("text_completion", [choice]))
        if done:
            yield event("[DONE]")
    return events


def test_a_short_learner_version_passes():
    assert check_sse_stream(learner_events()).passed


def test_every_chunk_index_of_its_prompt_fails_the_indices():
    """Numbers each choice by its prompt, as if n were 1: with one prompt, every chunk says index 0."""
    report = check_sse_stream(learner_events(index=lambda request, p, out: p))
    assert INDICES in failed_names(report) and DONE not in failed_names(report), str(report)
    assert "p * n + out.index" in str(report)  # the hint


def test_decoding_the_tokens_sends_held_back_text():
    """Decodes each output's new tokens itself instead of sending `out.text`: the start of the stop goes out."""
    report = check_sse_stream(learner_events(text=lambda out, tokenizer: tokenizer.decode(out.token_ids)))
    assert HOLDBACK in failed_names(report) and INDICES not in failed_names(report), str(report)
    assert "'Hi S'" in str(report)  # what went out


def test_forgetting_done_fails_the_end():
    report = check_sse_stream(learner_events(done=False))
    assert failed_names(report) == {DONE}, str(report)


def test_one_newline_fails_the_framing():
    """Ends each event with one newline: a client reading events never sees one end."""
    report = check_sse_stream(learner_events(event=lambda data: sse(data)[:-1]))
    assert FRAMING in failed_names(report), str(report)
