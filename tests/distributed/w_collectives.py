"""Worker (run by torchrun): the collectives of megatrain_nb.engine.ranks.dist on every rank, results saved
to <out>/rank<r>.pt for the test to compare with what one process computes."""
import sys

import torch

from megatrain_nb.engine.ranks.dist import Dist, DistError


def main(out_dir: str) -> None:
    d = Dist.from_env()
    r, n = d.rank, d.world
    res = {"rank": r, "world": n, "device": str(d.device), "backend": d.backend, "native": dict(d._native)}
    for numel in (1, 100, 256 * n + 7, 5000):
        collectives(d, numel, res, "")
    sent_native = dict(d.traffic.sent)
    d._native = {"gather": False, "reduce_scatter": False}  # the paths for a gloo without them
    for numel in (1, 100, 256 * n + 7, 5000):
        collectives(d, numel, res, "fb_")
    d._native = dict(res["native"])
    res["traffic_fallback"] = {k: d.traffic.sent[k] - sent_native.get(k, 0) for k in d.traffic.sent}
    d.traffic.reset()
    for numel in (1, 100, 256 * n + 7, 5000):
        collectives(d, numel, {}, "")
    rest(d, res, out_dir)


def collectives(d, numel, res, tag):
    r = d.rank
    if True:
        lay = d.layout(numel)
        g = torch.Generator().manual_seed(numel)
        full = torch.randn(numel, generator=g)                 # the same on every rank
        got = d.gather(lay.shard_of(full, r).clone(), lay)
        res[f"{tag}gather{numel}"] = got.clone()
        pend = d.gather(lay.shard_of(full, r).clone(), lay, async_op=True)
        res[f"{tag}gather_async{numel}"] = pend.wait().clone()
        grad = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * numel + r))  # differs per rank
        res[f"{tag}rs{numel}"] = d.reduce_scatter(grad, lay).clone()
        res[f"{tag}rs_async{numel}"] = d.reduce_scatter(grad, lay, async_op=True).wait().clone()


def rest(d, res, out_dir):
    r = d.rank
    sq = torch.tensor([float(r + 1) ** 2])
    d.all_reduce_(sq)
    res["sq"] = sq
    res["tokens"] = d.sum(10 * (r + 1))
    res["traffic_sent"], res["traffic_min"] = dict(d.traffic.sent), dict(d.traffic.minimum)
    d.check_same("codec", "int8")
    # control messages: JSON in byte tensors, of different lengths per rank, native and fallback
    msg = {"rank": r, "text": "é✓" * (r * 50), "values": [1.5, None, True, float("inf")], "t": (r, "x")}
    res["json"] = d.all_gather_json(msg)
    native = d._native
    d._native = {"gather": False, "reduce_scatter": False}
    res["json_fb"] = d.all_gather_json(msg)
    d._native = native
    try:
        d.all_gather_json(object()) if r == 1 else None   # refused before any collective
    except TypeError as e:
        res["json_refused"] = str(e)
    try:
        d.check_same("seed", 1234 + r)
        res["disagree"] = None
    except DistError as e:
        res["disagree"] = str(e)
    torch.save(res, f"{out_dir}/rank{r}.pt")
    d.barrier()
    d.close()


if __name__ == "__main__":
    main(sys.argv[1])
