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
from dataclasses import replace

import torch

from runtime.attention.kv_cache import KVCache, bytes_per_block
from runtime.attention.metadata import ScheduledRows
from runtime.config import EngineConfig
from runtime.device import resolve_device, resolve_dtype
from runtime.engine.cpu_share import CpuShare
from runtime.engine.output_tracker import OutputTracker
from runtime.engine.outputs import OutputDelta, RequestOutput
from runtime.engine.request_checks import RequestChecks
from runtime.model.checkpoint import load_checkpoint
from runtime.model.model import LlamaModel
from runtime.model.tokenizer import Tokenizer
from runtime.quant.resolve import resolve_quantization
from runtime.runner.model_runner import ModelRunner, ModelRunnerOutput
from runtime.sample.grammar_compiler import GrammarCompiler
from runtime.spec_decode import Speculator
from runtime.spec_decode.draft_model import DraftModel
from scheduler import (
    InvalidRequestError,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerOutput,
    SchedulerStats,
)
from scheduler.runner_view import plans_alone
from scheduler.sampling_params import SEED_RANGE

log = logging.getLogger("prescient.engine")

MAX_GRAPH_TOKENS = 512
"""CUDA graphs are captured for steps of up to this many tokens: a larger step's own GPU work outweighs its
launches, and every captured size costs capture time and graph memory."""


class Engine:
    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        *,
        model_name: str | None = None,
        **settings,
    ):
        """An engine over an already loaded model; from_pretrained is the usual way in.

        settings: EngineConfig fields by name (e.g. num_blocks=256, max_num_seqs=8), over `config`.
        Without num_blocks, the KV pool takes cache.kv_cache_bytes."""
        config = (config or EngineConfig()).replace(**settings)
        sched = config.scheduler
        num_blocks = sched.num_blocks
        if num_blocks is None:
            block_bytes = bytes_per_block(model.config, sched.block_size, model.dtype)
            num_blocks = config.cache.kv_cache_bytes // block_bytes
        self.model = model
        self.tokenizer = tokenizer
        self._eog_token_ids = tuple(t for t in tokenizer.eog_token_ids if t != tokenizer.eos_token_id)
        """Tokens that end a generation besides EOS (Tokenizer.eog_token_ids: Gemma's <end_of_turn>, Llama
        3's <|eot_id|> / <|eom_id|>); every request stops on them, unless ignore_eos."""
        graphs = model.device.type == "cuda" and not config.model.enforce_eager
        self.kv = KVCache(
            model.config, num_blocks, sched.block_size, model.dtype, model.device, scratch=graphs
        )
        context = model.config.max_model_len
        sched = replace(
            sched, num_blocks=num_blocks, max_model_len=min(sched.max_model_len or context, context)
        )
        self.config = replace(config, scheduler=sched)
        self.max_model_len = sched.max_model_len
        self.vocab_size = model.config.vocab_size
        self.admission = sched.admission  # the one rule, over this pool and context
        self.checks = RequestChecks(tokenizer, self.vocab_size, self.admission, model.config.card())
        self.scheduler = Scheduler(sched)
        self.cpu = CpuShare(
            config.parallel.num_threads,
            adaptive=config.parallel.adaptive_threads and model.device.type == "cpu",
        )
        self.grammar = GrammarCompiler(tokenizer, self.vocab_size)
        self.runner = ModelRunner(
            model,
            self.kv,
            self.grammar,
            graph_tokens=min(sched.max_num_batched_tokens, MAX_GRAPH_TOKENS) if graphs else 0,
            max_num_seqs=sched.max_num_seqs,
            max_model_len=self.max_model_len,
        )
        self.model_name = model_name or model.config.name
        self.outputs = OutputTracker(tokenizer)
        spec = self.config.speculative.speculative_config
        draft = None
        if spec is not None and spec.method == "draft_model":
            draft = DraftModel(spec.model, model, tokenizer, num_blocks * sched.block_size, sched.block_size)
        self.speculator = Speculator(spec, draft) if spec is not None else None
        """Proposes tokens for the running requests to verify (None: speculative decoding is off)."""
        self._ids = itertools.count()

    @classmethod
    def from_pretrained(
        cls, model: str | None = None, config: EngineConfig | None = None, **settings
    ) -> Engine:
        """Load a checkpoint and build an engine over it.

        model: None for the default SmolLM2-135M-Instruct GGUF, a .gguf file, or a Hugging Face directory.
        config: an EngineConfig (default EngineConfig()); settings: any of its fields by name over it,
        e.g. dtype="float32", kv_cache_bytes="256MiB", max_num_seqs=8 (see runtime/config.py)."""
        config = (config or EngineConfig()).replace(model=model, **settings)
        torch_device = resolve_device(config.model.device)
        dtype = resolve_dtype(config.model.dtype, torch_device)
        quantization = resolve_quantization(
            config.model.quantization, dtype, torch_device, dtype_chosen=config.model.dtype in (None, "auto")
        )
        if config.parallel.num_threads:
            torch.set_num_threads(config.parallel.num_threads)
        ckpt = load_checkpoint(config.model.model)
        tokenizer = Tokenizer(ckpt.tokenizer)
        net = LlamaModel(
            ckpt.config,
            ckpt.weights,
            dtype,
            torch_device,
            quantization,
            dense_copy_bytes=config.model.dense_copy_bytes,
        )
        del ckpt
        return cls(net, tokenizer, config)

    # ---- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        tenant: str = "default",
        weight: float = 1.0,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Admit and queue one request; raises InvalidRequestError (a ValueError) naming the field.
        cache_salt: the prefix-cache namespace (default: the tenant's own, see Request.cache_salt)."""
        ids, params = self.checks.admit(prompt, params or SamplingParams(), weight=weight)
        return self.enqueue(
            request_id,
            ids,
            params,
            tenant=tenant,
            weight=weight,
            priority=priority,
            arrival_time=arrival_time,
            cache_salt=cache_salt,
        )

    def admit(
        self, prompt: str | list[int], params: SamplingParams, *, clamp_max_tokens: bool = False
    ) -> tuple[list[int], SamplingParams]:
        """Its prompt ids and its params with max_tokens resolved, or InvalidRequestError naming the
        field: RequestChecks.admit (runtime/engine/request_checks.py), safe from any thread."""
        return self.checks.admit(prompt, params, clamp_max_tokens=clamp_max_tokens)

    def enqueue(
        self,
        request_id: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        tenant: str = "default",
        weight: float = 1.0,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a request that admit() accepted (an engine client admits on its caller's thread). A request
        with a grammar waits for its compile (off the step) before it is scheduled."""
        request_id = str(next(self._ids)) if request_id is None else request_id
        if params.n > 1 and self.outputs.collides(request_id, params.n):
            raise InvalidRequestError(
                "request_id", f"{request_id!r} collides with another request's sequence ids"
            )
        request = Request(
            request_id,
            prompt_ids,
            params,
            eos_token_id=self.tokenizer.eos_token_id,
            eog_token_ids=self._eog_token_ids,
            tenant=tenant,
            weight=weight,
            priority=priority,
            cache_salt=cache_salt,
        )
        if arrival_time is not None:
            request.arrival_time = arrival_time
        # Sequences 1..n-1 fork from this one once its prompt is computed; each has its own seed stream.
        for j in range(1, params.n):
            seed = None if params.seed is None else params.seed + j
            if seed is not None and seed >= SEED_RANGE[1]:
                seed -= 1 << 64  # stay in what a generator takes
            child_params = replace(params, n=1, prompt_logprobs=None, seed=seed)
            request.forks.append(
                Request(
                    f"{request_id}#{j}",
                    prompt_ids,
                    child_params,
                    eos_token_id=request.eos_token_id,
                    eog_token_ids=request.eog_token_ids,
                    tenant=tenant,
                    weight=weight,
                    priority=priority,
                    index=j,
                    arrival_time=request.arrival_time,
                    cache_salt=request.cache_salt,
                )
            )
        self.scheduler.add_request(request, admitted=True, ready=params.structured_output is None)
        self.outputs.add(request)  # the scheduler refused an id in use above
        if params.structured_output is not None:
            self.grammar.start(request_id, params.structured_output)
        return request

    def abort_request(self, request_id: str) -> OutputDelta | None:
        """Stop a request (all its n sequences) now and free its KV blocks; returns the final delta of
        its sequence 0 (None if unknown)."""
        first = None
        self.grammar.forget(request_id)
        for tracked in self.outputs.pop_group(request_id):
            self.scheduler.abort_request(
                tracked.request.request_id
            )  # the runner forgets it with the next plan
            tracked.request.finished_time = tracked.request.finished_time or time.monotonic()
            if self.speculator is not None:
                self.speculator.finish(tracked.request)
            first = first or tracked.delta()
        return first

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step loop --------------------------------------------------------------------------

    def step(self) -> list[OutputDelta]:
        """Run one iteration; returns a delta for every sequence that got a token, released text or finished:
        only what is new, so a step costs the same whatever the outputs' lengths."""
        self.cpu.before_step()
        outputs = self._admit_compiled()
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            self.runner.update_states(plan)  # still forget what finished
            if not outputs:
                self.grammar.wait()
            return outputs
        result = self._execute(plan, outputs)
        sampled = result.sampled
        now = time.monotonic()
        self.outputs.add_prompt_logprobs(result.prompt_logprobs)
        finished = self.scheduler.update_from_output(plan, sampled)
        done = {r.request_id for r in finished}
        for request_id in sampled:
            tracked = self.outputs.tracked.get(request_id)
            if tracked is None:  # a sibling of a sequence whose step failed: its request is gone
                continue
            req = tracked.request
            try:
                new_ids, new_text = tracked.take_new()
            except Exception as exc:
                log.exception("detokenizing request %s failed", request_id)
                done.discard(request_id)
                outputs.append(self._fail(tracked.group_id, exc))
                continue
            if tracked.detokenizer.stop_reason is not None:
                # a stop string inside a run of accepted proposals ends the output at the token completing it
                self.scheduler.truncate_output(req, tracked.num_sent)
                self.scheduler.stop_request(req, tracked.detokenizer.stop_reason)
                done.add(request_id)
            if new_ids or new_text or req.is_finished:
                new_logprobs = None
                if req.sampling_params.logprobs is not None:
                    score = result.logprobs.get(request_id)
                    if type(score) is not list:
                        score = [] if score is None else [score]
                    new_logprobs = score[: len(new_ids)]
                delta = tracked.delta(new_ids, new_text, [now] * len(new_ids), new_logprobs)
                delta.embedding = result.embeddings.get(request_id)
                outputs.append(delta)
        for request_id in done:
            self.outputs.finish(request_id)
        if self.speculator is not None:
            self._speculate(plan, sampled, finished, done)
        return outputs

    def _speculate(
        self, plan: SchedulerOutput, sampled: dict, finished: list[Request], done: set[str]
    ) -> None:
        """Book how the step's proposals fared, forget finished requests, propose for the next step."""
        speculator = self.speculator
        for request_id, drafts in plan.spec_token_ids.items():
            tokens = sampled.get(request_id)
            if type(tokens) is list:
                speculator.observe(request_id, len(drafts), len(tokens) - 1)
        for request, _ in plan.scheduled:
            if request.is_finished:
                speculator.finish(request)
        speculator.propose(self.scheduler.running, self.runner.legal_prefix)

    def _execute(self, plan: SchedulerOutput, failed: list[OutputDelta]) -> ModelRunnerOutput:
        """Run the plan. If the step raises, run each of its requests alone, so that only the one(s) whose
        own step raises fail (their final deltas go to `failed`) and the others go on as if nothing
        happened: the runner rebuilds each one's state from the scheduler's, which the failed step did
        not change."""
        try:
            return self.runner.execute(plan)
        except Exception as exc:
            if len(plan.scheduled) == 1:
                request_id = plan.scheduled[0][0].request_id
                log.exception("engine step failed; failing request %s", request_id)
                failed.append(self._fail(self.outputs.tracked[request_id].group_id, exc))
                return ModelRunnerOutput()
            log.exception("engine step of %d requests failed; running each alone", len(plan.scheduled))
        merged = ModelRunnerOutput()
        for alone in plans_alone(plan):
            request_id = alone.scheduled[0][0].request_id
            tracked = self.outputs.tracked.get(request_id)
            if tracked is None:  # failed already, with a sibling sequence of its request
                continue
            try:
                result = self.runner.execute(alone)
            except Exception as exc:
                log.exception("request %s fails its step alone; failing it", request_id)
                failed.append(self._fail(tracked.group_id, exc))
                continue
            merged.sampled.update(result.sampled)
            merged.logprobs.update(result.logprobs)
            merged.prompt_logprobs.update(result.prompt_logprobs)
            merged.embeddings.update(result.embeddings)
        return merged

    def _fail(self, request_id: str, exc: BaseException) -> OutputDelta:
        """Abort a request (all its n sequences: request_id is the caller's) whose step raised; its delta is
        final and names the cause in `error`."""
        out = self.abort_request(request_id)
        out.error = f"{type(exc).__name__} in the engine step"
        return out

    def _admit_compiled(self) -> list[OutputDelta]:
        """Hand the scheduler the requests whose grammar is now compiled; fail those whose compile raised."""
        ready, failed = self.grammar.compiled()
        for request_id in ready:
            self.scheduler.grammar_ready(request_id)
        outputs = []
        for request_id, exc in failed:
            log.error("compiling the grammar of request %s failed: %s", request_id, exc)
            out = self.abort_request(request_id)
            out.error = f"{type(exc).__name__} while compiling the grammar"
            outputs.append(out)
        return outputs

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion (continuous batching); outputs in the order of the prompts, and
        for a prompt with n > 1 its n sequences in order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        if isinstance(params, list) and len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} SamplingParams for {len(prompts)} prompts")
        ids = []
        for i, prompt in enumerate(prompts):
            p = params[i] if isinstance(params, list) else params
            ids.append(self.add_request(f"generate-{next(self._ids)}", prompt, p).request_id)
        widths = [
            (params[i] if isinstance(params, list) else params or SamplingParams()).n for i in range(len(ids))
        ]
        keys = [(request_id, j) for request_id, n in zip(ids, widths) for j in range(n)]
        prompt_ids = {rid: self.outputs.tracked[rid].request.prompt_token_ids for rid in ids}
        results = {(rid, j): RequestOutput(rid, prompt_ids[rid], index=j) for rid, j in keys}
        unfinished = len(keys)
        while unfinished:
            if not self.has_unfinished_requests():
                raise RuntimeError("engine: requests vanished without finishing")
            for delta in self.step():
                unfinished -= results[delta.request_id, delta.index].append(delta).finished
        return list(results.values())

    @torch.inference_mode()
    def prompt_logits(self, prompt: str | list[int]) -> torch.Tensor:
        """float32 logits [len(prompt), vocab] of every prompt position, computed in a scratch KV
        pool outside the scheduler (for scoring and for checking against other implementations)."""
        ids = self.checks.prompt_ids(prompt)
        bs = self.kv.block_size
        num_blocks = (len(ids) + bs - 1) // bs
        scratch = KVCache(self.model.config, num_blocks, bs, self.model.dtype, self.model.device)
        device = self.model.device
        prompt = ScheduledRows(list(range(num_blocks)), 0, len(ids))
        meta = self.runner.attention.build([], [prompt], torch.arange(len(ids), device=device), bs, device)
        hidden = self.model.forward(
            torch.tensor(ids, device=device), torch.arange(len(ids), device=device), meta, scratch
        )
        return self.model.logits(hidden)

    def describe(self) -> str:
        """One line for the log: model, dtype, device, KV pool, context, policy."""
        sched = self.config.scheduler
        return (
            f"model {self.model_name} ({self.model.dtype}, {self.model.device}): {self.kv.num_blocks} KV "
            f"blocks of {self.kv.block_size} tokens, context {self.max_model_len}, policy {sched.policy}, "
            f"{self.cpu.describe()}"
        )

    def stats(self) -> SchedulerStats:
        return replace(
            self.scheduler.stats(),
            cpu_threads=self.cpu.threads,
            cpu_split=self.cpu.split,
            cpu_contention=self.cpu.contention,
        )
