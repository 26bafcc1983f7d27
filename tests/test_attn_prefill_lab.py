"""lab/attn_prefill_long.py and its variant lab/templates/attn_prefill_pipe.cu.j2 on the CPU: the variant renders and
compiles for sm_86 and sm_90 with no spills and a launch that fits (its shared-memory total the same in Python, in the
template's Jinja and in its C layout); the launch covers every flattened query row once; the FLOP count is the kernel
lab's; the sampled reference is the family's reference on those rows; the variant's fp16 numerics (codes·scale, Q
and P rounded to fp16) stay within the bf16 tolerance the GPU tests use; the CLI parses and prints a GPU run's table."""
import re

import pytest
import torch

from compiler.kernels import attn_prefill
from compiler.targets import lookup
from lab import attn_prefill_long as lab
from lab.cases import make_case


def _key(arch="sm_90", t=4096, max_pages=2048):
    return attn_prefill.make_key(24, 4, 256, t, "int8", max_pages, lookup(arch))


def _nvrtc():
    try:
        from compiler import nvrtc
        nvrtc.version()
        nvrtc.cuda_include_dir()
    except Exception as err:                     # no cuda-bindings / NVRTC / headers on this machine
        pytest.skip(f"NVRTC unavailable: {err}")


@pytest.mark.parametrize("arch, tiling", [("sm_86", (4, 16)), ("sm_90", (8, 32))])
def test_variant_compiles_without_spills_and_fits(tmp_path, arch, tiling):
    _nvrtc()
    from compiler import codegen, nvrtc
    from compiler.build_cache import build_kernels

    key = lab.variant_of(_key(arch))
    assert (key.warps, key.tk) == tiling and key.name.endswith(f"pipe{tiling[0]}x{tiling[1]}_{arch.replace('_', '')}")
    source = codegen.render(key, nvrtc.version()).source
    assert int(re.search(r"SMEM_BYTES = (\d+);", source).group(1)) == lab.smem_bytes(key)   # + static_assert in C
    (built,) = build_kernels([key], root=tmp_path, jobs=1, progress=False).built
    meta, cfg = built.meta, lab.launch(key)
    print(f"\n{key.name}: {meta['registers']} registers, {cfg.smem} B shared, grid {cfg.grid}")
    assert meta["spill_stores"] == meta["spill_loads"] == meta["stack_bytes"] == 0
    assert meta["smem_bytes"] == 0 and cfg.smem <= lookup(arch).smem_per_block
    assert meta["registers"] * cfg.block[0] <= 65536                # one block per SM


@pytest.mark.parametrize("t", [16, 1040, 4096])
@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90"])
def test_launch_covers_every_flattened_row_once(arch, t):
    key = lab.variant_of(_key(arch, t))
    cfg, rows, br = lab.launch(key), 6 * t, 16 * key.warps
    assert cfg.block == (32 * key.warps, 1, 1) and cfg.grid[1:] == (4, 1)
    assert (cfg.grid[0] - 1) * br < rows <= cfg.grid[0] * br
    assert cfg.smem == lab.smem_bytes(key) <= lookup(arch).smem_per_block
    assert lab.tiling(key) == (key.warps, key.tk)


def test_the_variant_refuses_bf16_kv_and_unknown_tilings():
    with pytest.raises(ValueError):
        lab.PipeKey(**{**_key().fields(), "kv_dtype": "bf16"})
    with pytest.raises(ValueError):
        lab.PipeKey(**_key().fields(), warps=6, tk=32)


def test_causal_flops_are_the_kernel_labs():
    key = _key(t=32, max_pages=8)
    assert lab.causal_flops(key, 300) == make_case(key, "cpu", 0, ctx=300).flops
    assert lab.causal_flops(_key(), 131072) == 4 * 24 * 256 * (4096 * (131072 - 4096) + 4096 * 4097 // 2)


def _small_case(t=48, length=300):
    key = _key(t=t, max_pages=8)
    case = make_case(key, "cpu", 3, ctx=length)
    (_, args), = case.launches
    pages = {"k": args[3], "v": args[4], "k_scales": args[5], "v_scales": args[6]}
    return key, case, args, pages


def test_sampled_reference_is_the_family_reference_on_those_rows():
    key, case, args, pages = _small_case()
    tokens = lab.check_tokens(key.t, 20, 0)
    assert tokens[0] == 0 and tokens[-1] == key.t - 1 and len(tokens) == 20
    full = case.reference()["out"]
    got = lab.sampled_reference(key, args[1], args[2], pages, args[7], 300, tokens)
    assert got.shape == (20, 24, 256)
    torch.testing.assert_close(got.float(), full[tokens].float(), atol=2e-3, rtol=8e-3)   # a bf16 ulp at most


def test_the_variants_fp16_numerics_are_within_the_bf16_tolerance():
    """The kernel's arithmetic on the CPU: K and V as fp16(code · scale), Q as fp16, P as fp16, fp32 sums."""
    key, case, args, pages = _small_case()
    from compiler.kernels.attn_decode import gather_kv

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
    err = lab.error(o, case.reference()["out"])
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


def test_cli_parses_and_the_dry_run_lists_both_kernels(capsys):
    lab.main(["--dry-run", "--history", "8192,131072", "--chunk", "4096"])
    text = capsys.readouterr().out
    rows = lab.dry_run(lab.parse(["--dry-run", "--history", "8192,131072"]))
    assert [r["history"] for r in rows] == [8192, 8192, 131072, 131072]
    assert rows[0]["grid"] == (256, 4, 1) and rows[1]["grid"] == (192, 4, 1) and rows[1]["block"] == (256, 1, 1)
    assert all(r["name"] in text for r in rows)
    args = lab.parse(["--out", "x.json", "--history", "8192,32768,131072", "--chunk", "4096"])
    assert args.history == [8192, 32768, 131072] and args.chunk == 4096 and args.out == "x.json"
    for argv, message in [(["--history", "8192,x"], "comma-separated integers"), (["--chunk", "100"], "multiple of 16"),
                          (["--history", "2048"], "must hold the chunk"), (["--history", "200000"], "exceeds")]:
        with pytest.raises(SystemExit) as err:
            lab.parse(argv)
        assert message in str(err.value)


def test_the_table_of_a_gpu_run():
    run = {"shipped": {"us": 78000.0, "TFLOPs": 170.0, "ok": True},
           "variant": {"us": 47000.0, "TFLOPs": 282.0, "ok": True}}
    ok = {"history": 131072, "chunk": 4096, "flops": 1.3e13, **run, "speedup": 78 / 47,
          "variant_vs_shipped_max_abs": 4e-3}
    bad = {"history": 8192, "chunk": 4096, "flops": 7e11, "error": "CudaError: simulated"}
    kernels = {n: {"name": f"attn_prefill_{n}", "registers": 242, "spills": 0} for n in ("shipped", "variant")}
    text = lab.table({"device": "NVIDIA H100", "iters": 5, "kernels": kernels, "results": [ok, bad]})
    assert "282.0" in text and "1.66x" in text and "FAILED: CudaError" in text
