"""The OpenAI protocol as this server speaks it: the request and response schemas, the limits a request
must keep, and OpenAI's error body, which every refusal carries.

    curl -s 127.0.0.1:8000/v1/completions -d '{"prompt": "def fib(n):", "n": 99}'
    {"error": {"message": "n: Input should be less than or equal to 8", "type": "invalid_request_error", ...}}

No FastAPI app here: the routes (app.py) read requests with these models and raise APIError; one
exception handler renders it, and validation_error turns the framework's own errors into the same
body, a 400 naming the field (never FastAPI's 422). Every limit is checked before any model work.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from gptopt.config import sampling as bounds
from gptopt.infer import chat
from gptopt.utils.extras import require

require("pydantic", "serve", "gptopt serve")
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field  # noqa: E402
from pydantic_core import PydanticCustomError  # noqa: E402

# Request limits: the schemas below and stop_strings check them, before any model work.
MAX_N = 8  # completions per prompt (best_of too: every candidate is generated in full)
MAX_LOGIT_BIAS = 300  # token ids one logit_bias may name, as OpenAI allows
# What bounds a request's sequences (prompts x n) is the engine: beyond --max_batch_size + --max_queue they
# get a 400 before any tokenizing (check_capacity). This only bounds the list the schema reads, far above
# the batches clients send (lm-evaluation-harness: --batch_size prompts in one request).
MAX_PROMPTS = 4096
# Stop strings: OpenAI allows 4, vLLM any number, and lm-evaluation-harness sends a task's list plus the
# end-of-text. The per-token check (stop.StopChecker) tries the prefixes of the stop strings that end
# as the text does; text and stop strings of one repeated character make that every prefix, a cost that
# grows with their total length squared: that total is bounded too, at what 4 of the longest cost.
MAX_STOP = 32
MAX_STOP_CHARS = 256
MAX_STOP_TOTAL_CHARS = 4 * MAX_STOP_CHARS
# What a refusal of a body that is not a JSON object shows as the fix (chat's: chat_api.CHAT_EXAMPLE_BODY).
EXAMPLE_BODY = '{"prompt": "def fib(n):", "max_tokens": 32}'


# -- errors ----------------------------------------------------------------------------------------


class APIError(Exception):
    """An error with OpenAI's body; raised by handlers, rendered by one exception handler."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code, self.headers = status, type, param, code, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error envelope: every 4xx and 5xx this server sends has this body."""

    error: ErrorDetail


# -- schemas ---------------------------------------------------------------------------------------

_STRICT = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")  # unknown OpenAI fields are ignored


def _unicode(text: Any) -> Any:
    """JSON may carry a lone UTF-16 surrogate ("\\ud800"), which is no character: refuse it here, as the
    tokenizer (and any UTF-8 output) cannot take it. Runs before the type check, which says less."""
    if not isinstance(text, str):
        return text  # the type check that follows refuses it
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError("invalid_unicode", "contains a lone UTF-16 surrogate ({char}) at index {index}, "
                                  "which is not text; send valid Unicode",
                                  {"char": ascii(text[e.start]), "index": e.start}) from None
    return text


def _whole(number: Any) -> Any:
    """JSON has one kind of number: 5.0 is the integer 5 to JSON Schema's `integer`, and clients send it so.
    A whole float becomes that int; 1.5, true and "5" go on to the strict check, which refuses them."""
    if isinstance(number, float) and number.is_integer():
        return int(number)
    return number


# Every integer field takes a whole JSON number, written either way. Around the whole type (`int | None`
# included), before any limit: so pydantic documents the field's limits as JSON Schema's minimum and maximum.
WHOLE = BeforeValidator(_whole)
Int = Annotated[int, WHOLE]
IntOrNone = Annotated[int | None, WHOLE]
Text = Annotated[str, BeforeValidator(_unicode)]
Prompt = Annotated[str, Field(min_length=1), BeforeValidator(_unicode)]
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS), BeforeValidator(_unicode)]
TokenKey = Annotated[str, Field(pattern=r"^[0-9]{1,9}$")]  # a token id as JSON writes an object's key
TokenIds = Annotated[list[Annotated[int, Field(ge=0), WHOLE]], Field(min_length=1)]  # a prompt already tokenized


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object, or json_schema {name, schema, strict}."""

    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = Field(None, description="with json_schema: {name, schema, strict}")


class Sampling(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share: sampling, choices, stop, streaming."""

    model_config = _STRICT
    temperature: float = Field(1.0, **bounds.TEMPERATURE.limits, description="0 = greedy")
    top_p: float = Field(1.0, **bounds.TOP_P.limits)
    n: Int = Field(1, ge=1, le=MAX_N)
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP)] | None = None
    seed: IntOrNone = Field(None, **bounds.SEED.limits, description="the same request and seed give the same "
                            "choices, alone or beside others; each choice draws from a seed of its own, derived from "
                            "this seed and its index (the first: this seed itself)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: IntOrNone = Field(None, **bounds.TOP_K.limits, description="extension: sample from the k most likely tokens")
    repetition_penalty: float = Field(1.0, **bounds.REPETITION_PENALTY.limits,
                                      description="extension: > 1 discourages repeats")
    presence_penalty: float = Field(0.0, **bounds.PRESENCE_PENALTY.limits, description="subtracted from the logit of "
                                    "every token generated so far (the prompt's do not count)")
    frequency_penalty: float = Field(0.0, **bounds.FREQUENCY_PENALTY.limits, description="times the number of times a "
                                     "token has been generated so far, subtracted from its logit")
    ignore_eos: bool = Field(False, description="extension (vLLM's): go on past the model's end-of-sequence tokens, "
                             "to max_tokens or a stop string")
    logit_bias: Annotated[dict[TokenKey, Annotated[float, Field(**bounds.LOGIT_BIAS.limits)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = Field(
        None, description="token id (a string) -> a value from -100 to 100 added to its logit before sampling")
    response_format: ResponseFormat | None = Field(None, description="json_object or json_schema: every token is "
                                                   "constrained to keep the reply a prefix of such a document")


class CompletionRequest(Sampling):
    model_config = _STRICT
    model: Text | None = None
    prompt: (Prompt | Annotated[list[Prompt], Field(min_length=1, max_length=MAX_PROMPTS)] | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]) = Field(
        description=f"a string, or a list of 1 to {MAX_PROMPTS} strings (one completion each); or token ids, "
        f"or a list of 1 to {MAX_PROMPTS} lists of token ids")
    max_tokens: IntOrNone = Field(16, ge=0, description="tokens to generate; null: up to the context end; 0 (with "
                                   "echo and logprobs): score the prompt only")
    echo: bool = False
    best_of: IntOrNone = Field(None, ge=1, le=MAX_N, description="generate this many completions per prompt and "
                               "return the n with the highest log-probability per token; not with stream")
    suffix: Text | None = Field(None, description="not supported: a non-empty suffix is answered 400")
    logprobs: IntOrNone = Field(None, ge=0, description="per token its log-probability and this many most likely "
                                 "alternatives (log_softmax of the model's raw logits, before temperature and "
                                 "top_p); with echo the prompt's tokens too")


class ChatContentPart(BaseModel):
    model_config = _STRICT
    type: Text = Field(description="text (the only kind of part served)", json_schema_extra={"enum": ["text"]})
    text: Text | None = None  # optional here, so that an image part is told "only text parts", not "text missing"


class ChatMessage(BaseModel):
    model_config = _STRICT
    # The enum documents the roles; any other string gets chat.check_messages' 400, which says why.
    role: Text = Field(description="system, user, assistant, or developer (as system)",
                       json_schema_extra={"enum": [*chat.ROLES, *chat.ROLE_ALIASES]})
    content: Text | list[ChatContentPart] = Field(description="a string, or a list of text parts")


class ChatRequest(Sampling):
    """OpenAI's chat completion request; the messages are rendered with the model's chat template."""

    model_config = _STRICT
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    model: Text | None = None
    max_tokens: IntOrNone = Field(None, ge=1, description="tokens to generate; null: up to the context end")
    max_completion_tokens: IntOrNone = Field(None, ge=1, description="the same, OpenAI's newer name; wins if both")
    logprobs: bool = Field(False, description="each reply token's log-probability (choices[].logprobs.content)")
    top_logprobs: IntOrNone = Field(None, ge=0, description="with logprobs: this many most likely tokens per "
                                     "position, at most the server's --max_logprobs")
    # Function calling is not served: a request that offers tools gets a 400 rather than a reply that
    # silently ignores them.
    tools: list[Any] | None = Field(None, description="not supported: a non-empty list is answered 400")
    functions: list[Any] | None = Field(None, description="not supported (tools' older name): answered 400")


class GenerateRequest(BaseModel):
    """The playbook's request: max_length counts the prompt's tokens too, as in Hugging Face generate."""

    model_config = _STRICT
    prompt: Prompt
    # As Hugging Face generate, a max_length the prompt already fills is refused: at least 2, since a prompt
    # is at least one token.
    max_length: Int = Field(100, ge=2, description="total tokens, prompt included (capped at the context): more "
                            "than the prompt's tokens, else 400")
    temperature: float = Field(1.0, **bounds.TEMPERATURE.limits)


class GenerateResponse(BaseModel):
    generated_text: str  # the prompt followed by its continuation, as HF's decode of the output
    inference_time: float  # seconds


# -- reading a request -----------------------------------------------------------------------------


def prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The request's prompts: each a text or a list of token ids."""
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    """The request's stop strings, at most MAX_STOP_TOTAL_CHARS in all (the schema bounds each and their count)."""
    strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if sum(map(len, strings)) > MAX_STOP_TOTAL_CHARS:
        raise APIError(400, f"stop: the stop strings may have at most {MAX_STOP_TOTAL_CHARS} characters in all; "
                       "send fewer or shorter ones", param="stop")
    return strings


# -- a body the schema refuses ---------------------------------------------------------------------


def json_problem(body: bytes, example: str = EXAMPLE_BODY) -> str | None:
    """Why `body` is not a JSON object, in words, or None. (FastAPI's own parse says only "There was
    an error parsing the body" for most of these.) On the event loop: the body is bounded (app.py's
    MAX_BODY_BYTES), so its parse is short."""
    fix = f"send a JSON object, e.g. {example}"
    if not body.strip():
        return f"the request body is empty; {fix}"
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return f"the request body is not valid JSON ({e.msg} at position {e.pos}); {fix}"
    except UnicodeDecodeError:
        return f"the request body is not UTF-8 (or UTF-16/32) text; {fix}"
    except RecursionError:
        return f"the request body's JSON nests too deeply; {fix}"
    except ValueError:  # an integer longer than Python converts (sys.get_int_max_str_digits)
        return f"the request body's JSON cannot be read (a number has too many digits); {fix}"
    if not isinstance(obj, dict):
        return f"the request body is JSON but not an object; {fix}"
    return None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "nullable"}  # pydantic's union alternatives


def validation_error(errors: list[Any]) -> APIError:
    """FastAPI's validation errors as one 400 that names the field and the problem."""
    # A union (prompt: a string or a list) reports one error per alternative; the alternative of the
    # right type says what is wrong, the others only that the type differs.
    first = next((x for x in errors if not x["type"].endswith("_type")), errors[0] if errors else None)
    if first is None:
        return APIError(400, "invalid request")
    loc = list(first.get("loc", ()))  # the body itself was checked to be a JSON object (json_problem)
    # Keep field names and list indices; drop "body" and pydantic's names of union alternatives.
    where = ".".join(str(p) for p in loc[1:] if isinstance(p, int) or (p.isidentifier() and p not in _TYPE_TAGS))
    return APIError(400, f"{where + ': ' if where else ''}{first['msg']}", param=where or None, code=first.get("type"))
