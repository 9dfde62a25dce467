"""How many unit-sized staging buffers the disk tier's two read streams hold (standard library
only: the planner counts them without torch; ``parts.build_parts`` makes them and
``host_store.pinned_layout`` pins the compute stream's)."""

#: Units up to this size get spare staging buffers on the disk tier (a spare or two per stream
#: costs little RAM); larger ones the minimum (RAM stays flat for models far larger than RAM;
#: their steps are long, so what a spare would overlap is small).
SMALL_UNIT_BYTES = 256 << 20


def disk_staging_buffers(largest_numel: int, depth: int) -> tuple:
    """(compute stream, optimizer stream) staging buffers of master weights on the disk tier,
    each the largest unit: ``3 + depth`` and 2 for small units, 2 and 1 for large ones
    (``depth``: the gradients in flight). Small units' compute stream has a spare beyond the
    ``2 + depth`` the forward needs: in an unclipped backward each layer's buffer is handed to its
    update and comes back only once that update's write is done, so the backward's reads ran as
    far ahead as the writes behind them let them (each read started as a write ended); the spare
    is one more read ahead."""
    if largest_numel * 4 <= SMALL_UNIT_BYTES:
        return 3 + depth, 2
    return 2, 1
