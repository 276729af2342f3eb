"""Chat: template resolution and rendering (gptopt.infer.chat), /v1/chat/completions, and `gptopt generate --chat`.

    pytest -q tests/test_chat.py
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import make_varied_model, run_chat
from tokenizers import Tokenizer

from gptopt.infer import chat

# Renders "role: content" lines, then "assistant:"; refuses a message that is exactly "boom".
JINJA = ("{% for m in messages %}{% if m.content == 'boom' %}{{ raise_exception('the template refuses boom') }}"
         "{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
HI = [{"role": "user", "content": "hi"}]


def write_config(folder: Path, **fields: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer_config.json").write_text(json.dumps(fields), encoding="utf-8")
    return folder


# -- templates ---------------------------------------------------------------------------------------


def test_the_option_comes_first_then_plain_then_the_models_own(tmp_path: Path) -> None:
    model = write_config(tmp_path / "model", chat_template="CONFIG {{ messages[0].content }}")
    path = tmp_path / "mine.jinja"
    path.write_text("FILE {{ messages[0].content }}", encoding="utf-8")
    assert chat.load_template(str(path), [model]).render(HI) == "FILE hi"
    assert chat.load_template("plain", [model]).render(HI) == "User: hi\nAssistant:"
    assert chat.load_template(None, [model]).render(HI) == "CONFIG hi"
    # transformers' separate file takes priority over the config's entry in the same folder
    (model / "chat_template.jinja").write_text("JINJA FILE {{ messages[0].content }}", encoding="utf-8")
    assert chat.load_template(None, [model]).render(HI) == "JINJA FILE hi"


def test_a_list_of_templates_uses_default_and_without_one_is_refused(tmp_path: Path) -> None:
    listed = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT {{ bos_token }}"}]
    model = write_config(tmp_path / "a", chat_template=listed, bos_token={"content": "<s>", "special": True})
    assert chat.load_template(None, [model]).render(HI) == "DEFAULT <s>"
    other = write_config(tmp_path / "b", chat_template=listed[:1])
    with pytest.raises(ValueError, match="no 'default'.*--chat_template"):
        chat.load_template(None, [other])


def test_the_template_is_found_beside_the_tokenizer_a_model_dir_records(
        model_dir: Path, train_data: Path, tmp_path: Path, debug_tokenizer: Tokenizer) -> None:
    # model_dir's meta names train_data/tokenizer.json: a tokenizer_config.json there is the model's
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_bytes((train_data / "tokenizer.json").read_bytes())
    write_config(tok_dir, chat_template="{{ eos_token }}|{{ messages[0].content }}")
    assert chat.template_folders(str(model_dir)) == [model_dir.resolve(), train_data.resolve()]
    template = chat.load_template(None, chat.template_folders(str(model_dir), str(tok_dir / "tokenizer.json")),
                                  debug_tokenizer)
    assert template is not None and template.render(HI) == "<|endoftext|>|hi"
    assert template.stop_token_ids(debug_tokenizer) == (debug_tokenizer.token_to_id("<|endoftext|>"),)


def test_plain_renders_system_user_assistant_lines_and_stops_at_the_next_turn() -> None:
    template = chat.load_template("plain", [])
    messages = chat.check_messages([{"role": "developer", "content": "Be terse."}, *HI,
                                    {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"}])
    assert template.render(messages) == "System: Be terse.\nUser: hi\nAssistant: hello\nUser: and?\nAssistant:"
    assert "\nUser:" in template.stop


def test_no_template_is_none_and_the_message_names_the_option(tmp_path: Path) -> None:
    model = write_config(tmp_path / "base", eos_token="<|endoftext|>")  # a base GPT-2: no chat_template
    assert chat.load_template(None, [model]) is None
    message = chat.no_template([model])
    assert "--chat_template FILE" in message and "--chat_template plain" in message and str(model) in message


@pytest.mark.parametrize("text, problem", [("{% for %}", "--chat_template {path}.*not valid Jinja"),
                                           ("{{ raise_exception('no') }}", "the chat template of --chat_template "
                                            "failed on these messages: no$")])
def test_a_bad_template_is_a_value_error_naming_it(tmp_path: Path, text: str, problem: str) -> None:
    # at start-up with its file; when it fails on a request's messages by its kind (the sender sees that)
    path = tmp_path / "bad.jinja"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=problem.format(path=path)):
        chat.load_template(str(path), []).render(HI)
    with pytest.raises(ValueError, match="no such file.*plain"):
        chat.load_template(str(tmp_path / "missing.jinja"), [])


def test_templates_run_in_the_sandbox(tmp_path: Path) -> None:
    path = tmp_path / "escape.jinja"
    path.write_text("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", encoding="utf-8")
    with pytest.raises(ValueError, match="failed"):
        chat.load_template(str(path), []).render(HI)


@pytest.mark.parametrize("messages, problem", [
    ([], "non-empty list"),
    ([{"role": "tool", "content": "x"}], "tools are not supported"),
    ([{"role": "wizard", "content": "x"}], r"messages\[0\].role must be one of"),
    ([{"role": "user"}], r"messages\[0\].content is missing"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text parts"),
    ([{"role": "user", "content": 3}], "a string or a list"),
])
def test_bad_messages_are_named(messages: Any, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        chat.check_messages(messages)


def test_text_parts_join_into_one_content() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert chat.check_messages([{"role": "user", "content": parts}]) == [{"role": "user", "content": "a\nb"}]


def test_the_oldest_exchanges_are_dropped_and_the_system_message_kept() -> None:
    system = {"role": "system", "content": "s"}
    turns = [{"role": r, "content": f"{r}{i}"} for i in range(3) for r in ("user", "assistant")][:-1]
    count = len  # one "token" per message

    kept, dropped = chat.fit_conversation([system, *turns], count, 4)
    assert kept == [system, *turns[2:]] and dropped == 2  # user0 and its reply went together
    assert chat.fit_conversation([system, *turns], count, 10) == ([system, *turns], 0)
    with pytest.raises(ValueError, match="does not fit"):
        chat.fit_conversation([system, *turns], count, 1)


# -- the server ----------------------------------------------------------------------------------------

fastapi = pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from gptopt.config import ServeConfig  # noqa: E402
from gptopt.serve.app import create_app  # noqa: E402
from gptopt.serve.chat_api import CHAT_EXAMPLE_BODY  # noqa: E402
from gptopt.serve.server import serve_in_thread  # noqa: E402


@contextlib.contextmanager
def serving(tokenizer: Tokenizer, **cfg: Any) -> Iterator[str]:
    app = create_app(ServeConfig(model="debug", device="cpu", max_batch_size=4, **cfg),
                     model=make_varied_model(tokenizer.get_vocab_size()), tokenizer=tokenizer)
    with serve_in_thread(app) as server:
        yield f"http://127.0.0.1:{server.port}"


@pytest.fixture(scope="module")
def jinja_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(JINJA, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def url(debug_tokenizer: Tokenizer, jinja_file: Path) -> Iterator[str]:
    with serving(debug_tokenizer, chat_template=str(jinja_file)) as u:
        yield u


def chat_post(url: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"messages": HI, **body}, timeout=60)


def openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_greedy_chat_equals_greedy_completion_of_the_rendered_prompt(
        url: str, jinja_file: Path, debug_tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "terse"}, {"role": "user", "content": "def fib(n):"}]
    r = chat_post(url, messages=messages, max_tokens=12, temperature=0)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and body["model"] == "debug"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["index"] == 0
    prompt = chat.load_template(str(jinja_file), [], debug_tokenizer).render(messages)
    assert prompt == "system: terse\nuser: def fib(n):\nassistant:"
    plain = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0},
                       timeout=60).json()
    assert choice["message"]["content"] == plain["choices"][0]["text"] != ""
    assert choice["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert body["usage"] == plain["usage"]


def test_chat_logprobs_are_the_completions_logprobs_of_the_rendered_prompt(
        url: str, jinja_file: Path, debug_tokenizer: Tokenizer) -> None:
    """logprobs / top_logprobs on the chat route: OpenAI chat's logprobs.content, the same numbers
    /v1/completions gives for the rendered prompt, streamed or not."""
    messages = [{"role": "user", "content": "def fib(n):"}]
    prompt = chat.load_template(str(jinja_file), [], debug_tokenizer).render(messages)
    plain = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 3}).json()["choices"][0]["logprobs"]
    r = chat_post(url, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == plain["tokens"]
    # the same numbers up to rounding: the second request reuses the first's cached prompt (prefix caching), whose
    # keys and values a forward of another shape computed
    assert [c["logprob"] for c in content] == pytest.approx(plain["token_logprobs"], abs=1e-5)
    for c, top in zip(content, plain["top_logprobs"], strict=True):
        assert len(c["top_logprobs"]) == 3 and c["top_logprobs"][0]["logprob"] == c["logprob"]  # greedy: the top one
        mine = {t["token"]: t["logprob"] for t in c["top_logprobs"]}
        assert set(mine) <= set(top) and mine == pytest.approx({t: top[t] for t in mine}, abs=1e-5)
        assert bytes(c["bytes"]).decode("utf-8", "replace") == c["token"] or c["token"].startswith("bytes:")
    frames = [json.loads(f[6:]) for f in chat_post(url, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                                   top_logprobs=3, stream=True).content.decode().split("\n\n")
              if f.startswith("data: {")]
    streamed = [c for f in frames for ch in f["choices"] if ch["logprobs"] for c in ch["logprobs"]["content"]]
    assert streamed == content
    assert chat_post(url, messages=messages, max_tokens=6, temperature=0).json()["choices"][0]["logprobs"] is None


def test_max_completion_tokens_wins_over_max_tokens(url: str) -> None:
    ten = chat_post(url, max_tokens=10, temperature=0).json()
    assert ten["usage"]["completion_tokens"] == 10  # so the limit below is what ends it
    three = chat_post(url, max_tokens=10, max_completion_tokens=3, temperature=0).json()
    assert three["usage"]["completion_tokens"] == 3 and three["choices"][0]["finish_reason"] == "length"
    err = openai_error(chat_post(url, max_completion_tokens=10**6), 400)
    assert err["param"] == "max_completion_tokens"


def test_streaming_sends_the_role_then_content_then_usage_and_done(url: str) -> None:
    whole = chat_post(url, max_tokens=8, temperature=0, n=2).json()
    r = chat_post(url, max_tokens=8, temperature=0, n=2, stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    text = r.content.decode("utf-8")
    assert text.endswith("data: [DONE]\n\n")
    frames = [json.loads(f[6:]) for f in text.split("\n\n") if f.startswith("data: {")]
    assert {f["object"] for f in frames} == {"chat.completion.chunk"}
    for index in (0, 1):
        deltas = [c for f in frames for c in f["choices"] if c["index"] == index]
        assert deltas[0]["delta"]["role"] == "assistant"
        assert all("role" not in c["delta"] for c in deltas[1:])
        assert "".join(c["delta"].get("content", "") for c in deltas) == whole["choices"][index]["message"]["content"]
        assert deltas[-1]["finish_reason"] == whole["choices"][index]["finish_reason"]
    assert frames[-1]["choices"] == [] and frames[-1]["usage"] == whole["usage"]


@pytest.mark.parametrize("body, param, problem", [
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages", "must be one of"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages", "only text parts"),
    ({"messages": [{"role": "assistant"}]}, "messages.0.content", "Field required"),
    ({"messages": []}, "messages", ""),
    ({"messages": "hi"}, "messages", ""),
    ({"messages": [{"role": "user", "content": "boom"}]}, "messages", "the template refuses boom"),
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "at most 20"),
    ({"model": "gpt-4"}, "model", "does not exist"),
])
def test_bad_chat_requests_get_400_with_openais_body(url: str, body: dict[str, Any], param: str,
                                                     problem: str) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": HI, **body}, timeout=30)
    err = openai_error(r, 404 if param == "model" else 400)
    assert err["param"] == param and problem in err["message"]


def test_openai_client_chat_completions_unchanged(url: str) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
    c = client.chat.completions.create(model="debug", messages=HI, max_completion_tokens=6, temperature=0)
    assert c.choices[0].message.role == "assistant" and c.choices[0].message.content
    assert c.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model="debug", messages=HI, max_tokens=6, temperature=0,
                                                 stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == c.choices[0].message.content
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="debug", messages=[{"role": "user", "content": "boom"}])
    assert [m.model_extra["chat"] for m in client.models.list()] == [True]


def test_a_model_without_a_template_is_refused_naming_the_option(debug_tokenizer: Tokenizer) -> None:
    with serving(debug_tokenizer) as u:
        err = openai_error(chat_post(u), 400)
        assert "--chat_template" in err["message"] and err["code"] == "no_chat_template"
        assert [m["chat"] for m in httpx.get(f"{u}/v1/models").json()["data"]] == [False]
        assert httpx.get(f"{u}/v1/models/debug").json()["chat"] is False


def test_a_bad_template_fails_at_start_up(debug_tokenizer: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "broken.jinja"
    path.write_text("{% if %}", encoding="utf-8")
    with pytest.raises(ValueError, match="not valid Jinja"):
        create_app(ServeConfig(model="debug", device="cpu", max_batch_size=1, chat_template=str(path)),
                   model=make_varied_model(debug_tokenizer.get_vocab_size()), tokenizer=debug_tokenizer)


def test_serve_refuses_a_bad_chat_template_before_loading_the_model(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gptopt import cli

    broken = tmp_path / "broken.jinja"
    broken.write_text("{{ unclosed", encoding="utf-8")
    for template, problem in ((str(tmp_path / "missing.jinja"), "no such file"), (str(broken), "not valid Jinja")):
        capsys.readouterr()
        # a folder that holds no model: loading it would fail, so the template's refusal shows it came first
        assert cli.main(["serve", "--model", str(tmp_path), "--chat_template", template, "--port", "0"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and problem in err and err.startswith("gptopt serve: error: ")


# -- gptopt generate --chat ---------------------------------------------------------------------------




def test_generate_chat_answers_turns_and_keeps_the_conversation(
        model_dir: Path, debug_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err, prompts = run_chat(["--model", str(model_dir), "--chat_template", "plain", "--max_new_tokens", "3",
                                      "Be brief."], "hi\nand?\n", monkeypatch, capsys)
    assert rc == 0, err
    assert len(prompts) == 2 and err.count("you> ") == 3  # two turns, then the end of input
    first = out.splitlines()[0].strip()
    assert debug_tokenizer.decode(prompts[0]) == "System: Be brief.\nUser: hi\nAssistant:"
    assert debug_tokenizer.decode(prompts[1]) == (f"System: Be brief.\nUser: hi\nAssistant: {first}\nUser: and?\n"
                                                  "Assistant:")
    assert "dropped" not in err


def test_generate_chat_reset_exit_and_dropping_old_turns(
        model_dir: Path, debug_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", str(model_dir), "--chat_template", "plain", "--max_new_tokens", "2"]
    rc, _, err, prompts = run_chat(args, "hello\n/reset\nagain\n/exit\nnever sent\n", monkeypatch, capsys)
    assert rc == 0 and len(prompts) == 2 and "cleared" in err
    assert debug_tokenizer.decode(prompts[1]) == "User: again\nAssistant:"
    # the debug model's context is 64 tokens: long turns push the oldest out, and it is said
    long = "word " * 8
    rc, _, err, prompts = run_chat(args, f"{long}1\n{long}2\n{long}3\n", monkeypatch, capsys)
    assert rc == 0 and "dropped the 2 oldest messages" in err
    assert all(len(p) <= 64 - 2 for p in prompts)
    assert "3" in debug_tokenizer.decode(prompts[-1]) and f"{long}1" not in debug_tokenizer.decode(prompts[-1])


def test_generate_chat_with_a_system_message_that_leaves_no_room_says_so_once_and_stops(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # the debug model's context is 64 tokens, half of it kept for the reply: 80 words leave no room for a turn
    system = "word " * 80
    args = ["--model", str(model_dir), "--chat_template", "plain", "--max_new_tokens", "3", system]
    rc, out, err, prompts = run_chat(args, "hi\nand?\n", monkeypatch, capsys)
    assert rc == 2 and not prompts and not out
    assert "you> " not in err and "does not fit" not in err  # no user turn is blamed
    line = err.strip().splitlines()[-1]
    assert line.startswith("gptopt generate: error: the system message") and "context of 64 tokens" in line, err
    assert "shorten the system message" in line


@pytest.mark.parametrize("argv, problem", [
    (["--input", "prompts.txt"], "--chat is interactive"),
    ([], "no chat template"),
    (["--chat_template", "/nonexistent.jinja"], "no such file"),
])
def test_generate_chat_refusals_are_one_line(model_dir: Path, tmp_path: Path, argv: list[str], problem: str,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    rc, out, err, prompts = run_chat(["--model", str(model_dir), *argv], "hi\n", monkeypatch, capsys)
    assert rc == 2 and not prompts and not out
    assert len(err.strip().splitlines()) == 1 and problem in err and err.startswith("gptopt generate: error: ")


def test_bad_json_on_the_chat_route_names_a_chat_body(url: str) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", content=b"{", timeout=10)
    assert r.status_code == 400 and CHAT_EXAMPLE_BODY in r.json()["error"]["message"], r.text


def test_a_broken_template_of_the_models_own_leaves_the_server_up_and_the_chat_route_says_why(
        debug_tokenizer: Tokenizer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A template nobody asked for (the model folder's own) must not stop a server whose completions
    need none: it starts, warns, and the chat route answers 400 with the reason and the fix."""
    model = write_config(tmp_path / "model", chat_template="{% for m in messages %}{{ m.content }")
    with caplog.at_level("WARNING"):
        app = create_app(ServeConfig(model=str(model), device="cpu", max_batch_size=1),
                         model=make_varied_model(debug_tokenizer.get_vocab_size()), tokenizer=debug_tokenizer)
    assert "chat template cannot be used" in caplog.text
    with serve_in_thread(app) as server:
        url = f"http://127.0.0.1:{server.port}"
        err = openai_error(chat_post(url), 400)
        assert "not valid Jinja" in err["message"] and "--chat_template" in err["message"]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("file", ["tokenizer_config.json", "chat_template.jinja"])
def test_a_models_template_that_raises_is_named_without_the_servers_paths(
        debug_tokenizer: Tokenizer, tmp_path: Path, file: str) -> None:
    # the 400 goes to whoever sent the request: it names the template by its kind, not by where it lies
    template = "{{ raise_exception('no system messages') }}"
    model = write_config(tmp_path / "model", chat_template=template)
    if file == "chat_template.jinja":
        (model / file).write_text(template, encoding="utf-8")
    app = create_app(ServeConfig(model=str(model), device="cpu", max_batch_size=1),
                     model=make_varied_model(debug_tokenizer.get_vocab_size()), tokenizer=debug_tokenizer)
    with serve_in_thread(app) as server:
        err = openai_error(chat_post(f"http://127.0.0.1:{server.port}"), 400)
    assert err["message"] == f"the model's chat template ({file}) failed on these messages: no system messages"
    assert err["code"] == "chat_template_error" and str(tmp_path) not in err["message"]


@pytest.mark.parametrize("config", [{}, {"chat_template": 42}], ids=["no template", "a broken one"])
def test_a_model_whose_template_cannot_serve_chat_is_refused_without_the_servers_paths(
        debug_tokenizer: Tokenizer, tmp_path: Path, config: dict[str, Any]) -> None:
    model = write_config(tmp_path / "model", **config)
    app = create_app(ServeConfig(model=str(model), device="cpu", max_batch_size=1),
                     model=make_varied_model(debug_tokenizer.get_vocab_size()), tokenizer=debug_tokenizer)
    with serve_in_thread(app) as server:
        err = openai_error(chat_post(f"http://127.0.0.1:{server.port}"), 400)
    assert "--chat_template" in err["message"] and str(tmp_path) not in err["message"], err


def test_transformers_generation_blocks_render_their_text(tmp_path: Path) -> None:
    """`{% generation %}` (transformers' marker of the assistant's tokens, in many models' templates)
    renders what it encloses."""
    model = write_config(tmp_path / "model", chat_template=(
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}A: {{ m.content }}{% endgeneration %}"
        "{% else %}U: {{ m.content }}{% endif %}\n{% endfor %}"))
    messages = [*HI, {"role": "assistant", "content": "hello"}]
    # trim_blocks drops the newline after a tag
    assert chat.load_template(None, [model]).render(messages) == "U: hiA: hello"
