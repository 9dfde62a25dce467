"""The fused update's 8-lane step (AVX2 + FMA: decode into AdamW's lanes, encode from known block
maxima, the second moment's first root taken from AdamW's) against the kernels' plain C build
(-DMT_NO_SIMD): weights, codes and scales bit for bit over several steps, through every case the
step hands to the general path (first step, group edges inside a block, scalar tails, decay ending
inside a block, a lerp from the gradient, tiny and subnormal blocks) and every block the 8-lane
step encodes with its own general encoders (new moments below 2**-60), and a range ending on an
8-lane step (int8 finishes a step's second pass inside the next one's first); and the source
builds for the CPUs the kernels are cached for."""

import ctypes
import platform
import subprocess

import pytest
import torch

from megatrain_nb.engine.updates import fused_update
from megatrain_nb.engine.updates.codecs import ROLES, get_codec

from .test_codecs import _hard_moments

needs_kernels = pytest.mark.skipif(fused_update.kernels() is None,
                                   reason=f"no fused kernels: {fused_update.disabled_reason()}")


def _build(tmp_path, name, *flags):
    src, so = tmp_path / f"{name}.c", tmp_path / f"{name}.so"
    src.write_text(fused_update.SOURCE)
    subprocess.run([fused_update.kernels().compiler, *fused_update.FLAGS, *flags, "-o", str(so), str(src), "-lm"],
                   check=True, capture_output=True)
    k = fused_update.Kernels(ctypes.CDLL(str(so)), str(so))
    k.width = fused_update.kernels().width
    return k


def _args(n, width, case):
    if case == "groups":   # two learning-rate groups meeting inside a block, the first with a lerp from the gradient
        cut = 4096 + 100
        return [fused_update.adam_args(lr=1e-3, beta1=0.3, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3.0,
                                       decay_end=n // 3, regions=[(0, cut), (cut, n)], width=width, lo=0, hi=cut),
                fused_update.adam_args(lr=2e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=3.0,
                                       decay_end=n // 3, regions=[(0, cut), (cut, n)], width=width, lo=cut,
                                       hi=fused_update.ALL)]
    step, decay = (1.0, n) if case == "first" else (9.0, n // 3 + 5)
    return fused_update.adam_args(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=step,
                                  decay_end=decay, regions=[(0, decay), (decay, n)], width=width)


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_the_simd_update_is_the_plain_c_update_bit_for_bit(tmp_path, name):
    simd, plain = fused_update.kernels(), _build(tmp_path, "plain", "-DMT_NO_SIMD")
    n = 3 * 4096 + 77
    m, v = _hard_moments(n, seed=21)
    v[2560:2688] *= 1e-20   # an int4 step of 4 blocks below 2**-60 (no floor) beside 4 normal ones
    g = torch.Generator().manual_seed(22)
    p = torch.randn(n, generator=g)
    for case, scale in (("first", 1e-3), ("plain", 1e-3), ("plain", 1e-7), ("plain", 30.0), ("groups", 1e-3)):
        grads = torch.randn(n, generator=g) * scale * torch.randn(n, generator=g).mul_(0.7).exp_()
        grads[::9] = 0.0
        grads[2048:2816] = 0.0   # the tiny blocks' new moments stay below 2**-60: the 8-lane step's own general encoders
        stored = {f"{r}.{k}": t for r, x in zip(ROLES, (m, v)) for k, t in get_codec(name, r).encode(x).items()}
        outs = []
        for k in (simd, plain):
            w, codes = p.clone(), {key: t.clone() for key, t in stored.items()}
            args = _args(n, k.width, case)
            for _ in range(3):
                k.update(name, w, grads, None if case == "first" else codes, codes, 0, args)
            # and a range that ends on an 8-lane step (int8: the last step's second pass after the loop)
            k.update_call(name, w, grads, None if case == "first" else codes, codes, 0, args)(0, 2 * 4096)
            outs.append((w, codes))
        (w0, c0), (w1, c1) = outs
        assert torch.equal(w0.view(torch.int32), w1.view(torch.int32)), (case, scale)
        for key in stored:
            assert torch.equal(c0[key], c1[key]), (case, scale, key)


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["x86-64", "haswell", "skylake-avx512", "icelake-server"])
def test_the_source_builds_for_each_cpu_it_is_cached_for(tmp_path, arch):
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 targets")
    src = tmp_path / "k.c"
    src.write_text(fused_update.SOURCE)
    flags = [f for f in fused_update.FLAGS if f != "-shared"]
    r = subprocess.run([fused_update.kernels().compiler, *flags, f"-march={arch}", "-Werror", "-Wall", "-c", "-o",
                        str(tmp_path / "k.o"), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
