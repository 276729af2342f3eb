"""Constrained decoding: OpenAI's response_format (json_object, json_schema) as a mask of the tokens each
sequence may take next, with llguidance (the `serve` extra).

    python -c "from gptopt.infer.constrain import grammar_for; print(grammar_for({'type': 'json_object'})[:80])"

Two halves, because `gptopt serve` runs them in two processes:

- Where the request arrives: `grammar_for(response_format)` checks it and returns the grammar as a
  self-contained string (llguidance's grammar text: the schema and its options). A bad schema is a
  ValueError of one line, which the server answers with a 400. The string travels in
  SamplingParams.grammar like any other: nothing compiled has to be pickled.
- Where the model runs: one `Grammars(tokenizer, eot_id, vocab_size)` per model; Generator.open asks it
  for a `Matcher` per constrained sequence, and each sampling step for the (B, V) mask of every row
  (`allowed`); Decoding.add tells the matcher each token sampled.

End of text is allowed exactly when the text so far is a whole document. Ids the tokenizer does not have
(the model's padded rows) are never allowed. llguidance was chosen over xgrammar and outlines-core for
its small install, its quick first mask of a new schema, and because it refuses schema keywords it cannot
enforce instead of letting output through that breaks them (the comparison:
benchmarks/2026-12-05-constrained-decoding.md).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from gptopt.utils.errors import UserError
from gptopt.utils.extras import require

__all__ = ["Grammars", "Matcher", "grammar_for"]

FEATURE = "response_format (constrained decoding)"
# What the model may write between JSON tokens: ", " and ": ", no newlines. A small model left free
# spends its budget on runs of whitespace, a known failure of free whitespace in constrained JSON.
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's message for keywords it does not implement: 'Unimplemented keys: ["uniqueItems"]'
_UNIMPLEMENTED = re.compile(r"Unimplemented keys?: \[(.*?)\]")
# What to do about a oneOf llguidance cannot prove exclusive. Its own message advises its coerce_one_of option,
# which the API does not expose: enforcing anyOf instead would let through a reply matching two branches.
ONE_OF = ("response_format's schema uses oneOf with branches that one value could match together, which constrained "
          "decoding cannot enforce (exactly one must match): use anyOf if a value may match several branches, or make "
          "the branches exclusive, e.g. objects that each require a property of a \"const\" value of their own")
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def _llguidance() -> Any:
    return require("llguidance", "serve", FEATURE)


def grammar_for(response_format: Any) -> str | None:
    """The grammar of an OpenAI response_format, or None for {"type": "text"} (no constraint).

    json_object: any JSON object. json_schema: a document valid against json_schema.schema. A keyword llguidance
    does not implement (uniqueItems, not, if/then, contains, dependentRequired, ...) is refused, strict or not:
    ignored, it would let through replies that break the schema. ValueError names the problem (the keyword)
    for anything malformed, unsupported or unsatisfiable.
    """
    if not isinstance(response_format, dict):
        raise UserError('response_format must be an object such as {"type": "json_object"}')
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise UserError("response_format.json_schema must be an object with a name and a schema")
        name = spec.get("name")
        if not (isinstance(name, str) and 1 <= len(name) <= 64 and set(name) <= _NAME_CHARS):
            raise UserError("response_format.json_schema.name must be 1 to 64 letters, digits, '_' or '-'")
        schema = spec.get("schema", {})  # optional, as in OpenAI's API: absent, any JSON value
        if not isinstance(schema, dict):
            raise UserError("response_format.json_schema.schema must be a JSON Schema object")
        if not isinstance(spec.get("strict", False), bool | None):
            raise UserError("response_format.json_schema.strict must be true or false")
    else:
        raise UserError(f"response_format.type must be 'text', 'json_object' or 'json_schema', not {kind!r}")
    llg = _llguidance()
    try:
        # The options as overrides: a schema's own "x-guidance" must not loosen what the server decided.
        # Never lenient: a keyword llguidance cannot enforce is refused whether the schema is strict or not, since
        # output that ignores it would break the schema the client asked for.
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides={**COMPACT, "lenient": False})
    except ValueError as e:  # not serialisable as JSON, or not an object
        raise UserError(f"invalid JSON schema in response_format: {_first_line(e)}") from None
    # Compiles the schema, with no tokenizer: type errors, a bad $ref, a bad pattern, unsatisfiable bounds,
    # and unimplemented keywords.
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        unenforced = _UNIMPLEMENTED.search(_first_line(messages[0]))
        if unenforced:
            keywords = unenforced.group(1).replace('"', "")
            raise UserError(f"response_format's schema uses {keywords}, which constrained decoding cannot enforce "
                             "(the reply could break it): drop it from the schema, and check the reply for it yourself")
        if "coerce_one_of" in str(messages[0]):
            raise UserError(ONE_OF)
        raise UserError(f"invalid JSON schema in response_format: {_first_line(messages[0])}")
    return grammar


def _first_line(message: object) -> str:
    """llguidance's message in one line (a 400's message is one line). A regular expression's parse error spans
    several: 'regex parse error:', the pattern, a caret under the fault, then 'error: why'; it becomes one line
    with the pattern, the fault's place and why."""
    lines = [line for line in str(message).rstrip().splitlines() if line.strip()]
    if not lines:
        return "rejected"
    head = lines[0].strip()
    if head.endswith("regex parse error:") and len(lines) > 1:  # the regex crate's, its pattern indented 4
        before = head[:-len("regex parse error:")]
        why = next((line.strip()[len("error:"):].strip() for line in lines if line.strip().startswith("error:")), "")
        carets = next((line for line in lines[2:] if set(line.strip()) == {"^"}), None)
        at = f" at character {len(carets) - len(carets.lstrip()) - 3}" if carets is not None else ""
        pattern = lines[1].removeprefix("    ")
        return f"{before}invalid regular expression {pattern!r}{at}: {why or ' '.join(lines[2:]).strip()}"
    return head


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def fill(self, bitmask_row: torch.Tensor) -> None:
        """Write the tokens allowed next into one contiguous int32 CPU row of ceil(V / 32) words (bit j of
        word i: token 32 i + j). After an error only end of text is allowed, so the sequence ends."""
        assert bitmask_row.dtype == torch.int32 and bitmask_row.is_contiguous() and bitmask_row.device.type == "cpu"
        self._m.unsafe_compute_mask_ptr(bitmask_row.data_ptr(), bitmask_row.numel() * 4)

    def accept(self, token: int) -> bool:
        """Advance past the sampled token; False if the grammar rejects it (the matcher then allows only end
        of text). Only allowed tokens are sampled, so False is a bug upstream, not a user's error."""
        return bool(self._m.consume_token(token))

    def is_complete(self) -> bool:
        """The text so far is a whole document: end of text may come now."""
        return bool(self._m.is_accepting())

    @property
    def error(self) -> str:
        """Why the matcher stopped on an error ("" when it did not)."""
        return self._m.get_error() if self._m.is_error() else ""


class Grammars:
    """The constrained decoding of one model: its tokenizer as llguidance reads it, and the matchers.

    tokenizer: the model's tokenizers.Tokenizer; eot_id: its end-of-text id; vocab_size: the model's
    (padded) vocabulary, the width of the logits. Built where the model runs (it does not pickle), used
    by one thread: its caches are not locked.
    """

    def __init__(self, tokenizer: Tokenizer, eot_id: int, vocab_size: int, *, cache_size: int = 64) -> None:
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        if not 0 <= eot_id < size <= vocab_size:
            raise UserError(f"end-of-text id {eot_id} and a vocabulary of {vocab_size} do not fit a tokenizer of "
                             f"{size} tokens")
        # From the tokenizer's own JSON (llguidance reads it with the same Rust tokenizers library): never
        # taken for a hub name, so this works offline.
        self.tokenizer = _llguidance().LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=eot_id)
        self.eot_id, self.vocab_size = eot_id, vocab_size
        self.words = (vocab_size + 31) // 32
        # One fresh matcher per grammar, copied for each new sequence: building one parses the grammar and
        # builds its lexer, a copy shares them.
        self._fresh: OrderedDict[str, Any] = OrderedDict()
        self._cache_size = cache_size
        self._bitmask = torch.empty(0, self.words, dtype=torch.int32)

    def matcher(self, grammar: str) -> Matcher:
        """A matcher at the start of `grammar` (a grammar_for string)."""
        fresh = self._fresh.get(grammar)
        if fresh is None:
            fresh = _llguidance().LLMatcher(self.tokenizer, grammar, log_level=0)
            if fresh.is_error():
                raise UserError(f"the grammar does not build: {_first_line(fresh.get_error())}")
            self._fresh[grammar] = fresh
            if len(self._fresh) > self._cache_size:
                self._fresh.popitem(last=False)
        else:
            self._fresh.move_to_end(grammar)
        return Matcher(fresh.deep_copy())

    def allowed(self, matchers: Sequence[Matcher | None], vocab_size: int, device: torch.device | str) -> torch.Tensor:
        """(B, vocab_size) bool on `device`: the tokens each row may take next (every one, for a row
        without a matcher)."""
        if vocab_size != self.vocab_size:
            raise UserError(f"logits of {vocab_size} columns, grammars built for {self.vocab_size}")
        B = len(matchers)
        if self._bitmask.shape[0] < B:
            self._bitmask = torch.empty(B, self.words, dtype=torch.int32)
        bits = self._bitmask[:B]
        for i, m in enumerate(matchers):
            if m is None:
                bits[i].fill_(-1)
            else:
                m.fill(bits[i])
        if torch.device(device).type == "cpu":
            return unpack_numpy(bits, vocab_size)
        return unpack_torch(bits.to(device), vocab_size)  # the packed bits cross, an eighth of a bool mask


def unpack_numpy(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, W) int32 CPU bitmask -> (B, vocab_size) bool, in one vectorised pass (torch has no bit
    unpacking; shifting and masking passes several times over a 32x larger tensor). The words are
    little-endian, so bit j of word i lands at 32 i + j with bitorder="little"."""
    unpacked = np.unpackbits(bits.numpy().view(np.uint8), axis=1, count=vocab_size, bitorder="little")
    return torch.from_numpy(unpacked).view(torch.bool)


def unpack_torch(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, W) int32 bitmask on any device -> (B, vocab_size) bool there."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits.unsqueeze(-1) >> shifts) & 1).view(bits.shape[0], -1)[:, :vocab_size].bool()
