"""What an expert exchange sends for a given routing, exactly: bytes per rank, link and kind.

Pure Python (no torch). ``europa.flexshard.exchange.wire`` says what uniform routing sends on
average; this says what one layer call with *these* routings sends, so a run's
counted bytes can be checked against its own routing, and the average against both.
"""

from __future__ import annotations

from collections.abc import Sequence

from europa.flexshard.exchange.wire import COUNT_BYTES, INTER, INTRA, RowBytes

Routing = Sequence[Sequence[int]]  # one rank's tokens, each its top-k expert ids


def _ledger(ranks: int) -> list[dict[str, dict[str, int]]]:
    return [{link: {"rows": 0, "counts": 0} for link in (INTER, INTRA)} for _ in range(ranks)]


def routed_bytes(
    routings: Sequence[Routing],
    ranges: Sequence[tuple[int, int]],
    local: int,
    dispatch: str,
    rows: RowBytes,
    *,
    forward_passes: int = 1,
    chunks: int = 1,
) -> list[dict[str, dict[str, int]]]:
    """Bytes each ep rank sends through one MoE layer in ``forward_passes`` forwards and one
    backward, by link (``local`` ranks a node) and kind ("rows", "counts"). ``routings[r]``:
    rank r's tokens' expert ids; ``ranges[r]``: the experts rank r owns."""
    owner = {e: r for r, (a, b) in enumerate(ranges) for e in range(a, b)}
    sent = _ledger(len(ranges))

    def link(a: int, b: int) -> str | None:
        return None if a == b else INTER if a // local != b // local else INTRA

    def rows_between(src: int, dst: int, n: int) -> None:
        """``n`` rows from ``src`` towards the experts at ``dst``, and their way back."""
        where = link(src, dst)
        if where is not None:
            sent[src][where]["rows"] += n * (forward_passes * rows.dispatch + rows.combine_grad)
            sent[dst][where]["rows"] += n * (forward_passes * rows.combine + rows.dispatch_grad)

    def counts(src: int, dst: int, n: int) -> None:
        where = link(src, dst)
        if where is not None:
            sent[src][where]["counts"] += forward_passes * n * COUNT_BYTES

    ranks = len(ranges)
    if dispatch == "flat":
        for src, tokens in enumerate(routings):
            for dst in range(ranks):
                counts(src, dst, ranges[dst][1] - ranges[dst][0])
                rows_between(src, dst, sum(owner[e] == dst for t in tokens for e in t))
        return sent
    nodes = ranks // local
    forwarded: dict[int, list[Sequence[int]]] = {r: [] for r in range(ranks)}
    for src, tokens in enumerate(routings):
        node, position = divmod(src, local)
        for m in range(nodes):
            peer = m * local + position
            counts(src, peer, chunks)
            arriving = [t for t in tokens if any(owner[e] // local == m for e in t)]
            rows_between(src, peer, len(arriving))
            forwarded[peer] += [[e for e in t if owner[e] // local == m] for t in arriving]
    for forwarder, tokens in forwarded.items():
        node = forwarder // local
        for j in range(local):
            dst = node * local + j
            counts(forwarder, dst, chunks)
            rows_between(forwarder, dst, sum(any(owner[e] == dst for e in t) for t in tokens))
    return sent
