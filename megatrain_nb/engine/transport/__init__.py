"""Every byte between host and device: copy_in(unit, slot) -> ready, release(slot) -> free,
copy_out(buffer) -> done (CUDA streams and events, or worker threads on the CPU device, with the
adversarial mode the tests use), the pager that replays a step's access order ahead of need into
the device slots, pinned-memory registration, the issuer that keeps collectives in one order, and
the ring of chunk buffers the loss head and the gradients use.
"""
