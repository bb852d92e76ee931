"""Tokenizer, chat templates (transformers semantics) and UTF-8-safe incremental detokenization."""

from __future__ import annotations

import pytest

from common.chat_template import TemplateError, render_chat
from common.detokenizer import ByteDetokenizer, Detokenizer, IncrementalDetokenizer, detokenizer
from common.tokenizer import Tokenizer

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]

# Hand-written templates exercising trim_blocks/lstrip_blocks, loop controls, tojson,
# raise_exception and special-token variables, with the output transformers produces.
CASES = [
    (
        "{% for m in messages %}\n  {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
        "  system: Be brief.\n  user: Hi\n  assistant: Hello!\n  user: Bye\n",
    ),
    (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
        "[{{ m['role'] }}]{% endfor %}{% if add_generation_prompt %}<gen>{% endif %}",
        "<s>[user][assistant][user]<gen>",
    ),
    ("{{ messages[1] | tojson }}", '{"role": "user", "content": "Hi"}'),
    (
        "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}{{ eos_token }}",
        "Be brief.HiHello!Bye</s>",
    ),
]


@pytest.mark.parametrize(("template", "expected"), CASES)
def test_hand_written_templates(template, expected):
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    ours = render_chat(template, MESSAGES, special)
    assert ours == expected
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:
        return
    theirs, _ = render_jinja_template(
        conversations=[MESSAGES], chat_template=template, add_generation_prompt=True, **special
    )
    assert ours == theirs[0]


def test_raise_exception_surfaces_as_template_error():
    tpl = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
    with pytest.raises(TemplateError, match="first message must be from the user"):
        render_chat(tpl, MESSAGES, {})


def test_chatml_template_and_tokenizer(tiny_model_dir):
    tok = Tokenizer(tiny_model_dir)
    text = tok.render_chat(MESSAGES[1:2])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_chat(MESSAGES[1:2])
    assert ids[0] == tok.hf.token_to_id("<|im_start|>")
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.eos_token_ids == {2}


@pytest.mark.parametrize("text", ["naïve café 日本語のテキスト 🚀🔥 done", "Héllo wörld — émoji 🔥🔥🔥"])
def test_incremental_detokenizer_never_splits_utf8(tiny_model_dir, text):
    tok = Tokenizer(tiny_model_dir)
    ids = tok.encode(text)
    # Byte-level BPE on a tiny vocab spells multi-byte characters with several tokens.
    assert len(ids) > len(text.encode()) // 4
    detok = IncrementalDetokenizer(tok, [])
    pieces = []
    for t in ids:
        delta, _ = detok.push(t)
        assert "\ufffd" not in delta
        pieces.append(delta)
    pieces.append(detok.flush())
    assert "".join(pieces) == text


def test_stop_string_split_across_tokens_is_held_back(tiny_model_dir):
    tok = Tokenizer(tiny_model_dir)
    text = "The quick brown fox jumps over the lazy dog."
    detok = IncrementalDetokenizer(tok, [], stop=["lazy dog"])
    emitted = ""
    for t in tok.encode(text):
        delta, stopped = detok.push(t)
        emitted += delta
        assert "lazy" not in emitted
        if stopped:
            break
    assert stopped and emitted == "The quick brown fox jumps over the "


def _run(detok, ids: list[int]) -> tuple[list[str], bool]:
    out, stopped = [], False
    for t in ids:
        delta, stopped = detok.push(t)
        out.append(delta)
        if stopped:
            break
    if not stopped:
        out.append(detok.flush())
    return out, stopped


class _GeneralPush(ByteDetokenizer):
    push = Detokenizer.push  # the reference path (stop-string handling) even without stop strings


def _byte_table_equals_the_reference(tok: Tokenizer, seed: int) -> None:
    import random

    rng = random.Random(seed)
    assert tok.byte_pieces() is not None, "a byte-level BPE tokenizer has a byte table"
    specials = sorted(tok.hf.get_added_tokens_decoder())
    texts = ["naïve café 日本語のテキスト 🚀🔥 done", "The quick brown fox jumps over the lazy dog.",
             "def main():\n    return 42\n", "Héllo wörld — émoji 🔥🔥🔥 über"]
    cases: list[tuple[list[int], list[str]]] = []
    for text in texts:
        cases.append((tok.encode(text, add_special_tokens=False), []))
        cases.append((tok.encode(text, add_special_tokens=False), ["lazy", "🔥", "\n "]))
    for _ in range(40):  # random ids: torn characters, invalid byte runs, special tokens in between
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        ids += [rng.choice(specials)] if specials and rng.random() < 0.5 else []
        cases.append((ids, [] if rng.random() < 0.5 else [tok.decode(ids[2:4]) or "x"]))
    # (A prompt ending in a torn character is where the two differ: the reference lets the first output
    # bytes complete it and drops them; the byte table decodes the output on its own, as decode(output).)
    prompt = tok.encode("Question: what follows? Answer:", add_special_tokens=False)
    for ids, stop in cases:
        ref, ref_stopped = _run(IncrementalDetokenizer(tok, prompt, stop), ids)
        fast_detok = detokenizer(tok, prompt, stop)
        assert isinstance(fast_detok, ByteDetokenizer)
        fast, fast_stopped = _run(fast_detok, ids)
        assert "".join(fast) == "".join(ref), (ids, stop)
        assert fast_stopped == ref_stopped
        # Deltas may come earlier (a whole character is not held behind a torn one), never later.
        for n in range(len(ref)):
            assert len("".join(fast[: n + 1])) >= len("".join(ref[: n + 1])), (ids, stop, n)
        if not stop:
            assert "".join(fast) == tok.decode(ids), "no stop string: the whole decode"
            # the byte table's one-call push without stop strings against the general push, delta by delta
            assert _run(_GeneralPush(tok.byte_pieces() or [], stop), ids) == (fast, fast_stopped), ids


def test_byte_table_detokenizer_equals_the_reference(tiny_model_dir):
    _byte_table_equals_the_reference(Tokenizer(tiny_model_dir), seed=1)


@pytest.mark.slow
def test_byte_table_detokenizer_equals_the_reference_on_smollm2(smollm2_dir):
    _byte_table_equals_the_reference(Tokenizer(smollm2_dir), seed=2)


@pytest.mark.slow
def test_smollm2_template_equals_transformers(smollm2_dir):
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer(smollm2_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))
    for msgs in (MESSAGES, MESSAGES[1:], [{"role": "user", "content": "Écris 3 mots 🚀"}]):
        for agp in (True, False):
            expected = theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=agp)
            assert ours.render_chat(msgs, add_generation_prompt=agp) == expected
            expected_ids = theirs.apply_chat_template(msgs, tokenize=True, add_generation_prompt=agp)
            if not isinstance(expected_ids, list):
                expected_ids = expected_ids["input_ids"]
            assert ours.encode_chat(msgs, add_generation_prompt=agp) == expected_ids
