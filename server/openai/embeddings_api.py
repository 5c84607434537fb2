"""POST /v1/embeddings (and the embedding half of Ollama's /api/embed): pooled hidden states of the model
served, each input a prefill-only request through the same fair scheduler (SamplingParams.pooling)."""

from __future__ import annotations

import base64
import json
from contextlib import aclosing

import numpy as np
from aiohttp import web

from scheduler import SamplingParams
from server.auth import Tenant, check_key, user_tenant
from server.errors import bad_request
from server.openai.generation import Generation, Prepared, check_model
from server.openai.protocol import GenerationRequest
from server.schema.request_fields import EMBEDDINGS
from server.state import ServerState, off_loop, parse_json, read_body

REPLY_BYTES_PER_INPUT = 8192
"""About how many bytes of a reply one vector makes, to decide where it is built (state.off_loop)."""


async def embeddings(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    state.check_accepting()
    keyed = check_key(state.api_keys, request.headers.get("Authorization"))
    raw = await read_body(request)
    v, prepared = await off_loop(len(raw), _prepare, state, raw, keyed)
    vectors = await embed(request, state, prepared)

    def reply() -> bytes:
        data = [
            {"object": "embedding", "index": i, "embedding": _encoded(vector, v["encoding_format"])}
            for i, vector in enumerate(vectors)
        ]
        tokens = sum(len(ids) for ids in prepared.prompt_ids)
        body = {
            "object": "list",
            "data": data,
            "model": state.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return json.dumps(body).encode()

    body = await off_loop(len(vectors) * REPLY_BYTES_PER_INPUT, reply)
    return web.Response(body=body, content_type="application/json")


def _prepare(state: ServerState, raw: bytes, keyed: Tenant | None) -> tuple[dict, Prepared]:
    v = EMBEDDINGS.read(parse_json(raw))
    check_model(state, v["model"])
    hidden = state.client.model_card.get("hidden_size")
    if v["dimensions"] is not None and v["dimensions"] != hidden:
        raise bad_request(
            f"'dimensions' {v['dimensions']} is not supported: this model's embeddings have {hidden} "
            f"dimensions and are not shortened; leave 'dimensions' out (or send {hidden})",
            "dimensions",
        )
    tenant = keyed or user_tenant(state.api_keys, v["user"])
    return v, prepare_inputs(state, v["input"], v["pooling"], tenant, "input")


def prepare_inputs(
    state: ServerState, inputs, pooling: str, tenant: Tenant, field: str, truncate: bool = False
) -> Prepared:
    """Each input (text or token ids) tokenized and checked against the context, as one request's prompts.
    truncate: an input longer than the context is cut to it (Ollama's default) instead of refused."""
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    tokenizer = state.client.tokenizer
    context = state.client.max_model_len - 1  # the engine's admission leaves room for one token
    vocab = state.client.vocab_size
    ids = []
    for i, item in enumerate(inputs):
        where = field if len(inputs) == 1 else f"{field}[{i}]"
        tokens = tokenizer.encode(item) if isinstance(item, str) else item
        if not tokens:
            raise bad_request(f"'{where}' holds no tokens; send some text", where)
        if len(tokens) > context:
            if not truncate:
                raise bad_request(
                    f"'{where}' is {len(tokens)} tokens, more than the {context} this model embeds at once",
                    where,
                    "context_length_exceeded",
                )
            tokens = tokens[-context:]
        if not all(0 <= t < vocab for t in tokens):
            raise bad_request(
                f"'{where}' holds token ids outside this model's vocabulary [0, {vocab})", where
            )
        ids.append(tokens)
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
    req = GenerationRequest(
        prompt=ids[0],
        params=params,
        stream=False,
        include_usage=False,
        user=None,
        priority=0,
        model=None,
        max_tokens_given=True,
        prompts=ids,
    )
    return Prepared(req, tenant, ids, [""] * len(ids), chat=False)


async def embed(request: web.Request, state: ServerState, prepared: Prepared) -> list[list[float]]:
    """Each input's normalised vector, in order (the engine runs them as one batch of prefills)."""
    gen = Generation(request, state, prepared, "embd-")
    async with aclosing(gen.deltas()) as outputs:
        async for _ in outputs:
            pass
    return [c.out.embedding for c in gen.ordered]


def _encoded(vector: list[float], encoding: str):
    if encoding == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
