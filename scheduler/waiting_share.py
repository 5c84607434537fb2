"""Room in the waiting queue: each tenant gets its share, so a flooding tenant is refused, not the others.

An engine client counts the requests it has in flight; those that will not be
in the running batch are waiting. With at most max_waiting waiting requests,
a tenant's share is max_waiting divided among the tenants that have requests
waiting (the asking tenant counted), rounded up:

    share(t)  = ceil(max_waiting / tenants waiting)
    refuse t  when waiting(t) >= share(t)  or  all waiting >= 2 * max_waiting

A lone tenant thus has the whole queue (share = max_waiting), as before
tenants were told apart; a second tenant arriving at a queue the first filled
still gets its half, and the first is refused until its own count falls under
its share. The total overshoots max_waiting by at most max_waiting: beyond
twice the limit everyone is refused, which bounds memory however many tenant
names a client makes up.
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def waiting_refusal(
    in_flight: Mapping[str, int],
    running: Mapping[str, int],
    tenant: str,
    max_num_seqs: int,
    max_waiting: int | None,
) -> str | None:
    """Why `tenant` may not queue another request now (None: it may).

    in_flight: requests per tenant handed to the engine and not yet finished; running: per tenant, as of
    the engine's last step. Requests in flight beyond the running batch count as waiting: those beyond
    what runs now, or beyond max_num_seqs (a burst arrives before the engine has admitted anyone)."""
    if max_waiting is None:
        return None
    total_in_flight = sum(in_flight.values())
    total_running = max(sum(running.values()), min(total_in_flight, max_num_seqs))
    total_waiting = total_in_flight - total_running
    waiting = {t: min(total_waiting, n - running.get(t, 0)) for t, n in in_flight.items()}
    own = max(waiting.get(tenant, 0), 0)
    tenants = sum(1 for t, n in waiting.items() if n > 0 and t != tenant) + 1
    share = math.ceil(max_waiting / tenants)
    if own >= share:
        return (
            f"{own} of this tenant's requests are already waiting (its share of the queue: {share} "
            f"of {max_waiting}, with {tenants} tenants waiting)"
        )
    if total_waiting >= 2 * max_waiting:
        return f"{total_waiting} requests are already waiting (limit {max_waiting} per tenant share)"
    return None
