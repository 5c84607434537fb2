"""Suffix decoding proposals: match the request's latest tokens against its own tokens and against the
same tenant's recent requests, and propose the continuation seen most often.

As SuffixDecoding (Oliaro et al., 2024) and vLLM's `suffix` method, the index covers more than the
request: agent loops, retries and templated answers repeat whole spans of earlier requests. Each
tenant gets its own bounded store of its recent finished requests (prompt and output); a request only
ever matches its own tenant's store, so no tenant's text is proposed to, or observable by, another.

The store maps every context of MIN_CONTEXT .. max_context tokens to where it occurred. A proposal
takes the longest context of the request's suffix found there, then walks forward: at each step the
most frequent next token among the occurrences still agreeing with the walk, if at least
min_token_prob of them continue with it. The request's own tokens are matched as prompt lookup does
(runtime/spec_decode/ngram.py); the longer of the two matches wins.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from runtime.spec_decode.ngram import NgramIndex
from scheduler import Request

MIN_CONTEXT = 2
MAX_CONTEXT = 8
"""Contexts longer than this are not indexed (a longer match rarely predicts better, and costs memory)."""


class _TenantStore:
    def __init__(self, max_requests: int, max_context: int):
        self.max_requests = max_requests
        self.max_context = max_context
        self.docs: OrderedDict[int, list[int]] = OrderedDict()
        self.where: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        """context -> (doc, position just after it) for each occurrence followed by a token."""
        self._next_doc = 0

    def add(self, tokens: list[int]) -> None:
        doc = self._next_doc
        self._next_doc += 1
        self.docs[doc] = tokens
        for key, p in self._contexts(tokens):
            self.where.setdefault(key, []).append((doc, p))
        while len(self.docs) > self.max_requests:
            old, old_tokens = self.docs.popitem(last=False)
            for key, _ in self._contexts(old_tokens):
                kept = [o for o in self.where.get(key, ()) if o[0] != old]
                if kept:
                    self.where[key] = kept
                else:
                    self.where.pop(key, None)

    def _contexts(self, tokens: list[int]):
        for p in range(1, len(tokens)):
            for n in range(MIN_CONTEXT, min(self.max_context, p) + 1):
                yield tuple(tokens[p - n : p]), p

    def propose(self, tokens: list[int], k: int, min_prob: float) -> tuple[int, list[int]]:
        """(context length matched, proposal) for the request's tokens so far."""
        for n in range(min(self.max_context, len(tokens)), MIN_CONTEXT - 1, -1):
            found = self.where.get(tuple(tokens[-n:]))
            if not found:
                continue
            walk = list(found)
            out: list[int] = []
            while len(out) < k and walk:
                counts = Counter(self.docs[d][p] for d, p in walk if p < len(self.docs[d]))
                if not counts:
                    break
                token, count = counts.most_common(1)[0]
                if count < min_prob * len(walk):
                    break
                out.append(token)
                walk = [(d, p + 1) for d, p in walk if p < len(self.docs[d]) and self.docs[d][p] == token]
            return n, out
        return 0, []


MAX_TENANTS = 256
"""Tenants whose stores are kept; the one that finished a request longest ago is dropped first."""


class SuffixStore:
    def __init__(self, max_depth: int, max_requests: int):
        self.max_context = max(MIN_CONTEXT, min(max_depth, MAX_CONTEXT))
        self.max_requests = max_requests
        self._tenants: OrderedDict[str, _TenantStore] = OrderedDict()

    def add(self, request: Request) -> None:
        """Keep a finished request's tokens for its tenant's later requests."""
        if self.max_requests <= 0:
            return
        store = self._tenants.get(request.tenant)
        if store is None:
            store = self._tenants[request.tenant] = _TenantStore(self.max_requests, self.max_context)
            while len(self._tenants) > MAX_TENANTS:
                self._tenants.popitem(last=False)
        self._tenants.move_to_end(request.tenant)
        store.add(list(request.all_token_ids))

    def propose(self, request: Request, own: NgramIndex, k: int, min_prob: float) -> list[int]:
        """Up to k tokens: from the request's own tokens or its tenant's recent requests, the longer match."""
        own_n, own_tokens = own.propose_matched(k)
        store = self._tenants.get(request.tenant)
        if store is None:
            return own_tokens
        n, tokens = store.propose(request.all_token_ids, k, min_prob)
        return tokens if n > own_n and tokens else own_tokens
