"""One returned sequence of a completion (prompt i, sample j) and what the response says of it: its
choice object, the usage of them all, and best_of's pick.

Used by both the whole response (final_choice) and the stream (server/openai/stream_chunks.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime import OutputDelta, RequestOutput
from server.errors import bad_request
from server.openai.logprobs_format import chat_logprobs, completion_logprobs, merge_completion_logprobs
from server.openai.protocol import GenerationRequest
from server.state import ServerState
from server.tools.tool_calls import extract_tool_calls, parses_tool_calls


@dataclass
class Choice:
    """One returned sequence: prompt i's sample j, assembled from its deltas, and what has been streamed."""

    index: int
    prompt_ids: list[int]
    prompt_text: str
    out: RequestOutput | None = None
    """None until its first delta arrives."""
    tool_stream: object | None = None
    """Its ToolCallStream (server/tools/tool_call_stream.py) when a streamed chat may call tools."""
    sent_offset: int = 0
    """text_offset of the next streamed completion token."""
    started: bool = False
    echo_only: bool = False


def assemble(choice: Choice, delta: OutputDelta) -> Choice:
    """Add an engine delta of this choice's sequence to its output."""
    if choice.out is None:
        choice.out = RequestOutput(delta.request_id, choice.prompt_ids, index=delta.index)
    choice.out.append(delta)
    return choice


def usage(choices: list[Choice], outs: list[RequestOutput]) -> dict:
    prompts = {id(c.prompt_ids): c for c in choices}.values()  # each prompt counted once, whatever n is
    prompt = sum(len(c.prompt_ids) for c in prompts)
    completion = sum(len(generated(c, o)[0]) for c, o in zip(choices, outs))
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    cached = sum(o.num_cached_tokens for o in {id(c.prompt_ids): o for c, o in zip(choices, outs)}.values())
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def generated(choice: Choice, out: RequestOutput) -> tuple[list[int], str]:
    """Token ids and text the client sees as generated (none when only the prompt is scored)."""
    return ([], "") if choice.echo_only else (out.token_ids, out.text)


def choice_finish_reason(choice: Choice, out) -> str | None:
    """The choice's finish_reason: the sequence's, except that a prompt only scored (echo, max_tokens 0) ends
    by its limit, 'length', whatever the token sampled and dropped was (an eos there made it 'stop' at
    random); an abort stays an abort."""
    reason = out.finish_reason
    return "length" if choice.echo_only and reason == "stop" else reason


def decode_prompt(tokenizer, ids: list[int], i: int) -> str:
    """An echoed token prompt's text (before admission, which would name a bad id the same way)."""
    try:
        return tokenizer.decode(ids)
    except Exception as exc:
        raise bad_request(
            f"'prompt' {i}: not token ids of this model's vocabulary ({type(exc).__name__})", "prompt"
        ) from exc


def best(choices: list[Choice], req: GenerationRequest) -> list[Choice]:
    """best_of: per prompt, the n sequences with the highest mean token logprob, in that order."""
    out = []
    for i in range(len(req.prompts)):
        group = [c for c in choices if c.index // req.best_of == i]
        group.sort(key=lambda c: -sum(s.logprob for s in c.out.logprobs) / max(len(c.out.logprobs), 1))
        out.extend(group[: req.n])
    return out


def final_choice(state: ServerState, req: GenerationRequest, chat: bool, c: Choice, index: int) -> dict:
    out = c.out
    token_ids, text = generated(c, out)
    tok = state.client.tokenizer
    logprobs = None
    if chat:
        if req.logprobs_requested:
            logprobs = chat_logprobs(tok, token_ids, out.logprobs[: len(token_ids)])
        message, finish_reason = {"role": "assistant", "content": text}, out.finish_reason
        if parses_tool_calls(req.tools):
            content, calls = extract_tool_calls(text, req.tools)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        choice = {"index": index, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}
    else:
        if req.logprobs_requested:
            if req.echo:
                logprobs = completion_logprobs(tok, c.prompt_ids, out.prompt_logprobs)
            logprobs = merge_completion_logprobs(
                logprobs,
                completion_logprobs(tok, token_ids, out.logprobs[: len(token_ids)], end_offset(logprobs)),
            )
        choice = {
            "index": index,
            "text": (c.prompt_text if req.echo else "") + text,
            "finish_reason": choice_finish_reason(c, out),
            "logprobs": logprobs,
        }
    if out.stop_reason is not None and not req.echo_only:
        choice["stop_reason"] = out.stop_reason
    return choice


def end_offset(logprobs: dict | None) -> int:
    if not logprobs or not logprobs["tokens"]:
        return 0
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
