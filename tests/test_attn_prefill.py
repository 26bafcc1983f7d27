"""attn_prefill on the CPU: INT8 keys compile templates/attn_prefill_int8.cu.j2 (sm_90: attn_prefill_wg.cu.j2 for
sm_90a, its wgmma kept asynchronous) and bf16 keys attn_prefill.cu.j2, all without spills; the INT8 kernels compile
for sm_80/86/89/90 with a launch that fits, at the
27B's and the tiny spec's shapes (its shared-memory total the same in Python, in the template's Jinja and in its C
layout); the tiling follows the card's shared memory; the launch covers every flattened query row once; the
kernel's fp16 numerics (codes·scale, Q and P rounded to fp16) stay within the bf16 tolerance the GPU tests use.
The compiles use the session's kernel cache (tests/conftest.py)."""
import re

import pytest
import torch

from compiler import codegen
from compiler.kernels import Launch, attn_prefill
from compiler.targets import lookup
from lab.attn_prefill_long import error
from lab.cases import make_case


def _key(arch="sm_90", t=4096, max_pages=2048, kv="int8"):
    return attn_prefill.make_key(24, 4, 256, t, kv, max_pages, lookup(arch))


def _tiny(arch):
    return attn_prefill.make_key(4, 2, 64, 64, "int8", 64, lookup(arch))


def test_int8_keys_compile_their_own_template_and_bf16_keys_the_familys():
    assert codegen.template_path(_key("sm_86")) == "templates/attn_prefill_int8.cu.j2"
    assert codegen.template_path(_key()) == "templates/attn_prefill_wg.cu.j2" and _key().compile_arch == "sm_90a"
    assert codegen.template_path(_key(kv="bf16")) == "templates/attn_prefill.cu.j2"
    assert _key().name == "attn_prefill_q24_kv4_d256_t4096_int8_p64x2048_gate_w8k64_sm90"
    assert _key("sm_86").compile_arch == "sm_86" and _key(kv="bf16").compile_arch == "sm_90"


TILINGS = {"sm_80": (8, 16), "sm_86": (4, 16), "sm_89": (4, 16), "sm_90": (8, 64)}      # the reference cards'


def int8_keys(arch: str) -> list:
    return [_key(arch), _tiny(arch)]


def bf16_keys(arch: str) -> list:
    return [_key(arch, kv="bf16"), attn_prefill.make_key(4, 2, 64, 64, "bf16", 64, lookup(arch))]


@pytest.mark.prebuild(keys=int8_keys)
@pytest.mark.parametrize("arch, tiling", TILINGS.items())
def test_int8_compiles_without_spills_and_fits(nvrtc, kernel_cache, arch, tiling):
    from compiler import nvrtc
    from compiler.build_cache import build_kernels

    keys = int8_keys(arch)
    assert (keys[0].warps, keys[0].tk) == tiling
    assert keys[0].name.endswith(f"w{tiling[0]}k{tiling[1]}_{arch.replace('_', '')}")
    for key in keys:
        source = codegen.render(key, nvrtc.version()).source
        assert int(re.search(r"SMEM_BYTES = (\d+);", source).group(1)) == attn_prefill.smem_bytes(key)  # + C's assert
    for built in build_kernels(keys, root=kernel_cache, jobs=2, ptx=arch == "sm_90", progress=False).built:
        meta, cfg = built.meta, attn_prefill.launch(built.key)
        print(f"\n{built.key.name}: {meta['registers']} registers, {cfg.smem} B shared, grid {cfg.grid}")
        assert meta["spill_stores"] == meta["spill_loads"] == meta["stack_bytes"] == 0
        assert meta["smem_bytes"] == 0 and cfg.smem <= lookup(arch).smem_per_block
        assert meta["registers"] * cfg.block[0] <= 65536                # one block per SM
        if built.key.wg:                # ptxas keeps the wgmma asynchronous; both products are wgmma of the plan
            assert "C7513" not in (built.dir / "nvrtc.log").read_text(), f"serialised wgmma in {built.key.name}"
            ptx, d = built.ptx.read_text(), built.key.d         # Q·Kᵀ: d / 16 k-steps of n64; P·V: 64 keys, 4 of n = d
            qk, pv = (f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16" for n in (64, d))
            assert (ptx.count(qk), ptx.count(pv)) == ((d // 16, 4) if d != 64 else (d // 16 + 4,) * 2)


@pytest.mark.prebuild(keys=bf16_keys)
@pytest.mark.parametrize("arch", ["sm_86", "sm_90"])
def test_bf16_compiles_without_spills(nvrtc, kernel_cache, arch):
    """bf16 KV (no shipped spec uses it; the case keys never reach it) at the 27B's and the tiny spec's shapes."""
    from compiler.build_cache import build_kernels

    for built in build_kernels(bf16_keys(arch), root=kernel_cache, jobs=2, progress=False).built:
        assert built.meta["spill_stores"] == built.meta["spill_loads"] == built.meta["stack_bytes"] == 0
        assert attn_prefill.launch(built.key).block == (32 * built.key.hq // built.key.hkv, 1, 1)


@pytest.mark.parametrize("t", [16, 1040, 4096])
@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90"])
def test_int8_launch_covers_every_flattened_row_once(arch, t):
    key = _key(arch, t)
    cfg, rows, br = attn_prefill.launch(key), 6 * t, 16 * key.warps
    assert cfg.block == (32 * key.warps, 1, 1) and cfg.grid[1:] == (4, 1)
    assert (cfg.grid[0] - 1) * br < rows <= cfg.grid[0] * br
    assert cfg.smem == attn_prefill.smem_bytes(key) <= lookup(arch).smem_per_block
    assert attn_prefill.tiling(24, 4, 256, "int8", 64, lookup(arch)) == (key.warps, key.tk)


def test_the_tiling_follows_shared_memory_and_bf16_keeps_a_warp_per_head():
    for arch, tiling in TILINGS.items():
        assert attn_prefill.tiling(24, 4, 256, "int8", 64, lookup(arch)) == tiling
        small = (8, 64) if arch == "sm_90" else (8, 32)                        # small rows fit anywhere
        assert attn_prefill.tiling(4, 2, 64, "int8", 64, lookup(arch)) == small
    bf16 = _key("sm_86", kv="bf16")
    assert (bf16.warps, bf16.tk) == (6, 32)
    assert attn_prefill.launch(bf16) == Launch((256, 4, 1), (192, 1, 1), (96 + 64) * 264 * 2)


def test_unknown_tilings_are_refused():
    with pytest.raises(ValueError, match="tiling"):
        attn_prefill.Key(**{**_key().fields(), "warps": 6})
    with pytest.raises(ValueError, match="tiling"):
        attn_prefill.Key(**{**_key(kv="bf16").fields(), "warps": 8})
    with pytest.raises(ValueError, match="tiling"):
        attn_prefill.Key(**{**_key().fields(), "warps": 4})                   # 4 × 64: no kernel's
    with pytest.raises(ValueError, match="sm_90 only"):
        attn_prefill.Key(**{**_key("sm_86").fields(), "warps": 8, "tk": 64})  # the wgmma tiling off sm_90


def test_the_int8_kernels_fp16_numerics_are_within_the_bf16_tolerance():
    """The kernel's arithmetic on the CPU: K and V as fp16(code · scale), Q as fp16, P as fp16, fp32 sums."""
    from compiler.kernels.attn_decode import gather_kv

    key = _key(t=48, max_pages=8)
    case = make_case(key, "cpu", 3, ctx=300)
    (_, args), = case.launches
    pages = {"k": args[3], "v": args[4], "k_scales": args[5], "v_scales": args[6]}
    h = lambda x: x.half().float()                                        # noqa: E731
    fp16 = {n: (pages[n].float() * pages[n + "_scales"].float().repeat_interleave(64, -1)).half() for n in "kv"}
    k, v = (gather_kv(fp16, n, args[7], 300, 4, 256, 64).repeat_interleave(6, 1) for n in "kv")   # no scales: as is
    s = torch.einsum("thd,nhd->htn", h(args[1].float()), k) / 16
    qpos = 300 - key.t + torch.arange(key.t).view(-1, 1)
    s = s.masked_fill(torch.arange(300).view(1, -1) > qpos, float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    o = torch.einsum("htn,nhd->thd", h(p), v) / p.sum(-1).transpose(0, 1).unsqueeze(-1)
    o = (o * torch.sigmoid(args[2].view(key.t, 24, 512)[..., 256:].float())).bfloat16()
    err = error(o, case.reference()["out"])
    assert err["ok"], err


def test_codes_times_scale_in_fp16_is_one_rounding():
    """PRMT + HSUB2 give the code exactly (0x64uu − 0x6480, uu = code ^ 0x80); HMUL2 rounds code·scale once."""
    codes = torch.arange(-128, 128, dtype=torch.int32)
    biased = (codes & 0xFF) ^ 0x80
    as_half = torch.tensor((0x6400 | biased).to(torch.int16).tolist(), dtype=torch.int16).view(torch.float16)
    exact = as_half.float() - 1152.0
    assert torch.equal(exact, codes.float())
    scale = torch.tensor(0.0137, dtype=torch.float16)
    prod = (exact.half() * scale).float()
    ref = codes.float() * scale.float()
    assert ((prod - ref).abs() <= ref.abs() * 2 ** -11 + 1e-12).all()
