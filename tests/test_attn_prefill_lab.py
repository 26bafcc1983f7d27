"""lab/attn_prefill_long.py on the CPU: the archived v1 (lab/templates/attn_prefill_v1.cu.j2) renders and compiles for
sm_86 and sm_90 with no spills beside the shipped kernel, its launch the v1 one; the FLOP count is the kernel lab's;
the sampled reference is the family's reference on those rows; the CLI parses and prints a GPU run's table; the
`mma` / `wg` variants' keys, launches and refusals. (The shipped kernels' own tests, the wgmma one's sm_90a compile
included: tests/test_attn_prefill.py; on the GPU: tests/gpu/test_attn_prefill_wg_gpu.py.) The v1 compile uses the
session's kernel cache (tests/conftest.py)."""
import pytest
import torch

from compiler import codegen
from compiler.kernels import attn_prefill
from compiler.targets import lookup
from lab import attn_prefill_long as lab
from lab.cases import make_case


def _key(arch="sm_90", t=4096, max_pages=2048):
    return attn_prefill.make_key(24, 4, 256, t, "int8", max_pages, lookup(arch))


def v1_keys(arch: str) -> list:
    return [lab.launches(lab.parse(["--arch", arch]), lookup(arch))["v1"][0]]


@pytest.mark.prebuild(keys=v1_keys)
@pytest.mark.parametrize("arch", ["sm_86", "sm_90"])
def test_v1_compiles_without_spills_beside_the_shipped_kernel(nvrtc, kernel_cache, arch):
    from compiler.build_cache import build_kernels

    runs = lab.launches(lab.parse(["--arch", arch]), lookup(arch))
    v1, cfg = runs["v1"]
    assert v1.name == f"attn_prefill_q24_kv4_d256_t4096_int8_p64x2048_gate_v1_{arch.replace('_', '')}"
    assert codegen.template_path(v1) == "lab/templates/attn_prefill_v1.cu.j2" and runs["shipped"][0] == _key(arch)
    assert cfg.grid == (256, 4, 1) and cfg.block == (192, 1, 1) and cfg.smem == (96 + 64) * 264 * 2
    (built,) = build_kernels([v1], root=kernel_cache, jobs=1, progress=False).built
    assert built.meta["spill_stores"] == built.meta["spill_loads"] == 0


def test_causal_flops_are_the_kernel_labs():
    key = _key(t=32, max_pages=8)
    assert lab.causal_flops(key, 300) == make_case(key, "cpu", 0, ctx=300).flops
    assert lab.causal_flops(_key(), 131072) == 4 * 24 * 256 * (4096 * (131072 - 4096) + 4096 * 4097 // 2)


def test_sampled_reference_is_the_family_reference_on_those_rows():
    key = _key(t=48, max_pages=8)
    case = make_case(key, "cpu", 3, ctx=300)
    (_, args), = case.launches
    pages = {"k": args[3], "v": args[4], "k_scales": args[5], "v_scales": args[6]}
    tokens = lab.check_tokens(key.t, 20, 0)
    assert tokens[0] == 0 and tokens[-1] == key.t - 1 and len(tokens) == 20
    full = case.reference()["out"]
    got = lab.sampled_reference(key, args[1], args[2], pages, args[7], 300, tokens)
    assert got.shape == (20, 24, 256)
    torch.testing.assert_close(got.float(), full[tokens].float(), atol=2e-3, rtol=8e-3)   # a bf16 ulp at most


def test_cli_parses_and_the_dry_run_lists_both_kernels(capsys):
    lab.main(["--dry-run", "--history", "8192,131072", "--chunk", "4096"])
    text = capsys.readouterr().out
    rows = lab.dry_run(lab.parse(["--dry-run", "--history", "8192,131072"]))
    assert [r["history"] for r in rows] == [8192, 8192, 131072, 131072]
    assert rows[0]["name"].endswith("_v1_sm90") and rows[0]["grid"] == (256, 4, 1)
    assert rows[1]["name"] == _key().name and rows[1]["grid"] == (192, 4, 1) and rows[1]["block"] == (256, 1, 1)
    assert all(r["name"] in text for r in rows)
    sm86 = lab.dry_run(lab.parse(["--dry-run", "--history", "8192", "--arch", "sm_86"]))
    assert sm86[1]["grid"] == (384, 4, 1) and sm86[1]["block"] == (128, 1, 1)
    args = lab.parse(["--out", "x.json", "--history", "8192,32768,131072", "--chunk", "4096"])
    assert args.history == [8192, 32768, 131072] and args.chunk == 4096 and args.out == "x.json"
    for argv, message in [(["--history", "8192,x"], "comma-separated integers"), (["--chunk", "100"], "multiple of 16"),
                          (["--history", "2048"], "must hold the chunk"), (["--history", "200000"], "exceeds")]:
        with pytest.raises(SystemExit) as err:
            lab.parse(argv)
        assert message in str(err.value)


def test_the_table_of_a_gpu_run():
    run = {"v1": {"us": 84682.0, "TFLOPs": 153.4, "ok": True},
           "shipped": {"us": 70927.0, "TFLOPs": 183.1, "ok": True}}
    ok = {"history": 131072, "chunk": 4096, "flops": 1.3e13, **run, "speedup": 84682 / 70927,
          "shipped_vs_v1_max_abs": 6.1e-5}
    bad = {"history": 8192, "chunk": 4096, "flops": 7e11, "error": "CudaError: simulated"}
    kernels = {n: {"name": f"attn_prefill_{n}", "registers": 242, "spills": 0} for n in ("v1", "shipped")}
    text = lab.table({"device": "NVIDIA H100", "iters": 5, "kernels": kernels, "results": [ok, bad]})
    assert "183.1" in text and "1.19x" in text and "FAILED: CudaError" in text


def test_variant_keys_launch_and_refusals():
    """`--variant mma` adds sm_90's mma.sync kernel beside v1 and the shipped wgmma one (default runs unchanged): the
    shipped grid and block at 8 warps, each its own shared memory within the card's (wgmma: Q, one K and one V fp16
    tile, two ring stages, 1 KB of alignment); `--variant wg` off sm_90 is refused with the reason."""
    rows = lab.dry_run(lab.parse(["--dry-run", "--history", "8192", "--variant", "mma"]))
    assert [r["name"] for r in rows][:2] == [r["name"] for r in lab.dry_run(lab.parse(["--dry-run", "--history", "8192"]))]
    wg, mma = rows[1], rows[2]
    assert wg["name"] == "attn_prefill_q24_kv4_d256_t4096_int8_p64x2048_gate_w8k64_sm90"
    assert mma["name"] == "attn_prefill_q24_kv4_d256_t4096_int8_p64x2048_gate_w8k32_sm90"
    assert wg["grid"] == mma["grid"] == (192, 4, 1) and wg["block"] == (256, 1, 1) and wg["flops"] == mma["flops"]
    assert wg["smem"] == 128 * 512 + 2 * 64 * 512 + 2 * (2 * 64 * 256 + 2 * 64 * 4 * 2) + 1024 == 199_680
    assert wg["smem"] <= lookup("sm_90").smem_per_block and mma["smem"] == 168_960
    assert codegen.template_path(lab.mma_of(_key())) == "templates/attn_prefill_int8.cu.j2"
    with pytest.raises(SystemExit, match="needs sm_90"):
        lab.parse(["--variant", "wg", "--arch", "sm_86"])
    with pytest.raises(ValueError, match="sm_90 only"):
        lab.wg_of(_key("sm_86"))


def test_the_table_of_a_gpu_run_with_a_variant():
    run = {"v1": {"us": 84682.0, "TFLOPs": 153.4, "ok": True}, "shipped": {"us": 40000.0, "TFLOPs": 324.7, "ok": True},
           "mma": {"us": 70927.0, "TFLOPs": 183.1, "ok": True}}
    row = {"history": 131072, "chunk": 4096, "flops": 1.3e13, **run, "speedup": 84682 / 40000,
           "shipped_vs_v1_max_abs": 6.1e-5, "variant_speedup": 40000 / 70927, "variant_vs_shipped_max_abs": 1.2e-4}
    kernels = {n: {"name": f"attn_prefill_{n}", "registers": 218, "spills": 0} for n in ("v1", "shipped", "mma")}
    text = lab.table({"device": "NVIDIA H100", "iters": 5, "kernels": kernels, "variant": "mma", "results": [row]})
    assert "mma attn_prefill_mma (218 regs)" in text and "183.1" in text and "0.56x" in text and "ship/mma" in text
