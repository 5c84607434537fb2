"""The offline engine: a model, its KV pool and a scheduler, driven one step at a time.

Each step the scheduler plans who runs and how many tokens each; the model
runner turns that plan into tensors and samples; the scheduler then books the
new tokens (stops, frees blocks, charges tenants). Stop strings are found here
because they need the detokenizer.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, replace

import torch

from runtime.attention import AttentionMetadata, PrefillChunk
from runtime.checkpoint import load_checkpoint
from runtime.detokenizer import Detokenizer
from runtime.device import resolve_device, resolve_dtype
from runtime.kv_cache import KVCache, bytes_per_block
from runtime.logprobs import TokenLogprob
from runtime.model import LlamaModel
from runtime.model_runner import ModelRunner
from runtime.outputs import RequestOutput
from runtime.quantization import resolve_quantization
from runtime.tokenizer import Tokenizer
from scheduler import Request, RequestStatus, SamplingParams, Scheduler, SchedulerConfig
from scheduler.sampling_params import SEED_RANGE

DEFAULT_KV_CACHE_BYTES = 1 << 30
log = logging.getLogger("prescient.engine")


@dataclass
class _Tracked:
    request: Request
    detokenizer: Detokenizer
    token_times: list[float]
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    group_id: str = ""
    """The id the caller gave: that of sequence 0 of the request's n."""


class Engine:
    def __init__(self, model: LlamaModel, tokenizer: Tokenizer, *, num_blocks: int,
                 block_size: int = SchedulerConfig.block_size,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512, policy: str = "vtc",
                 max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 model_name: str | None = None):
        """An engine over an already loaded model; from_pretrained is the usual way in."""
        self.model = model
        self.tokenizer = tokenizer
        self.kv = KVCache(model.config, num_blocks, block_size, model.dtype, model.device)
        self.max_model_len = min(max_model_len or model.config.max_model_len, model.config.max_model_len)
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=self.max_model_len, policy=policy,
            enable_prefix_caching=enable_prefix_caching))
        self.runner = ModelRunner(model, self.kv)
        self.model_name = model_name or model.config.name
        self._tracked: dict[str, _Tracked] = {}
        """Every unfinished sequence by its own id (sequence j > 0 of request R is 'R#j')."""
        self._groups: dict[str, list[str]] = {}
        """Request id -> the ids of its n sequences."""
        self._ids = itertools.count()

    @classmethod
    def from_pretrained(cls, model: str | None = None, dtype: str | torch.dtype | None = None,
                        device: str | None = None, kv_cache_bytes: int | None = None,
                        max_num_seqs: int = 64, max_num_batched_tokens: int | None = None,
                        policy: str = "vtc", block_size: int = SchedulerConfig.block_size,
                        max_model_len: int | None = None,
                        enable_prefix_caching: bool = True, num_threads: int | None = None,
                        quantization: str | None = None) -> "Engine":
        """model: None for the default SmolLM2-135M-Instruct GGUF, a .gguf file, or a Hugging Face directory.
        dtype: 'auto' (CUDA: bfloat16; CPU: the dtype that measured fastest here), 'bfloat16' or 'float32'.
        kv_cache_bytes: the KV pool's size in bytes (default 1 GiB).
        quantization: 'auto' (default: a GGUF's Q4_0/Q4_1/Q8_0 blocks run packed where that is fast, i.e.
        bfloat16 on CPU), 'none' (dequantize), 'gguf' (always packed), 'int8' / 'int4' (quantize on load)."""
        torch_device = resolve_device(device)
        dtype = resolve_dtype(dtype, torch_device)
        quantization = resolve_quantization(quantization, dtype, torch_device)
        if num_threads:
            torch.set_num_threads(num_threads)
        for name, value in (("max_num_seqs", max_num_seqs), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if kv_cache_bytes is None:
            kv_cache_bytes = DEFAULT_KV_CACHE_BYTES
        if not isinstance(kv_cache_bytes, int) or kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes: must be a positive number of bytes, got {kv_cache_bytes!r}")
        budget = 512 if max_num_batched_tokens is None else max_num_batched_tokens
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise ValueError(f"max_num_batched_tokens: must be a positive integer, got {budget!r}")

        ckpt = load_checkpoint(model)
        config = ckpt.config
        tokenizer = Tokenizer(ckpt.tokenizer)
        net = LlamaModel(config, ckpt.weights, dtype, torch_device, quantization)
        del ckpt
        return cls(net, tokenizer, num_blocks=kv_cache_bytes // bytes_per_block(config, block_size, dtype),
                   block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                   policy=policy, max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching)

    # ---- requests -------------------------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    *, tenant: str = "default", weight: float = 1.0, priority: int = 0,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> Request:
        """Validate and queue one request; raises ValueError naming the offending field.
        cache_salt: the prefix-cache namespace (default: the tenant's own, see Request.cache_salt)."""
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._tracked:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        ids = self.check_request(prompt, params)
        if not weight > 0:
            raise ValueError(f"weight: must be positive, got {weight!r}")
        if params.n > 1 and any(f"{request_id}#{j}" in self._tracked for j in range(1, params.n)):
            raise ValueError(f"request_id: {request_id!r} collides with another request's sequence ids")
        request = Request(request_id, ids, params, eos_token_id=self.tokenizer.eos_token_id, tenant=tenant,
                          weight=weight, priority=priority, cache_salt=cache_salt)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        # Sequences 1..n-1 fork from this one once its prompt is computed; each has its own seed stream.
        for j in range(1, params.n):
            seed = None if params.seed is None else params.seed + j
            if seed is not None and seed >= SEED_RANGE[1]:
                seed -= 1 << 64   # stay in what a generator takes
            child_params = replace(params, n=1, prompt_logprobs=None, seed=seed)
            request.forks.append(Request(f"{request_id}#{j}", ids, child_params,
                                         eos_token_id=request.eos_token_id, tenant=tenant, weight=weight,
                                         priority=priority, index=j, arrival_time=request.arrival_time,
                                         cache_salt=request.cache_salt))
        self.scheduler.add_request(request)
        self._groups[request_id] = [request_id] + [child.request_id for child in request.forks]
        for seq in [request, *request.forks]:
            p = seq.sampling_params
            self._tracked[seq.request_id] = _Tracked(seq, Detokenizer(self.tokenizer, p.stop), [],
                                                     [] if p.logprobs is not None else None,
                                                     [None] if p.prompt_logprobs is not None else None,
                                                     group_id=request_id)
            self.runner.add_request(seq)
        return request

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole KV cache holds: the longest sequence it can run, whatever the context length."""
        return self.kv.num_blocks * self.kv.block_size

    def check_request(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids, or ValueError if the request can never run. Safe from any thread."""
        ids = self._prompt_ids(prompt)
        limit = self.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt: {len(ids)} tokens does not fit this model's context of {limit} tokens "
                             f"(and at least one token must be generated)")
        if len(ids) + params.max_tokens > limit:
            raise ValueError(f"max_tokens: this model's maximum context length is {limit} tokens, but "
                             f"{len(ids)} prompt tokens + max_tokens {params.max_tokens} = "
                             f"{len(ids) + params.max_tokens}; lower max_tokens to at most {limit - len(ids)}")
        capacity = self.kv_capacity_tokens
        if len(ids) + params.max_tokens > capacity:
            raise ValueError(f"max_tokens: prompt ({len(ids)}) + max_tokens ({params.max_tokens}) exceeds the "
                             f"KV cache's capacity of {capacity} tokens; raise kv_cache_bytes or lower max_tokens")
        return ids

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            vocab = self.model.config.vocab_size
            for i, t in enumerate(ids):
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise ValueError(f"prompt: token {i} is {t!r}, not a token id in [0, {vocab})")
        else:
            raise ValueError(f"prompt: must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt: must not be empty")
        return ids

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request (all its n sequences) now and free its KV blocks; returns the output of its
        sequence 0 (None if unknown)."""
        first = None
        for seq_id in self._groups.pop(request_id, []):
            tracked = self._tracked.pop(seq_id, None)
            if tracked is None:
                continue   # that sequence had finished
            self.scheduler.abort_request(seq_id)
            self.runner.remove_request(seq_id)
            tracked.request.finished_time = tracked.request.finished_time or time.monotonic()
            out = self._output(tracked)
            first = first or out
        return first

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step loop --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns an output for every request that got a token or finished."""
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        try:
            result = self.runner.execute(plan)
        except Exception as exc:   # the model or the sampler failed: fail this step's requests only
            log.exception("engine step failed; failing its %d requests: %s", len(plan.scheduled),
                          ", ".join(r.request_id for r, _ in plan.scheduled))
            groups = dict.fromkeys(self._tracked[r.request_id].group_id for r, _ in plan.scheduled)
            return [self._fail(group, exc) for group in groups]
        sampled = result.sampled
        now = time.monotonic()
        for request_id, scores in result.prompt_logprobs.items():
            kept = self._tracked[request_id].prompt_logprobs
            for pos, score in scores:
                if pos == len(kept):   # a recompute after preemption repeats positions
                    kept.append(score)
        lengths = {rid: self._tracked[rid].request.num_output_tokens for rid in result.logprobs}
        finished = self.scheduler.update_from_output(plan, sampled)
        for request_id, score in result.logprobs.items():
            tracked = self._tracked[request_id]
            if tracked.request.num_output_tokens > lengths[request_id]:   # the scheduler took the token
                tracked.logprobs.append(score)
        done = {r.request_id for r in finished}
        outputs = []
        for request_id in sampled:
            tracked = self._tracked[request_id]
            tracked.token_times.append(now)
            req = tracked.request
            try:
                stopped = tracked.detokenizer.update(req.output_token_ids, req.is_finished)
            except Exception as exc:
                log.exception("detokenizing request %s failed", request_id)
                done.discard(request_id)
                outputs.append(self._fail(request_id, exc))
                continue
            if stopped:
                if not req.is_finished:
                    self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED,
                                                  tracked.detokenizer.stop_reason)
                else:
                    req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = tracked.detokenizer.stop_reason
                done.add(request_id)
            outputs.append(self._output(tracked))
        for request_id in done:
            tracked = self._tracked.pop(request_id, None)
            self.runner.remove_request(request_id)
            group = self._groups.get(tracked.group_id) if tracked else None
            if group is not None and not any(seq in self._tracked for seq in group):
                del self._groups[tracked.group_id]
        return outputs

    def _fail(self, request_id: str, exc: BaseException) -> RequestOutput:
        """Abort a request whose step raised; its output is final and names the cause in `error`."""
        out = self.abort_request(request_id)
        out.error = f"{type(exc).__name__} in the engine step"
        return out

    def _output(self, tracked: _Tracked) -> RequestOutput:
        req = tracked.request
        return RequestOutput(
            request_id=tracked.group_id, index=req.index, prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids), text=tracked.detokenizer.text,
            finished=req.is_finished, finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            num_cached_tokens=max(req.num_cached_tokens, 0), arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time, first_token_time=req.first_token_time,
            finished_time=req.finished_time, token_times=list(tracked.token_times),
            num_preemptions=req.num_preemptions,
            logprobs=list(tracked.logprobs) if tracked.logprobs is not None else None,
            prompt_logprobs=list(tracked.prompt_logprobs) if tracked.prompt_logprobs is not None else None)

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion (continuous batching); outputs in the order of the prompts, and
        for a prompt with n > 1 its n sequences in order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if isinstance(params, list) and len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} SamplingParams for {len(prompts)} prompts")
        ids = []
        for i, prompt in enumerate(prompts):
            p = params[i] if isinstance(params, list) else params
            ids.append(self.add_request(f"generate-{next(self._ids)}", prompt, p).request_id)
        widths = [(params[i] if isinstance(params, list) else params or SamplingParams()).n for i in range(len(ids))]
        keys = [(request_id, j) for request_id, n in zip(ids, widths) for j in range(n)]
        results: dict[tuple[str, int], RequestOutput] = {}
        while len(results) < len(keys):
            if not self.has_unfinished_requests():
                raise RuntimeError("engine: requests vanished without finishing")
            for out in self.step():
                if out.finished:
                    results[out.request_id, out.index] = out
        return [results[k] for k in keys]

    @torch.inference_mode()
    def prompt_logits(self, prompt: str | list[int]) -> torch.Tensor:
        """float32 logits [len(prompt), vocab] of every prompt position, computed in a scratch KV
        pool outside the scheduler (for scoring and for checking against other implementations)."""
        ids = self._prompt_ids(prompt)
        bs = self.kv.block_size
        num_blocks = (len(ids) + bs - 1) // bs
        scratch = KVCache(self.model.config, num_blocks, bs, self.model.dtype, self.model.device)
        device = self.model.device
        meta = AttentionMetadata(slot_mapping=torch.arange(len(ids), device=device),
                                 prefills=[PrefillChunk(0, len(ids), len(ids),
                                                        torch.arange(num_blocks, device=device))])
        hidden = self.model.forward(torch.tensor(ids, device=device), torch.arange(len(ids), device=device),
                                    meta, scratch)
        return self.model.logits(hidden)

    def stats(self) -> dict:
        return self.scheduler.stats()
