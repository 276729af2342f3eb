"""What guards the server: the API key, CORS, and the blocklist of prompts and output (its rules, its
holdback of text that could still match, its time limit).

    pytest -q tests/test_serve_guard.py
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from serve_helpers import (  # noqa: E402
    HOSTILE_BLOCKLIST,
    PROMPT,
    assert_openai_error,
    byte_token,
    completion,
    end_of_text_after,
    running,
    sse,
)

from gptopt.data.tokenizer import eot_id  # noqa: E402
from gptopt.serve.blocklist import Blocklist, CheckTimeout, TextFilter, load_blocklist  # noqa: E402

# server, url: conftest.py's (a server of the debug model, plain chat template), one per module


# -- auth, CORS ------------------------------------------------------------------------------------


def test_api_key_required_when_set(debug_tokenizer: Any) -> None:
    with running(debug_tokenizer, api_key="s3cret") as (url, _):
        assert_openai_error(completion(url, max_tokens=2), 401, "invalid_api_key")
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       headers={"Authorization": "Bearer wrong"})
        assert_openai_error(r, 401)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200  # probes need no key
        assert httpx.get(f"{url}/ready").status_code == 200


@pytest.mark.parametrize("path", ["/metrics", "/docs", "/redoc", "/openapi.json", "/v1/models", "/nowhere"])
def test_api_key_guards_every_route_but_the_probes(debug_tokenizer: Any, path: str) -> None:
    with running(debug_tokenizer, api_key="s3cret") as (url, _):
        assert_openai_error(httpx.get(f"{url}{path}"), 401, "invalid_api_key")
        assert_openai_error(httpx.get(f"{url}{path}", headers={"Authorization": "Bearer wrong"}), 401)
        r = httpx.get(f"{url}{path}", headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == (404 if path == "/nowhere" else 200)


def test_api_key_from_the_environment(debug_tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPTOPT_API_KEY", "from-env")
    with running(debug_tokenizer) as (url, _):
        assert_openai_error(httpx.post(f"{url}/generate", json={"prompt": "x"}), 401)
        r = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer from-env"})
        assert r.status_code == 200


def test_cors_only_for_the_given_origin(url: str, debug_tokenizer: Any) -> None:
    assert "access-control-allow-origin" not in httpx.get(f"{url}/health", headers={"Origin": "http://a.b"}).headers
    with running(debug_tokenizer, cors_origin="http://a.b") as (cors_url, _):
        r = httpx.options(f"{cors_url}/v1/completions", headers={
            "Origin": "http://a.b", "Access-Control-Request-Method": "POST"})
        assert r.headers["access-control-allow-origin"] == "http://a.b"


# -- blocklist -------------------------------------------------------------------------------------


def test_blocklist_refuses_prompts_and_cuts_output(url: str, debug_tokenizer: Any, tmp_path: Path) -> None:
    sampled = {"max_tokens": 20, "temperature": 1.0, "seed": 1}
    full = completion(url, **sampled).json()["choices"][0]["text"]
    piece = next((full[i : i + 2] for i in range(4, len(full) - 1)
                  if full[i : i + 2].isprintable() and full[i : i + 2].strip() == full[i : i + 2]
                  and full[i] != "#" and full[i : i + 2].lower() not in PROMPT.lower()), None)
    assert piece is not None, full
    blocklist = tmp_path / "blocklist.txt"
    blocklist.write_text(f"# comment\nforbidden\nre:secr[e3]t\n{piece}\n")
    with running(debug_tokenizer, blocklist=str(blocklist)) as (bl_url, _):
        assert_openai_error(completion(bl_url, prompt="a ForBidden word"), 400, "content_filter")
        assert_openai_error(completion(bl_url, prompt="my secr3t"), 400, "content_filter")
        choice = completion(bl_url, **sampled).json()["choices"][0]
        assert choice["finish_reason"] == "content_filter"
        assert choice["text"] == full[: full.lower().find(piece.lower())]
        frames = sse(completion(bl_url, stream=True, **sampled))
        assert "".join(f["choices"][0]["text"] for f in frames[:-1]) == choice["text"]
        assert frames[-2]["choices"][0]["finish_reason"] == "content_filter"


def test_text_filter_holds_back_what_could_still_match() -> None:
    f = TextFilter(Blocklist(["bad"]))
    assert f.push("a b") == ("", False)  # "a b" could be the start of nothing, but holdback is 3
    assert f.push("a") == ("a", False)
    assert f.push("D!") == (" ", True)  # "baD" spans three pushes; the text stops before it
    g = TextFilter(Blocklist(patterns=["z{1,3}z"]))
    assert g.push("abc") == ("", False) and g.push("", final=True) == ("abc", False)


def filtered(rules: Blocklist, pieces: list[str]) -> tuple[str, bool]:
    """What a TextFilter releases of output arriving in `pieces`, the last one ending it; whether it cut it."""
    text_filter, released = TextFilter(rules), ""
    for i, piece in enumerate(pieces):
        out, cut = text_filter.push(piece, final=i == len(pieces) - 1)
        released += out
        if cut:
            return released, True
    return released, False


@pytest.mark.parametrize("rule, pieces, kept", [
    ("a{1,3}$", ["xa", "ay", "z"], "xaayz"), ("a{1,3}$", ["xa", "ay", "za"], "xaayz"),
    ("x\\Z", ["ax", "b"], "axb"), ("x\\Z", ["ax", "bx"], "axb"),
    ("(?m)^ok$", ["no\nok", "ay"], "no\nokay"), ("(?m)^ok$", ["no\nok", "\nmore"], "no\n"),
    ("\\bcat\\b", ["the cat", "s"], "the cats"), ("\\bcat\\b", ["the cat", " sat"], "the "),
    ("cat(?!s)", ["the cat", "s"], "the cats"), ("cat(?!s)", ["the cat", "!"], "the "),
])
def test_anchors_and_lookaheads_are_decided_by_the_text_that_follows(rule: str, pieces: list[str], kept: str) -> None:
    # `$` and `\Z` mean the end of the output, not of the text generated so far; `\b` and a lookahead
    # wait for the characters they look at.
    assert filtered(Blocklist(patterns=[rule]), pieces) == (kept, kept != "".join(pieces))


@pytest.mark.parametrize("rule, text, kept", [("x{12}", "ab" + "x" * 12 + "cd", "ab"),
                                              ("ab(?=c{12})", "xab" + "c" * 12 + "!", "x")])
def test_a_match_longer_than_its_rule_never_releases_its_start(rule: str, text: str, kept: str) -> None:
    # the rule's text is shorter than the text it matches (or reads): a character at a time, nothing of it
    assert filtered(Blocklist(patterns=[rule]), list(text)) == (kept, True)


def test_a_streamed_reply_never_shows_the_start_of_a_match_longer_than_its_rule(
        debug_tokenizer: Any, tmp_path: Path) -> None:
    path = tmp_path / "blocklist.txt"
    path.write_text("re:x{6}\n")
    script = [byte_token(debug_tokenizer, b) for b in b"ab" + b"x" * 6 + b"cd"]
    with running(debug_tokenizer, blocklist=str(path)) as (url, app):
        gen = app.state.engine.generator
        gen.sample = lambda logits, params, histories, *_, **__: [script[len(h) - n_prompt] for h in histories]
        n_prompt = len(debug_tokenizer.encode(PROMPT).ids)
        frames = sse(completion(url, stream=True, max_tokens=len(script)))
    assert "".join(f["choices"][0]["text"] for f in frames[:-1]) == "ab"
    assert frames[-2]["choices"][0]["finish_reason"] == "content_filter"


def test_an_end_anchored_rule_cuts_only_outputs_that_end_in_a_match(url: str, debug_tokenizer: Any,
                                                                     tmp_path: Path) -> None:
    sampled = {"prompt": [PROMPT] * 4, "n": 8, "max_tokens": 10, "temperature": 1.0, "seed": 5}
    full = [(c["text"], c["finish_reason"]) for c in completion(url, **sampled).json()["choices"]]
    # a letter that ends some outputs and stands inside others
    ends = {t[-1] for t, _ in full if t and t[-1].isascii() and t[-1].isalpha()}
    assert ends, full
    letter = max(sorted(ends), key=lambda c: sum(c in t[:-1].lower() for t, _ in full))
    rule = f"{letter}{{1,3}}$"
    path = tmp_path / "blocklist.txt"
    path.write_text(f"re:{rule}\n")
    with running(debug_tokenizer, blocklist=str(path)) as (bl_url, _):
        got = [(c["text"], c["finish_reason"]) for c in completion(bl_url, **sampled).json()["choices"]]
    expected = []
    for text, reason in full:
        m = re.search(rule, text, re.IGNORECASE)
        expected.append((text[: m.start()], "content_filter") if m else (text, reason))
    assert got == expected
    assert any(letter in t.lower() and not re.search(rule, t, re.IGNORECASE) for t, _ in full)  # left whole


def test_blocklist_lines_are_plain_text_unless_prefixed_re(tmp_path: Path) -> None:
    path = tmp_path / "blocklist.txt"
    path.write_text("# a comment\n\n  a.c  \n(a+)+$\nre:secr[e3]t\nre: x\\d{2}\n", encoding="utf-8")
    blocklist = load_blocklist(str(path))
    assert blocklist.terms == ("a.c", "(a+)+$") and blocklist.sources == ("secr[e3]t", "x\\d{2}")
    found = {text: blocklist.find(text, timeout=5) for text in ["abc", "xA.Cx", "aaa(A+)+$", "my SECR3T", "x42", "x4"]}
    assert found == {"abc": None, "xA.Cx": 1, "aaa(A+)+$": 3, "my SECR3T": 3, "x42": 0, "x4": None}


@pytest.mark.parametrize("line, problem", [
    ("re:(unclosed", "not a valid regular expression"), ("re:a*", "matches the empty string"),
    ("re:", "matches the empty string"), ("re:secr(e)+t", "has no longest match"), ("re:x(?=.*y)", "no longest"),
    ("re:a{2000}", "may match 2000 characters"), ("re:\\p{L}x", "Python's re does not read"),
    ("x" * 1001, "the term is 1001 characters"),
])
def test_a_bad_blocklist_line_is_named(tmp_path: Path, line: str, problem: str) -> None:
    path = tmp_path / "blocklist.txt"
    path.write_text(f"fine\n{line}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=f"blocklist.txt:2: .*{problem}"):
        load_blocklist(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        load_blocklist(str(tmp_path / "missing.txt"))


def test_a_regex_past_its_time_limit_counts_as_a_match() -> None:
    slow = Blocklist(patterns=["(a|a){1,60}$"], timeout=0.2)  # exponential: 2**40 ways to fail on 40 a's and "!"
    assert slow.first_blocked(["fine", "b" * 40]) is None
    with pytest.raises(CheckTimeout, match="longer than 0.2 s"):
        slow.first_blocked(["fine", "a" * 40 + "!"])
    out = TextFilter(slow, timeout=0.2)  # generated text: cut where nothing was released yet
    assert out.push("bb") == ("", False) and out.push("a" * 40 + "!") == ("", True)


def test_a_pathological_prompt_costs_only_its_own_request(debug_tokenizer: Any, tmp_path: Path) -> None:
    path = tmp_path / "blocklist.txt"
    path.write_text(HOSTILE_BLOCKLIST, encoding="utf-8")
    with running(debug_tokenizer, blocklist=str(path)) as (url, app):
        blocklist = app.state.engine.blocklist
        blocklist.timeout = 3.0  # room for /health to answer while the check runs, on a busy machine
        check, started, done = blocklist.first_blocked, threading.Event(), threading.Event()

        def observed(texts: list[str]) -> int | None:
            started.set()
            try:
                return check(texts)
            finally:
                done.set()

        blocklist.first_blocked = observed
        result: dict[str, Any] = {}
        slow = threading.Thread(target=lambda: result.update(r=completion(url, prompt="a" * 40 + "!")))
        slow.start()
        assert started.wait(timeout=30)
        health = httpx.get(f"{url}/health", timeout=30)
        assert health.status_code == 200 and not done.is_set()  # answered while the regex still ran
        slow.join(timeout=60)
        err = assert_openai_error(result["r"], 400, "content_filter")
        assert "within 3 s" in err["message"]
        assert completion(url, max_tokens=2).status_code == 200  # the server goes on


def test_a_reply_ended_by_end_of_text_loses_no_text_to_the_blocklist_holdback(
        debug_tokenizer: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The output filter holds back the last characters a rule could still match; a reply that the
    model ends (end-of-text, as nearly every chat reply does) must still get them."""
    eot = eot_id(debug_tokenizer)
    assert eot is not None
    plen = len(debug_tokenizer.encode(PROMPT).ids)
    blocklist = tmp_path / "blocklist.txt"
    blocklist.write_text("qqqqqqqqqqqqqqqqqqqq\n")  # 20 characters: 19 held back
    texts = []
    for bl in (None, str(blocklist)):
        with running(debug_tokenizer, blocklist=bl) as (url, app):
            end_of_text_after(app.state.engine.generator, monkeypatch, plen, 8, eot)
            r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 20, "temperature": 0},
                           timeout=60).json()["choices"][0]
            assert r["finish_reason"] == "stop"
            texts.append(r["text"])
    assert texts[0] and texts[1] == texts[0]
