"""lab/attn_long.py's dry run on the CPU: its options, the keys it would time (the runtime's 128K profile's
attn_decode at the 27B shape, and the split variants asked for), and its byte counts — the same as the kernel
lab's case builder counts, with the split partials by the rule templates/common/paged.cuh applies; the ring's
stages and shared memory per arch (attn_decode.ring_stages), and its template compiled beside the direct-load
one (no spills, no stack frame, the same floating-point instructions in its PTX). The compiles use the session's
kernel cache (tests/conftest.py)."""
import collections
import re

import pytest

from compiler.kernels import attn_decode
from compiler.targets import lookup
from lab import attn_long
from lab.cases import make_case


def test_dry_run_lists_every_context_and_query_rows_with_the_profiles_keys(capsys):
    attn_long.main(["--dry-run"])
    text = capsys.readouterr().out
    rows = attn_long.dry_run(attn_long.parse(["--dry-run"]))
    assert [(r["context"], r["t"]) for r in rows] == [(c, t) for c in (4096, 32768, 131072) for t in (1, 4)]
    h200 = attn_decode.choose_splits(4, 2048, lookup("sm_90"))
    for r in rows:
        assert r["name"] in text and f"p64x2048_s{h200}" in r["name"] and r["grid"] == (h200, 4, 1)
    big = rows[-2]                                             # T = 1 at 131,072: 2,048 pages, 32 per split
    assert big["kv"] == 131072 * 4 * 2 * (256 + 8) and big["active_splits"] == -(-2048 // 32)
    variants = attn_long.dry_run(attn_long.parse(["--dry-run", "--contexts", "131072", "--t", "1",
                                                  "--splits", "132,264", "--arch", "sm_86"]))
    assert [r["splits"] for r in variants] == [attn_decode.choose_splits(4, 2048, lookup("sm_86")), 132, 264]
    assert [r["active_splits"] for r in variants][1:] == [128, 256]


@pytest.mark.parametrize("t", [1, 4])
def test_byte_counts_match_the_kernel_labs_cases(t):
    key = attn_decode.make_key(24, 4, 256, 1, t, "int8", 2048, lookup("sm_90"))
    moved = attn_long.attn_bytes(key, 4096)
    assert moved["useful"] == make_case(key, "cpu", 0, ctx=4096).bytes
    assert moved["partials"] == 2 * t * 24 * moved["active_splits"] * (256 * 4 + 8)


def test_bad_options_are_one_line(capsys):
    for argv, message in [(["--contexts", "4096,x"], "comma-separated integers"), (["--t", "0"], "positive"),
                          (["--contexts", "200000"], "exceeds the block table of 2048 pages")]:
        with pytest.raises(SystemExit) as err:
            attn_long.main(["--dry-run", *argv])
        assert message in str(err.value)


def test_the_table_of_a_gpu_run():
    """The table a GPU run prints last (checked here, not after the device time): a measured row and a failed one."""
    ok = {"context": 131072, "t": 1, "splits": 66, "us": 80.0, "useful": 276_860_000, "GBps": 3460.0,
          "read_fraction": 0.78, "us_chain": 75.0, "read_fraction_chain": 0.83, "combine_share": 0.02}
    ring = ok | {"variant": "ring", "bits": "same", "us_decode_chain": 70.0, "decode_read_fraction_chain": 0.889}
    bad = {"context": 4096, "t": 4, "splits": 264, "variant": "ring", "bits": "DIFF", "error": "CudaError: simulated"}
    text = attn_long.table({"device": "NVIDIA H200", "read_GBps": 4449.0, "copy_GBps": 4283.0, "iters": 50,
                            "results": [ok, ring, bad]})
    assert "read stream 4,449 GB/s" in text and "78.0" in text and "83.0" in text and "FAILED: CudaError" in text
    lines = text.splitlines()
    assert " - " in lines[2] and "ring" in lines[3] and " same " in lines[3] and lines[3].endswith("70.0   88.9")
    assert " DIFF FAILED" in lines[4]


def test_ring_keys_fit_two_blocks_where_the_card_allows():
    """ring_stages: 4 stages at both row tiles on sm_90 (88 / 104 KB a block, two blocks in 228 KB); sm_80 3 / 2;
    sm_86 4 / 3 for one block an SM (no ring of 2 stages fits two blocks in 100 KB beside the exchange). The shipped
    key (make_key) splits the keys on sm_90 (attn_decode.choose_layout) and loads directly on sm_80 and sm_86. The
    launch is the direct
    grid with the ring's shared memory, all dynamic; bf16 KV, fewer than 2 stages and a ring past the card are
    refused."""
    from compiler.kernels.attn_decode import RESERVED_SMEM, Key, ring_smem
    from lab.attn_long import VARIANTS

    for arch, want in (("sm_90", (4, 4)), ("sm_80", (3, 2)), ("sm_86", (4, 3))):
        target = lookup(arch)
        for t, stages in zip((1, 4), want):
            key = attn_decode.make_key(24, 4, 256, 1, t, "int8", 2048, target)
            assert (key.kw, key.stages) == ((4, attn_decode.keys_split(key).stages) if arch == "sm_90" else (0, 0))
            ring, direct = VARIANTS["ring"](key), VARIANTS["direct"](key)
            assert ring.stages == stages and direct.stages == 0 and attn_long.variant_of(direct) != "ring"
            tag = f"_{arch.replace('_', '')}"
            assert ring.name == direct.name.replace(tag, f"_ring{stages}{tag}")
            launch, plain = attn_decode.launch(ring), attn_decode.launch(direct)
            assert launch.grid == plain.grid and launch.block == plain.block and plain.smem == 0
            assert launch.smem == ring_smem(ring, stages) == attn_decode.smem_bytes(direct) + stages * 4 * 4608
            blocks = target.smem_per_sm // (launch.smem + RESERVED_SMEM)
            assert blocks == (1 if arch == "sm_86" else 2)
            assert ring.template == "attn_decode_ring.cu.j2" and direct.template is None
    bf16 = attn_decode.make_key(24, 4, 256, 1, 1, "bf16", 2048, lookup("sm_90"))
    assert bf16.stages == 0
    with pytest.raises(ValueError, match="INT8 KV only"):
        Key(**bf16.fields() | {"stages": 4})
    sm86 = attn_decode.make_key(24, 4, 256, 1, 4, "int8", 2048, lookup("sm_86"))
    assert sm86.kw == 0
    with pytest.raises(ValueError, match="more than the"):
        Key(**sm86.fields() | {"stages": 4})
    with pytest.raises(ValueError, match="needs 2 or more"):
        Key(**sm86.fields() | {"stages": 1})
    rows = attn_long.dry_run(attn_long.parse(["--dry-run", "--contexts", "32768", "--variant", "direct,ring"]))
    assert [(r["variant"], r["t"], r["smem"]) for r in rows] == [
        ("shipped", 1, 101376), ("direct", 1, 16384), ("ring", 1, 90112),
        ("shipped", 4, 135168), ("direct", 4, 32768), ("ring", 4, 106496)]


# A floating-point PTX instruction (cuda_fp16.h's wrappers put theirs in braces: `{sub.f16x2 …`).
_FP = re.compile(r"^\s*\{?\s*(?:@%p\d+\s+)?((?:fma|mul|add|sub|ex2|max|min|neg|cvt|mma)\.[\w.]*f(?:16|32)[\w.]*)", re.M)


def ring_keys(arch: str) -> list:
    """attn_decode at one row tile (T = 1) and two (T = 4) with direct loads, then the same with the ring."""
    made = [attn_decode.make_key(24, 4, 256, 1, t, "int8", 2048, lookup(arch)) for t in (1, 4)]
    return [attn_long.VARIANTS["direct"](k) for k in made] + [attn_long.VARIANTS["ring"](k) for k in made]


@pytest.mark.prebuild(keys=ring_keys, ptx=True)
@pytest.mark.parametrize("arch", ["sm_86", "sm_90"])
def test_ring_compiles_without_spills_with_the_direct_loads_arithmetic(nvrtc, kernel_cache, arch):
    """The ring template at one row tile (T = 1) and two (T = 4): no spills and no stack frame, and its PTX has the
    direct-load kernel's floating-point instructions kind by kind (a necessary condition for its bits, which the GPU
    checks: lab.attn_long's `bits` column, tests/gpu/test_long_context_gpu.py). Registers are printed."""
    from compiler.build_cache import build_kernels

    keys = ring_keys(arch)
    direct, rings = keys[:2], keys[2:]
    built = {b.key: b for b in build_kernels(keys, root=kernel_cache, jobs=2, ptx=True, progress=False).built}
    for key, ring in zip(direct, rings):
        meta = built[ring].meta
        print(f"\n{ring.name}: {meta['registers']} registers, {attn_decode.launch(ring).smem} B shared")
        assert meta["spill_stores"] == meta["spill_loads"] == meta["stack_bytes"] == 0
        ops = [collections.Counter(_FP.findall(built[k].ptx.read_text())) for k in (key, ring)]
        assert ops[0] == ops[1] and ops[0]["mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"] > 0, ops


def test_keys_split_tiling():
    """attn_decode.keys_split: 4 chunk lanes; a decode (6 query rows: one row tile) is 4 warps with 3 stages on sm_90
    (99 KB a block, two blocks an SM), a verify of 4 tokens (24 rows) 12 warps in one block with 4 stages, 8 tokens
    (48 rows, six tiles) two row blocks; sm_86 keeps 2 stages where two blocks do not fit. The lab's `keys` variant is
    the same key; make_key ships it on sm_90 only (KEYS_ARCHS), with its first copies `early` (the lab's `early`).
    bf16 KV, a 1-stage ring, 13 lanes and `early` without the keys split are refused."""
    from dataclasses import replace

    from compiler.kernels.attn_decode import Key, keys_smem, keys_split, keys_tiling

    for arch, t, stages, warps, grid_y, smem in [("sm_90", 1, 3, 4, 4, 101_376), ("sm_90", 4, 4, 12, 4, 135_168),
                                                  ("sm_90", 8, 4, 12, 8, 135_168), ("sm_86", 1, 2, 4, 4, 67_584)]:
        base = attn_decode.make_key(24, 4, 256, 1, t, "int8", 2048, lookup(arch))
        key = keys_split(replace(base, kw=0, stages=0, early=False))
        assert (key.kw, key.stages, keys_tiling(key).warps) == (4, stages, warps), key
        assert key.template == "attn_decode_keys.cu.j2" and f"_kw4s{stages}_" in key.name
        launch = attn_decode.launch(key)
        assert launch.grid == (key.splits, grid_y, 1) and launch.block == (32 * warps, 1, 1)
        assert launch.smem == keys_smem(key) == smem
        lab, early = attn_long.VARIANTS["keys"](base), attn_long.VARIANTS["early"](base)
        shipped = arch in attn_decode.KEYS_ARCHS                # make_key's own layout there
        assert lab == key and early == replace(key, early=True)
        assert early.name == key.name.replace(f"_{arch.replace('_', '')}", f"_early_{arch.replace('_', '')}")
        assert (base == early) == shipped and attn_long.shipped_of(lab) == base and attn_long.variant_of(lab) == "keys"
        assert attn_long.variant_of(early) == ("shipped" if shipped else "early")
        assert attn_decode.launch(early) == launch
    ok = attn_decode.make_key(24, 4, 256, 1, 1, "int8", 2048, lookup("sm_90"))
    for bad in (dict(kv_dtype="bf16", kw=4, stages=3), dict(kw=4, stages=1), dict(kw=13, stages=2)):
        with pytest.raises(ValueError, match="keys split"):
            Key(**(ok.fields() | {"stages": 0, "early": False} | bad))
    with pytest.raises(ValueError, match="`early` is a field of the keys split"):
        Key(**(ok.fields() | {"kw": 0, "stages": 0}))


def keys_split_keys(arch: str) -> list:
    """attn_decode with the keys split at the 27B's shape, T = 1 and 4, and the tiny spec's (d = 64), T = 1 and 4."""
    return [attn_decode.keys_split(attn_decode.make_key(hq, hkv, d, 1, t, "int8", pages, lookup(arch)))
            for hq, hkv, d, pages in ((24, 4, 256, 2048), (4, 2, 64, 64)) for t in (1, 4)]


@pytest.mark.prebuild(keys=keys_split_keys)
@pytest.mark.parametrize("arch", ["sm_90"])
def test_keys_split_compiles_without_spills(nvrtc, kernel_cache, arch):
    """templates/attn_decode_keys.cu.j2 where it ships (sm_90) at one row tile (a decode) and three (a verify of 4
    tokens): no spills, no stack frame, and registers that let the blocks an SM it was sized for run (two of 4
    warps; one of 12). (sm_80/86 spill 4 registers at 12 warps: not shipped there.)"""
    from compiler.build_cache import build_kernels
    from compiler.kernels.attn_decode import keys_tiling

    keys = keys_split_keys(arch)
    for b in build_kernels(keys, root=kernel_cache, jobs=2, progress=False).built:
        meta, warps = b.meta, keys_tiling(b.key).warps
        print(f"\n{b.key.name}: {meta['registers']} registers, {attn_decode.launch(b.key).smem} B shared")
        assert meta["spill_stores"] == meta["spill_loads"] == meta["stack_bytes"] == 0, b.key.name
        assert (-(-meta["registers"] // 8) * 8) * 32 * warps * (2 if warps == 4 else 1) <= 65536, b.key.name
