"""Where a unit's state lives between its visits to the device: the host store (flat fp32
buffers per unit, pinned only where a copy crosses the link), the weight store that hands the
transport a unit's compute-dtype bytes, the disk tier (its file format, ranged reads and writes,
the host cache in front of it, free-space checks), snapshots that hard-link the disk tier's files
(linked*), meta-device materialization and the reclaiming of run folders a dead process left.
"""
