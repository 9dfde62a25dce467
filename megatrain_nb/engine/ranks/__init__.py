"""Several processes, one run: the process group (Dist: gloo or NCCL), each unit's flat buffer cut
into one contiguous shard per rank (all-gather in, reduce-scatter out), resharding a checkpoint
for another number of ranks, and snapshots written shard by shard.
"""
