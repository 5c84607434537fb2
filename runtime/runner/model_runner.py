"""Turn a scheduler plan into tensors, run the model, sample: one engine step's tensor work.

The runner reads only the plan's narrow view (scheduler/plan.py) and keeps its
own state per sequence: token ids, block table, sampling params, and a seeded
generator that lives as long as the request (a preempted request keeps it).

Rows of the flattened batch: first one token for each decoding sequence (and
after it the tokens it proposed, when it verifies proposals: one decode row
each), then each prefill chunk. Only the rows whose sequence reaches its end
this step (a decode and its proposals, or the last chunk of a prefill) go
through the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.attention.kv_cache import KVCache
from runtime.attention.metadata import AttentionMetadata, ScheduledRows
from runtime.attention.selector import select_backend
from runtime.attention.triton_backend import row_inputs
from runtime.model.decode_layers import run_parts, split_parts
from runtime.model.model import LlamaModel
from runtime.runner.cuda_graphs import StepGraphs, warm_up
from runtime.sample.logits_processors import apply_logits_processors
from runtime.sample.logprobs import token_logprobs
from runtime.sample.rejection_sampler import verify
from runtime.sample.sampler import penalize, sample
from runtime.sample.structured_output import GrammarBackend
from runtime.sample.token_logprob import TokenLogprob
from scheduler import SamplingParams, SchedulerOutput


@dataclass
class _Sequence:
    """What the runner knows of one resident request."""

    token_ids: list[int]
    """Prompt then generated tokens, including those this runner sampled."""
    num_prompt_tokens: int
    block_table: list[int]
    params: SamplingParams
    num_computed_tokens: int = 0
    """As of the current plan: tokens whose K/V are in the cache before this step."""
    eos_token_id: int | None = None
    forks: list[tuple[str, SamplingParams]] = field(default_factory=list)
    """(id, params) of sequences that draw their first token from this one's last prompt row."""
    matcher: object | None = None
    """Its grammar state (an llguidance matcher) when its params ask for structured output."""
    eog_token_ids: tuple[int, ...] = ()
    """End-of-generation tokens besides eos_token_id (banned with it under min_tokens)."""


@dataclass
class _Row:
    """One sampled row: a scheduled sequence, or a fork drawing from its parent's row. A sequence
    verifying k proposed tokens has k + 1 rows, the one at `depth` j following its first j proposals."""

    request_id: str
    params: SamplingParams
    seq: _Sequence
    drafts: list[int] = field(default_factory=list)
    """The proposals before this row (its sequence's first `depth`)."""

    @property
    def depth(self) -> int:
        return len(self.drafts)


@dataclass
class _Work:
    """One scheduled sequence this step."""

    request_id: str
    seq: _Sequence
    num_tokens: int
    """Rows computed, proposed tokens included."""
    drafts: list[int] = field(default_factory=list)
    """Proposed tokens after its last one, verified this step (the last of its rows)."""

    @property
    def end(self) -> int:
        return self.seq.num_computed_tokens + self.num_tokens

    @property
    def samples(self) -> bool:
        """It reaches its last token this step, so it gets a new one (or several)."""
        return self.end - len(self.drafts) == len(self.seq.token_ids)


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int | list[int]] = field(default_factory=dict)
    """request id -> the token sampled for it, for sequences that reached their end this step; for one
    that verified proposals, the list of its accepted proposals and the token after them."""
    logprobs: dict[str, TokenLogprob | list[TokenLogprob]] = field(default_factory=dict)
    """request id -> the sampled token's logprob (a list for a list of tokens), for requests that
    asked (SamplingParams.logprobs)."""
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprob]]] = field(default_factory=dict)
    """request id -> (prompt position, its token's logprob) for the prompt tokens this step computed."""
    embeddings: dict[str, list[float]] = field(default_factory=dict)
    """request id -> its pooled, normalised hidden state, for pooling requests whose prompt ended this step
    (their `sampled` token is a placeholder that only ends them)."""


class ModelRunner:
    verify_as_decode = True
    """A sequence verifying k proposals runs as k + 1 decode rows (the C decode loop on CPU: the weights read
    once for every row of the step); False: as a prefill chunk, as other multi-row sequences (kept to measure
    one against the other, tests/bench/bench_speculative.py)."""

    def __init__(
        self,
        model: LlamaModel,
        kv: KVCache,
        grammar: GrammarBackend | None = None,
        *,
        graph_tokens: int = 0,
        max_num_seqs: int = 1,
        max_model_len: int | None = None,
    ):
        """graph_tokens: on CUDA, steps of up to this many tokens (and max_num_seqs sequences) replay CUDA
        graphs captured now (cuda_graphs.py; needs the Triton attention kernel and a pool with a scratch
        slot); 0: none. max_model_len: the longest context a graph's block tables cover (default: the
        model's)."""
        self.model = model
        self.kv = kv
        self.grammar = grammar
        """Builds and applies structured-output masks; None: no request may ask for them."""
        self.device = model.device
        self.block_size = kv.block_size
        self._seqs: dict[str, _Sequence] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._pooled: dict[str, tuple[torch.Tensor, int]] = {}
        """Mean pooling: request id -> (float32 sum of its prompt rows so far, the next position to add);
        kept across a preemption, whose recompute repeats positions already added."""
        probe = torch.empty(
            1, model.config.num_heads, model.config.head_dim, dtype=model.dtype, device=self.device
        )
        self.attention = select_backend(probe, kv.layer(0)[0])
        """The attention backend, chosen once: the C kernels (CPU), the Triton kernel (CUDA), else PyTorch."""
        self.graphs: StepGraphs | None = None
        if self.device.type == "cuda" and self.attention.capturable:
            warm_up(model, kv)
            if graph_tokens:
                context = max_model_len or model.config.max_model_len
                self.graphs = StepGraphs(model, kv, graph_tokens, max_num_seqs, context)

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: the sampled tokens of sequences that reached their end, and logprobs asked for."""
        self.update_states(plan)
        if plan.block_copies:
            self.kv.copy_blocks(plan.block_copies)
        spec = plan.spec_token_ids
        work = [
            _Work(rid, self._seqs[rid], n, spec.get(rid, []) if spec else [])
            for rid, n in plan.num_scheduled_tokens.items()
        ]
        decodes = [w for w in work if self._decodes(w)]
        prefills = [w for w in work if not self._decodes(w)]
        # the rows' order: each decode's (and its proposals'), then each prefill's chunk
        work = decodes + prefills
        ids, positions, slots = [], [], []
        sample_rows = self.prepare_rows(work, ids, positions, slots)
        scheduled = [ScheduledRows(w.seq.block_table, w.seq.num_computed_tokens, w.end) for w in work]
        if self.graphs is not None and self.graphs.fits(len(ids), len(scheduled)):
            hidden = self.graphs.run(ids, positions, slots, *row_inputs(scheduled, self.block_size))
        else:
            slot_mapping = torch.tensor(slots, device=self.device)
            cut = self._prefill_cut(scheduled, len(decodes))
            if cut is None:
                hidden = self._run_items(ids, positions, slot_mapping, scheduled, len(decodes))
            else:  # two parts of whole sequences, each its own forward on its own thread
                k, rows = cut
                self.model.prepare(max(positions) + 1, self.kv)
                hidden = torch.cat(
                    run_parts(
                        [
                            lambda: self._run_items(
                                ids[:rows], positions[:rows], slot_mapping[:rows], scheduled[:k], len(decodes)
                            ),
                            lambda: self._run_items(
                                ids[rows:],
                                positions[rows:],
                                slot_mapping[rows:],
                                scheduled[k:],
                                max(0, len(decodes) - k),
                            ),
                        ]
                    )
                )
        out = ModelRunnerOutput()
        scored = [
            w for w in prefills if w.seq.params.prompt_logprobs is not None and self._prompt_rows(w) > 0
        ]
        if scored:
            out.prompt_logprobs = self._prompt_logprobs(hidden, prefills, scored)
        if any(w.seq.params.pooling is not None for w in work):  # a one-token prompt counts as a decode
            self._pool(hidden, work, out)
        ending = decodes + [w for w in prefills if w.samples]  # in the order of sample_rows
        to_sample = [w for w in ending if w.seq.params.pooling is None]
        if len(to_sample) < len(ending):  # pooling requests end without a sampled token
            kept, at = [], 0
            for w in ending:  # a verifying sequence has a row per proposal besides its own
                rows_of = 1 + len(w.drafts)
                if w.seq.params.pooling is None:
                    kept.extend(sample_rows[at : at + rows_of])
                at += rows_of
            sample_rows = kept
        if not to_sample:
            return out
        every_row = len(sample_rows) == hidden.shape[0]  # a step that only decodes: no gather
        logits = self.model.logits(hidden if every_row else hidden[sample_rows])
        # a sequence verifying k proposals has k + 1 rows; sequences forked from a request whose prompt
        # ends now draw their first token from its row
        rows, first_row = [], []
        for w in to_sample:
            first_row.append(len(rows))
            rows.extend(
                _Row(w.request_id, w.seq.params, w.seq, w.drafts[:j]) for j in range(len(w.drafts) + 1)
            )
        num_seq_rows = len(rows)
        source = []
        for k, w in enumerate(to_sample):
            if w.seq.num_computed_tokens >= w.seq.num_prompt_tokens:
                continue  # only a prompt's last chunk starts its forks
            for child_id, child_params in w.seq.forks:
                if child_params.seed is not None and child_id not in self._generators:
                    self._generators[child_id] = torch.Generator(self.device).manual_seed(child_params.seed)
                rows.append(_Row(child_id, child_params, w.seq))
                source.append(first_row[k])
        if source:
            logits = torch.cat([logits, logits[source]])
        params = [r.params for r in rows]
        raw = [i for i, p in enumerate(params) if p.logprobs is not None and p.logprobs_mode == "raw"]
        raw_logits = logits[raw].clone() if raw else None
        apply_logits_processors(
            logits,
            params,
            [len(r.seq.token_ids) - r.seq.num_prompt_tokens + r.depth for r in rows],
            [(r.seq.eos_token_id, *r.seq.eog_token_ids) for r in rows],
        )
        if any(r.seq.matcher is not None for r in rows):
            self._apply_grammar(logits, rows)
        histories = None
        if any(p.penalized for p in params):
            histories = [
                (
                    r.seq.token_ids[: r.seq.num_prompt_tokens],
                    r.seq.token_ids[r.seq.num_prompt_tokens :] + r.drafts,
                )
                for r in rows
            ]
        emitted = self._sample(logits, rows, params, histories, to_sample, first_row, num_seq_rows)
        for w, tokens in zip(to_sample, emitted):
            w.seq.token_ids.extend(tokens)
            if w.seq.matcher is not None:
                for token in tokens:
                    self.grammar.accept(w.seq.matcher, token)
        # the row each emitted token came from: a sequence's i-th token from its i-th row
        starts = first_row + list(range(num_seq_rows, len(rows)))
        owners = [rows[r].request_id for r in starts]
        logprob_rows, logprob_tokens, logprob_owner = [], [], []
        verifying = [bool(w.drafts) for w in to_sample] + [False] * (len(rows) - num_seq_rows)
        for owner, start, tokens, spec in zip(owners, starts, emitted, verifying):
            out.sampled[owner] = tokens if spec else tokens[0]
            if params[start].logprobs is not None:
                for i, token in enumerate(tokens):
                    logprob_rows.append(start + i)
                    logprob_tokens.append(token)
                    logprob_owner.append((owner, spec))
        if logprob_rows:
            self._logprobs(out, logits, raw_logits, raw, params, logprob_rows, logprob_tokens, logprob_owner)
        return out

    def _decodes(self, w: _Work) -> bool:
        """It runs as decode rows: its last token, and its proposals when it verifies some (unless
        verify_as_decode is off)."""
        if w.drafts and not self.verify_as_decode:
            return False
        return w.samples and w.num_tokens == 1 + len(w.drafts)

    @torch.inference_mode()
    def _sample(self, logits, rows, params, histories, to_sample, first_row, num_seq_rows) -> list[list[int]]:
        """The tokens each sampled sequence emits (to_sample's, then each fork's): one drawn token, or a
        verifying sequence's accepted proposals and the token after them."""
        spec = [k for k, w in enumerate(to_sample) if w.drafts]
        if not spec:
            tokens = sample(logits, params, [self._generators.get(r.request_id) for r in rows], histories)
            return [[tokens[r]] for r in first_row] + [[t] for t in tokens[num_seq_rows:]]
        spec_rows = {first_row[k] + j for k in spec for j in range(len(to_sample[k].drafts) + 1)}
        plain = [i for i in range(len(rows)) if i not in spec_rows]
        drawn = {}
        if plain:
            sub = logits[plain]
            tokens = sample(
                sub,
                [params[i] for i in plain],
                [self._generators.get(rows[i].request_id) for i in plain],
                [histories[i] for i in plain] if histories is not None else None,
            )
            logits[plain] = sub  # with its penalties, for processed logprobs
            drawn = dict(zip(plain, tokens))
        penalized = [i for i in sorted(spec_rows) if params[i].penalized]
        if penalized:
            penalize(logits, penalized, params, histories)
        verified = verify(
            logits,
            [first_row[k] for k in spec],
            [to_sample[k].drafts for k in spec],
            [to_sample[k].seq.params for k in spec],
            [self._generators.get(to_sample[k].request_id) for k in spec],
        )
        by_seq = dict(zip(spec, verified))
        emitted = [by_seq[k] if k in by_seq else [drawn[first_row[k]]] for k in range(len(to_sample))]
        return emitted + [[drawn[i]] for i in range(num_seq_rows, len(rows))]

    def _logprobs(self, out, logits, raw_logits, raw, params, rows, tokens, owners) -> None:
        """Logprobs of the emitted tokens from the rows that gave them: raw (before any processing) or
        processed (penalties, bias, masks, temperature), as each request's logprobs_mode asks."""
        raw_index = {row: i for i, row in enumerate(raw)}
        scores: list = [None] * len(rows)
        raw_at = [i for i, r in enumerate(rows) if r in raw_index]
        if raw_at:
            got = token_logprobs(
                raw_logits[[raw_index[rows[i]] for i in raw_at]],
                [tokens[i] for i in raw_at],
                [params[rows[i]].logprobs for i in raw_at],
            )
            for i, score in zip(raw_at, got):
                scores[i] = score
        processed = [i for i, r in enumerate(rows) if r not in raw_index]
        if processed:
            # penalties were applied to `logits` in place; temperature divides what it drew from
            scale = torch.tensor(
                [params[rows[i]].temperature or 1.0 for i in processed], device=logits.device
            )
            got = token_logprobs(
                logits[[rows[i] for i in processed]] / scale.unsqueeze(1),
                [tokens[i] for i in processed],
                [params[rows[i]].logprobs for i in processed],
            )
            for i, score in zip(processed, got):
                scores[i] = score
        for (owner, spec), score in zip(owners, scores):
            if spec:
                out.logprobs.setdefault(owner, []).append(score)
            else:
                out.logprobs[owner] = score

    def _apply_grammar(self, logits: torch.Tensor, rows: list[_Row]) -> None:
        """Mask each constrained row by its grammar's state after the proposals before it. A sequence's
        matcher is advanced through its legal proposals (a row after an illegal one needs no mask: that
        proposal is rejected by the row before) and then rolled back."""
        max_depth = max(r.depth for r in rows)
        consumed: dict[int, tuple] = {}
        for depth in range(max_depth + 1):
            at = [
                i
                for i, r in enumerate(rows)
                if r.seq.matcher is not None
                and r.depth == depth
                and (depth == 0 or consumed.get(id(r.seq.matcher), (None, 0))[1] == depth)
            ]
            if at:
                self.grammar.apply_masks(
                    logits, at, [rows[i].seq.matcher for i in at], [rows[i].seq.eos_token_id for i in at]
                )
            for i in at:  # advance each verifying sequence by its next proposal, while its grammar allows
                r = rows[i]
                nxt = i + 1
                if nxt < len(rows) and rows[nxt].seq is r.seq and rows[nxt].depth == depth + 1:
                    m = r.seq.matcher
                    token = rows[nxt].drafts[-1]
                    if not m.is_error() and m.validate_tokens([token]) == 1:
                        m.consume_token(token)
                        consumed[id(m)] = (m, depth + 1)
        for m, n in consumed.values():
            m.rollback(n)

    def _pool(self, hidden: torch.Tensor, work: list[_Work], out: ModelRunnerOutput) -> None:
        """Pooling requests: add this step's prompt rows (mean) or take the last one; where the prompt ends,
        the normalised vector goes to out.embeddings and a placeholder token (eos) ends the request."""
        row = 0
        for w in work:
            first, row = row, row + w.num_tokens
            pooling = w.seq.params.pooling
            if pooling is None:
                continue
            start = w.seq.num_computed_tokens
            if pooling == "mean":
                total, next_pos = self._pooled.get(w.request_id, (None, 0))
                skip = max(next_pos - start, 0)  # a recompute after preemption: rows already added
                if start + skip < w.end:
                    part = hidden[first + skip : row].float().sum(0)
                    total = part if total is None else total + part
                    next_pos = w.end
                self._pooled[w.request_id] = (total, next_pos)
            if not w.samples:
                continue
            if pooling == "mean":
                vector = self._pooled.pop(w.request_id)[0] / w.seq.num_prompt_tokens
            else:
                vector = hidden[row - 1].float()
            vector = torch.nn.functional.normalize(vector, dim=0)
            out.embeddings[w.request_id] = vector.cpu().tolist()
            out.sampled[w.request_id] = w.seq.eos_token_id if w.seq.eos_token_id is not None else 0

    @staticmethod
    def _prompt_rows(w: _Work) -> int:
        """Rows of this chunk whose next token is a prompt token (their logits score it)."""
        return min(w.num_tokens, w.seq.num_prompt_tokens - 1 - w.seq.num_computed_tokens)

    def _prompt_logprobs(self, hidden: torch.Tensor, prefills: list[_Work], scored: list[_Work]) -> dict:
        """Logprobs of prompt tokens from the rows before them (raw logits: nothing edits a prompt)."""
        first_row, row = {}, len(hidden) - sum(w.num_tokens for w in prefills)
        for w in prefills:
            first_row[w.request_id] = row
            row += w.num_tokens
        out = {}
        for w in scored:
            n, start, row = self._prompt_rows(w), w.seq.num_computed_tokens, first_row[w.request_id]
            logits = self.model.logits(hidden[row : row + n])
            targets = w.seq.token_ids[start + 1 : start + 1 + n]
            scores = token_logprobs(logits, targets, [w.seq.params.prompt_logprobs] * n)
            out[w.request_id] = [(start + 1 + i, s) for i, s in enumerate(scores)]
        return out

    def legal_prefix(self, request, tokens: list[int]) -> list[int]:
        """The longest prefix of tokens that the request's grammar allows next (all: no grammar here)."""
        seq = self._seqs.get(request.request_id)
        if seq is None or seq.matcher is None or seq.matcher.is_error():
            return tokens
        return tokens[: seq.matcher.validate_tokens(tokens)]

    def update_states(self, plan: SchedulerOutput) -> None:
        """Bring the per-sequence state up to this plan: forget what left, add what is new, grow tables."""
        for rid in plan.finished_request_ids:
            self._seqs.pop(rid, None)
            self._generators.pop(rid, None)
            self._pooled.pop(rid, None)
        for rid in plan.preempted_request_ids:  # recomputed later from its tokens; its generator stays
            self._seqs.pop(rid, None)
        for new in plan.new_requests:
            structured = new.sampling_params.structured_output
            self._seqs[new.request_id] = _Sequence(
                new.prompt_token_ids + new.output_token_ids,
                len(new.prompt_token_ids),
                list(new.block_ids),
                new.sampling_params,
                new.num_computed_tokens,
                new.eos_token_id,
                list(new.forks),
                # a resumed or forked sequence replays what it generated to reach its grammar state
                self.grammar.matcher(structured, new.output_token_ids) if structured is not None else None,
                tuple(new.eog_token_ids),
            )
            seed = new.sampling_params.seed
            if seed is not None and new.request_id not in self._generators:
                self._generators[new.request_id] = torch.Generator(self.device).manual_seed(seed)
        for cached in plan.cached_requests:
            seq = self._seqs[cached.request_id]
            if cached.num_kept_blocks is not None:  # blocks of rejected proposals were freed
                del seq.block_table[cached.num_kept_blocks :]
            for index, block in cached.replaced_block_ids:  # a copy on write: the copy is its own now
                seq.block_table[index] = block
            seq.block_table.extend(cached.new_block_ids)
            seq.num_computed_tokens = cached.num_computed_tokens

    def prepare_rows(
        self, work: list[_Work], ids: list[int], positions: list[int], slots: list[int]
    ) -> list[int]:
        """Each scheduled sequence's rows (a decode's last token and its proposals, a prefill's chunk): their
        token ids, positions and KV slots; returns the rows to sample (each sequence's last row where it
        ends now, and the rows of its proposals)."""
        bs = self.block_size
        sample_rows = []
        for w in work:
            start, end, table = w.seq.num_computed_tokens, w.end, w.seq.block_table
            ids.extend(w.seq.token_ids[start:end])
            if w.drafts:
                ids.extend(w.drafts)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if w.samples:  # its last row, or all of a verifying sequence's last k + 1
                sample_rows.extend(range(len(ids) - 1 - len(w.drafts), len(ids)))
        return sample_rows

    def _prefill_cut(self, scheduled: list[ScheduledRows], num_decodes: int) -> tuple[int, int] | None:
        """Where the decode rows are split between threads (decode_layers.set_split: other processes share the
        cores), a step that prefills runs as two parts of whole sequences, each on a thread of its own: (the
        first item of the second part, its first row), the cut nearest half the rows; None: one forward."""
        if (
            split_parts() < 2
            or self.device.type != "cpu"
            or len(scheduled) < 2
            or num_decodes == len(scheduled)
        ):
            return None
        counts = [r.end - r.start for r in scheduled]
        total, seen, best = sum(counts), 0, None
        for k in range(1, len(counts)):
            seen += counts[k - 1]
            if best is None or abs(seen - total / 2) < abs(best[1] - total / 2):
                best = (k, seen)
        return best

    def _run_items(
        self,
        ids: list[int],
        positions: list[int],
        slot_mapping: torch.Tensor,
        scheduled: list[ScheduledRows],
        num_decodes: int,
    ) -> torch.Tensor:
        """The model over these work items' rows: the first num_decodes decode (a verifying sequence's k + 1
        rows are k + 1 decode rows on its one table, row j seeing the cache up to its own position: the earlier
        rows' keys are written before any row attends, so that is the causal mask among the new rows), the rest
        prefill."""
        decode_rows = [
            ScheduledRows(r.block_table, p, p + 1)
            for r in scheduled[:num_decodes]
            for p in range(r.start, r.end)
        ]
        meta = self.attention.build(
            decode_rows, scheduled[num_decodes:], slot_mapping, self.block_size, self.device
        )
        return self.run(ids, positions, meta)

    def run(self, ids: list[int], positions: list[int], meta: AttentionMetadata) -> torch.Tensor:
        """The model over the flattened batch: hidden states [rows, hidden]."""
        return self.model.forward(
            torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device), meta, self.kv
        )
