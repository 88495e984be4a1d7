"""Notebook 11: the stepper's state, the block map, the prefix lookup and the widgets built on them."""
import pytest

from nanovllm_edu import LLM, SamplingParams
from nanovllm_edu.assets import tiny_model_path
from nanovllm_edu.course.blocks import block_map, format_block_map, format_prefix_lookup, prefix_lookup
from nanovllm_edu.course.figures import SMALL_CACHE_ARGS, small_cache_requests, trace_tiny_cpu
from nanovllm_edu.course.stepper import EngineStepper
from nanovllm_edu.course.trace import summarize
from nanovllm_edu.engine.observer import StepObserver

widgets = pytest.importorskip("ipywidgets")  # the notebooks extra (a GPU machine may lack it)
pytest.importorskip("IPython")
from nanovllm_edu.course.views import block_map_html, block_map_widget, prefix_explorer, stepper_widget

PREAMBLE = ("Return the value of the attribute. Raise ValueError if the argument is not a string. "
            "This module provides a class for parsing the arguments of the command line. ")


def new_stepper() -> EngineStepper:
    prompts, params = small_cache_requests()
    return EngineStepper(LLM(tiny_model_path(), **SMALL_CACHE_ARGS), prompts, params)


def check_block_map(llm):
    infos = block_map(llm)
    bm = llm.block_manager
    assert sum(b.state == "used" for b in infos) == bm.num_blocks - bm.num_free_blocks
    for b in infos:
        assert len(b.owners) == b.ref_count  # every reference is a running sequence's block table entry
        assert (b.state == "cached") == (b.ref_count == 0 and b.hash != -1)
    for seq in llm.scheduler.running:
        assert all(seq.seq_id in infos[i].owners for i in seq.block_table)


def test_stepper_state_after_steps():
    stepper = new_stepper()
    st = stepper.state()
    assert st["step"] == 0 and st["waiting"] == [f"r{i}" for i in range(8)] and st["last_step"] is None
    assert [r.kind for r in (stepper.step(), stepper.step(), stepper.step())] == ["prefill"] * 3
    st = stepper.state()
    assert st["step"] == 3 and st["running"] == ["r0", "r1", "r2", "r3", "r4"]
    assert st["waiting"] == ["r5", "r6", "r7"] and st["used_blocks"] == st["total_blocks"] == 12
    assert st["last_step"] == {"kind": "prefill", "batch": {"r4": 1}, "tokens": 1, "preempted": [], "finished": []}
    assert st["token_budget"] == 64 and st["requests"]["r0"]["generated"] == 1
    assert stepper.describe().splitlines()[1] == "  last step: prefill of r4+1 = 1 tokens (budget 64)"
    check_block_map(stepper.llm)


def test_stepper_runs_the_same_schedule_as_generate():
    stepper = new_stepper()
    seen = []
    stepper.listeners.append(lambda s: seen.append(s.state()["step"]))
    while not stepper.done:
        stepper.step()
        check_block_map(stepper.llm)
    assert stepper.step() is None and seen == list(range(1, len(stepper.records) + 1))
    records, _ = trace_tiny_cpu()
    assert summarize(stepper.records) == summarize(records)
    assert stepper.state()["finished"] == [f"r{i}" for i in range(8)]
    assert stepper.state()["preemptions"] == summarize(records)["preemptions"]
    assert all(b.state != "used" for b in block_map(stepper.llm))
    assert type(stepper.llm.observer) is StepObserver  # the stepper traces only while its own steps run


def test_stepper_validates_before_queueing():
    llm = LLM(tiny_model_path(), **SMALL_CACHE_ARGS)
    with pytest.raises(ValueError, match="KV-cache blocks"):
        EngineStepper(llm, ["Return the", [1] * 100], SamplingParams(max_tokens=200))
    assert llm.is_finished()


@pytest.fixture(scope="module")
def cached():
    llm = LLM(tiny_model_path(), num_kvcache_blocks=48, kvcache_block_size=16)
    llm.generate([PREAMBLE + "Create a new"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    return llm


def test_prefix_lookup_matches_the_block_manager(cached):
    prompt = PREAMBLE + "Write a"
    lookup = prefix_lookup(cached, prompt)
    assert lookup[-1].status == "tail" and {b.status for b in lookup} <= {"cached", "shared", "miss", "tail"}
    hits = [b for b in lookup if b.status in ("cached", "shared")]
    assert hits and [b.index for b in hits] == list(range(len(hits)))  # hits form a prefix
    assert cached.is_finished() and cached.block_manager.num_free_blocks == 48  # the lookup allocated nothing
    # what the engine then really serves
    out = cached.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert out["num_cached_tokens"] == 16 * len(hits)
    # while a sequence holds them, the blocks are "shared"
    seq = cached.make_sequence(prompt, SamplingParams(temperature=0, max_tokens=4))
    cached.scheduler.add(seq)
    cached.step()
    assert [b.status for b in prefix_lookup(cached, prompt)][:len(hits)] == ["shared"] * len(hits)
    cached.abort_all()
    text = format_prefix_lookup(lookup, cached.tokenizer)
    assert text.endswith(f"{len(hits)} of {len(lookup)} blocks served from the cache")
    changed = prefix_lookup(cached, "Xx" + prompt)
    assert all(b.status in ("miss", "tail") for b in changed)  # chained hashes: a new start misses all


def test_prefix_lookup_needs_prefix_caching():
    llm = LLM(tiny_model_path(), num_kvcache_blocks=8, kvcache_block_size=16, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="prefix caching"):
        prefix_lookup(llm, "Return the")
    assert "prefix caching" in prefix_explorer(llm, "Return the").children[2].value


def test_widgets_render_and_drive_the_stepper(cached):
    stepper = new_stepper()
    box = stepper_widget(stepper)
    assert "nve-stepper" in box._dom_classes
    step_button, ten_button, _ = box.children[0].children
    view = box.children[1]
    step_button.click()
    assert stepper.state()["step"] == 1 and "after step 1:" in view.value
    ten_button.click()
    assert stepper.state()["step"] == 11 and "after step 11:" in view.value
    stepper.step()  # a step from code redraws the widget too
    assert "after step 12:" in view.value and "#11" in view.value
    explorer = prefix_explorer(cached, PREAMBLE + "Write a")
    assert "nve-prefix-explorer" in explorer._dom_classes and "blocks from the cache" in explorer.children[2].value
    assert "nve-block-map" in block_map_widget(cached)._dom_classes
    assert block_map_html(cached).count("<div style=") == 48 + 1
    assert format_block_map(block_map(cached), skip_free=True).count("\n") < 48


def test_stream_view_returns_generate_texts(cached):
    from nanovllm_edu.course.views import stream_view
    greedy = SamplingParams(temperature=0, max_tokens=6)
    ids = cached.tokenizer.encode("Return the")
    assert stream_view(cached, ids, greedy) == [cached.generate(ids, greedy, use_tqdm=False)[0]["text"]]
