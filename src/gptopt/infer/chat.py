"""Chat templates: which one a model uses, checking messages, and rendering them into one prompt.

    python -c "import gptopt.infer.chat as c;print(c.load_template('plain',[]).render([dict(role='user',content='x')]))"

The one place for chat templates: `gptopt serve`'s /v1/chat/completions and `gptopt generate --chat`
both resolve the template here, in this order:

1. `--chat_template FILE`: a Jinja file, rendered as Hugging Face's apply_chat_template renders it;
2. `--chat_template plain`: the built-in plain template (PLAIN_FORMAT), chosen explicitly;
3. the model's own: `chat_template.jinja` (newer transformers) or the `chat_template` of
   `tokenizer_config.json`, in the model's folder, the training output above it, or beside the
   tokenizer (a string, or a list of {name, template} whose "default" is used, as transformers does).

No template is never guessed (base GPT-2 has none, and servers that guess teach users that a base
model chats): without one, the caller refuses with NO_TEMPLATE, which names --chat_template.
Templates run in Jinja's immutable sandbox, as in transformers: a model folder's template is code
from whoever published the folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from gptopt.data.tokenizer import EOT, eot_id
from gptopt.models import checkpoint
from gptopt.models.hf_files import TEMPLATE_FILE, TOKENIZER_CONFIG, read_json, special_ids
from gptopt.utils.errors import UserError
from gptopt.utils.extras import require

PLAIN = "plain"  # --chat_template plain
ROLES = ("system", "user", "assistant")
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system message
# The plain template: one "Role: text" line per message, then "Assistant:" for the reply to follow.
PLAIN_NAMES = {"system": "System", "user": "User", "assistant": "Assistant"}
PLAIN_FORMAT = "System: ...\\nUser: ...\\nAssistant: ...\\nUser: ...\\nAssistant:"
# A plain-template reply ends where the model starts the next turn itself: a base model does.
PLAIN_STOP = ("\nUser:", "\nSystem:")
# The template gptopt gives a model whose tokenizer it trained itself (`gptopt prepare` of conversations with such a
# tokenizer): ChatML, as SmolLM2 and Qwen3 use, its two markers added to the tokenizer as special tokens, so that no
# text a user writes can spell them, and <|im_end|> ends each turn (a reply stops there).
DEFAULT_START, DEFAULT_END = "<|im_start|>", "<|im_end|>"
DEFAULT_TEMPLATE = ("{% for message in messages %}" + DEFAULT_START + "{{ message['role'] }}\n{{ message['content'] }}"
                    + DEFAULT_END + "\n{% endfor %}{% if add_generation_prompt %}" + DEFAULT_START
                    + "assistant\n{% endif %}")
NO_TEMPLATE = ("this model has no chat template ({where}); give one with --chat_template FILE (a Jinja "
               "template), or --chat_template plain for the built-in 'System/User/Assistant:' lines")


class ChatTemplate:
    """A resolved template: `render(messages)` is the prompt, ending where the assistant's reply begins.

    source names it to whoever runs the server (a file's path), kind to clients, in the errors of render:
    those reach a request's sender, who must not see the server's files. stop: extra stop strings its
    replies end at; eos_token: the text of the token that ends a turn (its id, where the tokenizer has
    it, ends generation too). add_special_tokens: whether the rendered prompt is encoded with the tokens the
    tokenizer adds to any text (Llama 3's BOS): a Jinja template writes those itself (its bos_token), so, as
    transformers' apply_chat_template, not for it; the plain template's prompt is encoded as a completion's."""

    def __init__(self, source: str, text: str | None, *, kind: str, bos_token: str = "",
                 eos_token: str = "") -> None:
        self.source, self.kind, self.text = source, kind, text
        self.bos_token, self.eos_token = bos_token, eos_token
        self.stop = PLAIN_STOP if text is None else ()
        self.add_special_tokens = text is None
        self._compiled = None if text is None else _compile(text, source)

    def render(self, messages: list[dict[str, str]], *, generation_prompt: bool = True) -> str:
        """The prompt for checked messages (check_messages); generation_prompt False: the conversation as it stands,
        without the opening of a reply to come (what fine-tuning trains on). ValueError names the template and the
        problem when the template fails (its own raise_exception included)."""
        if self._compiled is None:
            return "".join(f"{PLAIN_NAMES[m['role']]}: {m['content']}\n" for m in messages) + \
                ("Assistant:" if generation_prompt else "")
        jinja2 = require("jinja2", "chat", "a Jinja chat template")
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except jinja2.TemplateError as e:
            raise UserError(f"{self.kind} failed on these messages: {e}") from None
        except Exception as e:  # a template is code: a TypeError or ZeroDivisionError in it is its own fault
            raise UserError(f"{self.kind} failed on these messages: {type(e).__name__}: {e}") from None

    def encode(self, tokenizer: Tokenizer, prompt: str) -> list[int]:
        """The token ids of a prompt render made (add_special_tokens says which)."""
        return tokenizer.encode(prompt, add_special_tokens=self.add_special_tokens).ids

    def stop_token_ids(self, tokenizer: Tokenizer) -> tuple[int, ...]:
        """Token ids that end a reply: the end-of-text token, and the template's eos_token where the
        tokenizer has it as one token (ChatML's <|im_end|>, for example)."""
        ids = [eot_id(tokenizer), tokenizer.token_to_id(self.eos_token) if self.eos_token else None]
        return tuple(dict.fromkeys(i for i in ids if i is not None))


def _compile(text: str, source: str) -> Any:
    """The template compiled as transformers compiles it (utils/chat_template_utils.py): the immutable
    sandbox, trim_blocks and lstrip_blocks, loop controls, raise_exception, and a tojson that keeps
    non-ASCII text as it is. A syntax error is found now, at start-up, with its line."""
    jinja2 = require("jinja2", "chat", "a Jinja chat template")
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's tokens with it (for
        training masks); rendering keeps the block's text, as transformers does."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, Generation])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"the chat template ({source}) is not valid Jinja: {e.message} (line {e.lineno}); "
                         "fix it, or give another with --chat_template FILE") from None


def template_folders(model: str, tokenizer: str | None = None) -> list[Path]:
    """Where a model's own template may be: the checkpoint --model resolves to, the --model folder, the
    folder of --tokenizer (or of the tokenizer the checkpoint records). Only folders that exist; a hub
    name has none (its template is not fetched: serve a local copy of the folder)."""
    folders: list[Path] = []
    p = Path(model).expanduser()
    if p.is_dir():
        latest = checkpoint.latest_checkpoint(p)
        folders += [latest, p] if latest is not None else [p]
        if tokenizer is None and checkpoint.is_gptopt_dir(folders[0]):
            tokenizer = checkpoint.read_meta(folders[0]).get("tokenizer")
    if tokenizer:
        t = Path(tokenizer).expanduser()
        folders.append(t if t.is_dir() else t.parent)
    return [d for d in dict.fromkeys(f.resolve() for f in folders) if d.is_dir()]


def end_token_ids(folders: Sequence[Path], tokenizer: Tokenizer) -> tuple[int, ...]:
    """Every id that ends a sequence of this model: the tokenizer's end-of-text, each eos_token_id (an id or a
    list) of config.json and generation_config.json in `folders` (template_folders; hf_files.special_ids, which
    refuses a value that is no id), and the eos_token of their tokenizer_config.json (a chat template's end of
    turn: Llama 3's <|eot_id|>, Qwen3's <|im_end|>), where the tokenizer has it. A completion stops at any of
    them, as transformers' generate does."""
    ids: list[int | None] = [eot_id(tokenizer), *special_ids(folders)[1]]
    for d in folders:
        if (d / TOKENIZER_CONFIG).is_file():
            text = _token_text(read_json(d / TOKENIZER_CONFIG).get("eos_token"))
            ids.append(tokenizer.token_to_id(text) if text else None)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    return tuple(dict.fromkeys(i for i in ids if i is not None and 0 <= i < size))


def _read_config(path: Path) -> dict[str, Any]:
    return read_json(path, "fix the file, or give --chat_template")


def _config_template(path: Path, data: dict[str, Any]) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {name, template} (its "default")."""
    value = data.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        named = {t["name"]: t["template"] for t in value}
        if "default" in named:
            return named["default"]
        raise UserError(f"{path}: its chat templates ({', '.join(sorted(named))}) include no 'default'; "
                         "choose one with --chat_template FILE")
    raise UserError(f"{path}: chat_template must be a string or a list of {{name, template}}; fix the file, "
                     "or give --chat_template")


def _token_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json: "<s>", or {"content": "<s>", ...} (AddedToken's form)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_template(option: str | None, folders: Sequence[Path],
                  tokenizer: Tokenizer | None = None) -> ChatTemplate | None:
    """The chat template --chat_template names, else the model's own in `folders` (template_folders),
    else None. bos_token / eos_token: the tokenizer_config.json's, else the tokenizer's end-of-text."""
    configs = [(d / TOKENIZER_CONFIG, _read_config(d / TOKENIZER_CONFIG)) for d in folders
               if (d / TOKENIZER_CONFIG).is_file()]
    eot = EOT if tokenizer is not None and tokenizer.token_to_id(EOT) is not None else ""
    tokens = {"bos_token": eot, "eos_token": eot}  # GPT-2's <|endoftext|> is both
    for _, data in reversed(configs):  # the first folder's value wins
        tokens.update({k: t for k in tokens if (t := _token_text(data.get(k))) is not None})
    if option == PLAIN:
        return ChatTemplate("--chat_template plain", None, kind="the plain chat template", **tokens)
    if option is not None:
        path = Path(option).expanduser()
        if not path.is_file():
            raise UserError(f"--chat_template {option}: no such file; give a Jinja template file, or 'plain' for "
                             "the built-in plain template")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--chat_template {option}: cannot read it ({e}); give a readable UTF-8 file") from None
        return ChatTemplate(f"--chat_template {option}", text, kind="the chat template of --chat_template",
                            **tokens)
    for d in folders:  # transformers: the separate file takes priority over the config's entry
        if (d / TEMPLATE_FILE).is_file():
            return ChatTemplate(str(d / TEMPLATE_FILE), (d / TEMPLATE_FILE).read_text(encoding="utf-8"),
                                kind=f"the model's chat template ({TEMPLATE_FILE})", **tokens)
        config = next((data for path, data in configs if path.parent == d), None)
        if config is not None and (text := _config_template(d / TOKENIZER_CONFIG, config)) is not None:
            return ChatTemplate(str(d / TOKENIZER_CONFIG), text,
                                kind=f"the model's chat template ({TOKENIZER_CONFIG})", **tokens)
    return None


def no_template(folders: Sequence[Path] | None) -> str:
    """NO_TEMPLATE, saying where it was looked for; folders None: in words, for a server's clients, who
    are not to learn its paths."""
    if folders is None:
        where = f"no {TEMPLATE_FILE}, and no chat_template in {TOKENIZER_CONFIG}, in the model's folder"
    elif folders:
        where = (f"no {TEMPLATE_FILE}, and no chat_template in {TOKENIZER_CONFIG}, in "
                 + ", ".join(os.fspath(d) for d in folders))
    else:
        where = "none was given, and it has no model folder"
    return NO_TEMPLATE.format(where=where)


def check_messages(messages: Any) -> list[dict[str, str]]:
    """OpenAI's messages -> [{role, content}] with content as one string, or ValueError naming the message.

    A message is {role, content}: role system, user, assistant (developer counts as system); content a
    string or a list of {"type": "text", "text": ...} parts (joined with newlines, as vLLM does). Other
    fields (name) are ignored; tool calls and images are refused, as this server has neither."""
    if not isinstance(messages, list) or not messages:
        raise UserError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise UserError(f"{where} must be an object with role and content")
        role = m.get("role")
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in ROLES:
            raise UserError(f"{where}.role must be one of system, user, assistant, developer; got {m.get('role')!r}"
                             + (" (tools are not supported)" if role == "tool" else ""))
        out.append({"role": role, "content": _content(m.get("content"), f"{where}.content")})
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        raise UserError(f"{where} is missing: send the message's text (tool calls are not supported)")
    if not isinstance(content, list):
        raise UserError(f"{where} must be a string or a list of {{type: text, text}} parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            what = f"a part of type {kind!r}" if isinstance(kind, str) else "not a {type, text} object"
            raise UserError(f"{where}[{j}] is {what}; only text parts are supported")
        if not isinstance(part.get("text"), str):
            raise UserError(f"{where}[{j}].text must be a string")
        texts.append(part["text"])
    return "\n".join(texts)


def fit_conversation(messages: list[dict[str, str]], tokens: Callable[[list[dict[str, str]]], int],
                     limit: int) -> tuple[list[dict[str, str]], int]:
    """The latest turns whose rendered prompt takes at most `limit` tokens (tokens(messages) counts
    them), and how many messages were dropped. System messages stay; the oldest others go first, a
    whole exchange (up to the next user message) at a time. ValueError if even the last message alone
    does not fit."""
    kept, dropped = list(messages), 0
    while tokens(kept) > limit:
        others = [i for i, m in enumerate(kept) if m["role"] != "system"]
        if len(others) <= 1:
            raise UserError(f"the message does not fit the model's context ({limit} tokens with room for the "
                             "reply); send a shorter one, or lower --max_new_tokens")
        drop = {others[0]}
        for i in others[1:-1]:  # the replies to it, up to the next user message
            if kept[i]["role"] == "user":
                break
            drop.add(i)
        kept = [m for i, m in enumerate(kept) if i not in drop]
        dropped += len(drop)
    return kept, dropped
