"""Constrained decoding (constrain.py): OpenAI's response_format as a mask of the tokens allowed next.

    pytest -q tests/test_constrain.py
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

pytest.importorskip("llguidance")

from gptopt.data.tokenizer import eot_id  # noqa: E402
from gptopt.infer.constrain import Grammars, grammar_for, unpack_numpy, unpack_torch  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "scores"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def grammars(debug_tokenizer: Tokenizer) -> Grammars:
    eot = eot_id(debug_tokenizer)
    assert eot is not None
    return Grammars(debug_tokenizer, eot, debug_tokenizer.get_vocab_size() + 64)  # the model's padded rows too


def sample(grammars: Grammars, tok: Tokenizer, grammar: str, seed: int,
           check: Any = None, cap: int = 400) -> tuple[str, bool]:
    """Seeded random logits under the grammar (closing characters favoured, to keep it short): the text,
    and whether it ended with end of text."""
    gen = torch.Generator().manual_seed(seed)
    V = grammars.vocab_size
    bias = torch.zeros(V)
    for i in range(tok.get_vocab_size()):
        bias[i] = 3.0 * sum(tok.decode([i]).count(c) for c in '"}],')
    m, ids = grammars.matcher(grammar), []
    for _ in range(cap):
        allowed = grammars.allowed([m], V, "cpu")[0]
        if check is not None:
            check(tok.decode(ids), allowed)
        logits = (torch.randn(V, generator=gen) * 2 + bias).masked_fill(~allowed, float("-inf"))
        t = int(torch.multinomial(logits.softmax(0), 1, generator=gen))
        assert m.accept(t)
        if t == grammars.eot_id:
            return tok.decode(ids), True
        ids.append(t)
    return tok.decode(ids), False


def test_a_json_object_ends_exactly_when_the_text_is_a_whole_object(grammars: Grammars,
                                                                      debug_tokenizer: Tokenizer) -> None:
    size = debug_tokenizer.get_vocab_size()

    def check(text: str, allowed: torch.Tensor) -> None:
        try:
            whole = isinstance(json.loads(text), dict)
        except ValueError:
            whole = False
        assert bool(allowed[grammars.eot_id]) == whole, text
        assert not allowed[size:].any(), "a padded row was allowed"

    for seed in range(12):
        text, ended = sample(grammars, debug_tokenizer, grammar_for({"type": "json_object"}) or "", seed, check)
        assert ended and isinstance(json.loads(text), dict)


def test_a_json_schema_reply_validates_against_it(grammars: Grammars, debug_tokenizer: Tokenizer) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    for seed in range(12):
        text, ended = sample(grammars, debug_tokenizer, grammar_for(SCHEMA_FORMAT) or "", seed)
        assert ended
        jsonschema.validate(json.loads(text), SCHEMA)


def test_after_a_whole_document_only_end_of_text_is_allowed(grammars: Grammars, debug_tokenizer: Tokenizer) -> None:
    m = grammars.matcher(grammar_for(SCHEMA_FORMAT) or "")
    for t in debug_tokenizer.encode('{"name": "Ann", "age": 3, "color": "red", "scores": [1.5, 2]}').ids:
        assert m.accept(t)
    assert m.is_complete()
    assert grammars.allowed([m], grammars.vocab_size, "cpu")[0].nonzero().flatten().tolist() == [grammars.eot_id]


def test_rows_without_a_matcher_allow_every_token_and_matchers_are_independent(grammars: Grammars,
                                                                               debug_tokenizer: Tokenizer) -> None:
    g = grammar_for({"type": "json_object"}) or ""
    a, b = grammars.matcher(g), grammars.matcher(g)
    for t in debug_tokenizer.encode('{"k": 1}').ids:
        assert a.accept(t)
    allowed = grammars.allowed([None, a, b], grammars.vocab_size, "cpu")
    assert allowed[0].all()
    assert allowed[1].nonzero().flatten().tolist() == [grammars.eot_id]
    assert not allowed[2, grammars.eot_id] and allowed[2].any()  # b has not begun


def test_a_rejected_token_is_reported_and_leaves_only_end_of_text(grammars: Grammars,
                                                                  debug_tokenizer: Tokenizer) -> None:
    m = grammars.matcher(grammar_for({"type": "json_object"}) or "")
    assert not m.accept(debug_tokenizer.encode("hello").ids[0])
    assert m.error
    assert grammars.allowed([m], grammars.vocab_size, "cpu")[0].nonzero().flatten().tolist() == [grammars.eot_id]


def test_text_is_no_constraint() -> None:
    assert grammar_for({"type": "text"}) is None


@pytest.mark.parametrize(("response_format", "words"), [
    ("json", "must be an object"),
    ({"type": "yaml"}, "response_format.type"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, "JSON Schema object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}, "strict"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}, "foo"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/no"}}}, "/$defs/no"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}},
     "regular expression '((' at character 2: unclosed group"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5,
                                                                     "maximum": 1}}}, "minimum"),
    ({"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {"not": {"type": "string"}}}},
     "not"),
])
def test_a_bad_response_format_is_one_line_naming_the_problem(response_format: Any, words: str) -> None:
    with pytest.raises(ValueError) as e:
        grammar_for(response_format)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(("pattern", "words"), [
    ("[a-", "'[a-' at character 1: unclosed character class"),
    ("a{2,1}", "'a{2,1}' at character 2: invalid repetition count range"),
])
def test_an_invalid_pattern_is_refused_with_the_whole_parse_error_in_one_line(pattern: str, words: str) -> None:
    for schema in ({"type": "string", "pattern": pattern}, {"type": "object", "patternProperties": {pattern: {}}}):
        with pytest.raises(ValueError) as e:
            grammar_for({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        assert f"invalid regular expression {words}" in str(e.value) and "\n" not in str(e.value)


def test_a_one_of_it_cannot_prove_exclusive_says_what_the_user_can_do_not_an_option_the_api_lacks() -> None:
    """oneOf is enforced where llguidance proves its branches exclusive (objects told apart by a required const), and
    otherwise refused with what a client can change: anyOf, or exclusive branches. Its own advice, an option named
    coerce_one_of, is not something a request can set."""
    def branch(kind: str) -> dict:
        return {"type": "object", "properties": {"kind": {"const": kind}}, "required": ["kind"]}

    assert grammar_for({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "oneOf": [branch("a"), branch("b")]}}})
    with pytest.raises(ValueError) as e:
        grammar_for({"type": "json_schema", "json_schema": {"name": "x", "schema": {"oneOf": [{"type": "integer"},
                                                                                             {"minimum": 0}]}}})
    message = str(e.value)
    assert "coerce_one_of" not in message and "oneOf" in message and "anyOf" in message and "exclusive" in message
    assert grammar_for({"type": "json_schema", "json_schema": {"name": "x", "schema": {"anyOf": [{"type": "integer"},
                                                                                                 {"minimum": 0}]}}})


@pytest.mark.parametrize(("keyword", "schema"), [
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
    ("not", {"type": "object", "properties": {"a": {"type": "string"}}, "not": {"required": ["b"]}}),
    ("if", {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}),
    ("contains", {"type": "array", "contains": {"type": "integer"}}),
    ("dependentRequired", {"type": "object", "dependentRequired": {"a": ["b"]}}),
])
def test_a_keyword_it_cannot_enforce_is_refused_strict_or_not_naming_it(keyword: str, schema: dict) -> None:
    for strict in (False, True):
        with pytest.raises(ValueError, match=f"uses {keyword}.*cannot enforce"):
            grammar_for({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}})


def test_a_multiple_of_without_bounds_is_enforced_to_the_end_of_the_document(debug_tokenizer: Any) -> None:
    """Random walks over the tokens the grammar allows: every one that reaches end of text is a multiple of 7."""
    eot = eot_id(debug_tokenizer)
    vocab = debug_tokenizer.get_vocab_size()
    grammars = Grammars(debug_tokenizer, eot, vocab)
    grammar = grammar_for({"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "integer", "multipleOf": 7}}})
    rng = random.Random(0)
    ended = []
    for _ in range(30):
        m, ids = grammars.matcher(grammar), []
        for _ in range(40):
            allowed = grammars.allowed([m], vocab, "cpu")[0].nonzero().flatten().tolist()
            token = eot if eot in allowed and rng.random() < 0.3 else rng.choice(allowed)
            assert m.accept(token)
            if token == eot:
                ended.append(json.loads(debug_tokenizer.decode(ids)))
                break
            ids.append(token)
    assert len(ended) >= 20 and all(v % 7 == 0 for v in ended)


def test_both_unpackings_put_bit_j_of_word_i_at_token_32i_plus_j() -> None:
    bits = torch.randint(-(2**31), 2**31 - 1, (3, 5), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    want = torch.tensor([[(int(bits[b, t // 32]) >> (t % 32)) & 1 for t in range(150)] for b in range(3)]).bool()
    assert torch.equal(unpack_numpy(bits, 150), want)
    assert torch.equal(unpack_torch(bits, 150), want)
