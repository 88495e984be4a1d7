"""`python -m nanovllm_edu`: a loading line before the model loads, a warm-up, warm throughput with what is
counted named; a bad value is one line and exit code 2, not a traceback."""
import re

import pytest

from nanovllm_edu.__main__ import main


def test_main_says_loading_then_reports_warm_throughput(capsys):
    main(["--max-tokens", "4", "--device", "cpu"])
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "loading tiny-qwen3 (device cpu) ..."
    # the CPU cache is sized for the model (4x its 13.6 MB of weights, at least 64 MiB), and said
    assert out.splitlines()[1] == "KV cache: 64 blocks of 256 tokens (64 MiB)"
    assert re.search(r"8 prompts \(\d+ prompt tokens, not counted below\), after one warm-up call:\n"
                     r"\d+ completion tokens in [\d.]+ s: \d+ tok/s on cpu \(tiny-qwen3\)", out), out


@pytest.mark.parametrize("argv, words", [
    (["--max-tokens", "0"], "max_tokens must be an integer >= 1, got 0"),
    (["--temperature", "-1"], "temperature must be"),
    (["--model", "no/such/folder"], "model folder 'no/such/folder' does not exist"),
])
def test_bad_values_are_one_line_with_exit_code_2(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--device", "cpu"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("python -m nanovllm_edu: error: ") and words in err[0], err

