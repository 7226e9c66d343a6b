"""Who holds the scheduler's seats, and the queue that hands the next free one to whoever holds fewest.

A sequence belongs to a client (the server names it from the request's `user`, else the peer's address; a
request without one is its own client) and to a request (its `n` samples are its sequences). Fairness
compares clients first and, within one client, requests: the fewer seats a group holds, the sooner it is
served. Above both stands the sequence's rank (its request's priority under `--scheduling-policy priority`,
else 0 for all): a lower rank is served first, whatever the seats. The rule that uses this lives in the
scheduler; this file only counts and orders.
"""
from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from pagoda.core.request import Sequence


def client_of(seq: Sequence) -> str:
    req = seq.request
    return req.client if req.client is not None else f"request:{req.request_id}"


@dataclass
class Seats:
    """Seats held now, per client and per request (a running sequence holds one)."""
    by_client: Counter[str] = field(default_factory=Counter)
    by_request: Counter[str] = field(default_factory=Counter)

    @classmethod
    def of(cls, running: Iterable[Sequence]) -> "Seats":
        seats = cls()
        for seq in running:
            seats.take(seq)
        return seats

    def take(self, seq: Sequence) -> None:
        self.by_client[client_of(seq)] += 1
        self.by_request[seq.request.request_id] += 1

    def give(self, seq: Sequence) -> None:
        self.by_client[client_of(seq)] -= 1
        self.by_request[seq.request.request_id] -= 1

    def owes(self, holder: Sequence, waiter: Sequence) -> bool:
        """Whether `holder`'s group holds at least two seats more than `waiter`'s, at the first level where
        they differ (client, then request): moving one seat across then narrows the gap and never reverses it."""
        hc, wc = client_of(holder), client_of(waiter)
        if hc != wc:
            return self.by_client[hc] > self.by_client[wc] + 1
        hr, wr = holder.request.request_id, waiter.request.request_id
        return hr != wr and self.by_request[hr] > self.by_request[wr] + 1


Clients = OrderedDict[str, OrderedDict[str, deque[Sequence]]]


class WaitingQueue:
    """Waiting sequences, per rank, within a rank per client, and within a client per request, in arrival
    order (`Sequence.arrival_order`). `fairest` is, among the lowest rank waiting, the head of the request with
    the fewest seats of the client with the fewest seats (ties: the one waiting longest). A preempted sequence
    goes back to its place by age, ahead of everything younger: were it put at the very head, each later
    preemption would push the earlier ones back, and under steady pressure the oldest would wait for ever.
    Iteration is in (rank, client, request, position) order."""

    def __init__(self, rank: Callable[[Sequence], int] = lambda seq: 0) -> None:
        self.rank = rank
        self._levels: dict[int, Clients] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Sequence]:
        for level in sorted(self._levels):
            for requests in self._levels[level].values():
                for seqs in requests.values():
                    yield from seqs

    def __contains__(self, seq: object) -> bool:
        if not isinstance(seq, Sequence):
            return False
        clients = self._levels.get(self.rank(seq), {})
        seqs = clients.get(client_of(seq), {}).get(seq.request.request_id)
        return seqs is not None and seq in seqs

    def push(self, seq: Sequence) -> None:
        """A sequence to its place by age: a new one is the youngest; one that left the queue (preempted, or not
        admitted this step), or one added late (its grammar or adapter was loading), goes ahead of everything
        younger."""
        requests = self._requests(seq)
        rid = seq.request.request_id
        seqs = requests.get(rid)
        if seqs is None:
            requests[rid] = seqs = deque()
            # Requests stay in arrival order: those younger than this one go back behind it.
            for other in [r for r, q in requests.items() if q and q[0].arrival_order > seq.arrival_order]:
                requests.move_to_end(other)
        i = next((i for i, s in enumerate(seqs) if s.arrival_order > seq.arrival_order), len(seqs))
        seqs.insert(i, seq)
        self._len += 1

    def remove(self, seq: Sequence) -> None:
        level, client, rid = self.rank(seq), client_of(seq), seq.request.request_id
        clients = self._levels[level]
        requests = clients[client]
        requests[rid].remove(seq)
        self._len -= 1
        if not requests[rid]:
            del requests[rid]
            if not requests:
                del clients[client]
                if not clients:
                    del self._levels[level]

    def fairest(self, seats: Seats) -> Sequence | None:
        if not self._levels:
            return None
        clients = self._levels[min(self._levels)]
        client = min(clients, key=lambda c: (seats.by_client[c], next(iter(clients[c].values()))[0].arrival_order))
        requests = clients[client]
        return requests[min(requests, key=lambda r: seats.by_request[r])][0]  # min keeps the oldest of equals

    def _requests(self, seq: Sequence) -> OrderedDict[str, deque[Sequence]]:
        clients = self._levels.setdefault(self.rank(seq), OrderedDict())
        return clients.setdefault(client_of(seq), OrderedDict())
