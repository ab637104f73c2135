"""passkey benchmark logic: prompt construction, scoring, budget handling (no model runs); and
--shared-prefill answers exactly as separate runs do (SmolLM2, a short prompt)."""
import pytest

from minikv.bench.passkey import INSTRUCTION, build_prompt, draw_key, needle, score, with_budget


class CharTokenizer:
    """One token per character: enough to check lengths and where the key lands."""

    def encode(self, text, add_bos=None):
        return [ord(c) for c in (("\x02" if add_bos is not False else "") + text)]

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i != 2)


@pytest.mark.parametrize("filler", ["repeat", "pydoc"])
@pytest.mark.parametrize("length", [400, 1001])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_prompt_has_the_length_and_the_key_at_its_depth(length, depth, filler):
    tok = CharTokenizer()
    key = draw_key(3)
    ids = build_prompt(tok, length, depth, key, filler)
    assert len(ids) == length
    text = tok.decode(ids)
    assert text.count(key) == 2 and text.endswith("The pass key is")
    start = text.index(needle(key))
    fill_start = text.index(INSTRUCTION) + len(INSTRUCTION)
    fill_end = text.rindex("\nWhat is")
    fill = fill_end - fill_start - len(needle(key))
    assert abs((start - fill_start) - depth * fill) <= 1


def test_keys_are_five_digits_and_differ_by_seed():
    keys = {draw_key(s) for s in range(20)}
    assert len(keys) > 15 and all(len(k) == 5 and k.isdigit() for k in keys)


@pytest.mark.parametrize("answer, found", [
    (" 12345.", True), (" 12345. Remember", True), ("12345", True),
    (" 123456", False), (" 54321 12345", False), (" 1234", False), (" the key", False),
])
def test_score(answer, found):
    assert score(answer, "12345") is found


def test_too_short_and_bad_depth():
    with pytest.raises(ValueError, match="shorter"):
        build_prompt(CharTokenizer(), 50, 0.5, "12345")
    with pytest.raises(ValueError, match="depth"):
        build_prompt(CharTokenizer(), 500, 1.5, "12345")


def test_budget_goes_only_where_it_is_a_parameter():
    assert with_budget("streaming:R=1", 256) == "streaming:R=1,budget=256"
    assert with_budget("streaming", 256) == "streaming:budget=256"
    assert with_budget("streaming:budget=100", 256) == "streaming:budget=100"
    assert with_budget("full", 256) == "full"
    assert with_budget("streaming:R=1", None) == "streaming:R=1"


def test_pydoc_filler_is_natural_text_and_unknown_fillers_are_refused():
    tok = CharTokenizer()
    text = tok.decode(build_prompt(tok, 3000, 0.5, draw_key(1), "pydoc"))
    assert "The grass is green" not in text and len(set(text.split())) > 200  # not a repeated sentence
    with pytest.raises(ValueError, match="filler must be one of"):
        build_prompt(tok, 400, 0.5, draw_key(1), "lorem")


def test_shared_prefill_answers_as_separate_runs(smollm2):
    from minikv.bench.passkey import shared_trials
    from minikv.generate import generate

    # streaming at a window below the prompt prunes inside the prefill: its output differs from
    # full KV's at the first layer, so it leaves the shared forward and is prefilled on its own
    model, tok = smollm2
    ids = build_prompt(tok, 300, 0.4, draw_key(1))
    specs = ["full", "icecache:budget=96", "streaming:sink=4,window=60,R=1,slack=0,max_drop=0", "freekv:budget=128"]
    shared = shared_trials(model, tok, specs, ids, 4)
    for spec in specs:
        alone = generate(model, tok, ids, policy=spec, max_new_tokens=4, stop_at_eos=False)
        assert shared[spec]["text"] == alone.text, spec
        assert shared[spec]["stats"]["device_tokens_peak"] == alone.stats["device_tokens_peak"]
