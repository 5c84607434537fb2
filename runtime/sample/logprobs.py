"""Log-probabilities of chosen tokens and their most likely alternatives, from a step's logits.

Always float32 log-softmax over the whole vocabulary. 'raw' logprobs (the default, as in vLLM) are taken
from the model's logits before anything edits them; 'processed' ones from the logits the token was
drawn from (after logit_bias, min_tokens, penalties and temperature).
"""

from __future__ import annotations

import torch

from runtime.sample.token_logprob import TokenLogprob


@torch.inference_mode()
def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """logits: [R, vocab]; token_ids: the token at each row's position; num_top: alternatives per row."""
    if not token_ids:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen_ids = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)
    chosen = logprobs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
    k = max(num_top)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    chosen, ranks = chosen.tolist(), ranks.tolist()
    top_values = top_values.tolist() if k else None
    top_ids = top_ids.tolist() if k else None
    out = []
    for i, token in enumerate(token_ids):
        n = num_top[i]
        top = list(zip(top_ids[i][:n], top_values[i][:n])) if n else []
        out.append(TokenLogprob(token, chosen[i], ranks[i], top))
    return out
