"""attn_prefill_long: the prefill attention of one chunk at the end of a long history (issue: the 128K prefill's rate)
— the shipped INT8 attn_prefill (sm_90: templates/attn_prefill_wg.cu.j2 on warpgroup MMA; elsewhere
templates/attn_prefill_int8.cu.j2: K/V converted once per block to scaled fp16 in a cp.async-fed double buffer,
`warps` × 16 flattened query rows on mma.sync) and the archived v1 (lab/templates/attn_prefill_v1.cu.j2, `V1Key`:
one warp per query head, K/V dequantised to bf16 through registers) on the same inputs at the 27B's shape (24 query
/ 4 KV heads × 256, INT8-G64 pages in a shuffled pool, the runtime's 128K block table); `--variant mma` adds the
mma.sync kernel where it is not the shipped one (sm_90), `--variant wg` the wgmma one. Per history L (the keys in
the cache, the chunk's own T the last of them): each checked
against the fp32 reference on sampled query tokens (the whole reference at 128K is 24 × T × L scores), then timed
(CUDA events, median), with the causal FLOPs counted exactly (4·hq·d per visible query-key pair). Writes JSON,
prints a table last. `--dry-run` (any machine, no GPU): keys, launches, shared memory and FLOPs only.

  python3 -m lab.attn_prefill_long --out X.json --history 8192,32768,131072 --chunk 4096
  python3 -m lab.attn_prefill_long --dry-run [--arch sm_86] [--variant mma]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from compiler.kernels import Launch, attn_prefill, gemm_wg
from compiler.targets import lookup
from lab.attn_long import D, HKV, HQ, LAB_TEMPLATES, PAGE, int_list


@dataclass(frozen=True)
class V1Key(attn_prefill.Key):
    """The archived v1 INT8 prefill attention (lab/templates/attn_prefill_v1.cu.j2), built beside the shipped
    kernel for same-run comparisons; its launch is `v1_launch`, its tiling fields are unused."""
    template, template_dir = "attn_prefill_v1.cu.j2", LAB_TEMPLATES

    def _name_parts(self):
        return super()._name_parts()[:-1] + ["v1"]


def v1_of(key: attn_prefill.Key) -> V1Key:
    return V1Key(**mma_of(key).fields())           # (its tiling fields are unused; mma's keep it off sm_90a)


def v1_launch(key: V1Key) -> Launch:
    """Blocks of 16 tokens per kv head, one warp per query head; the block's Q rows and a K and a V tile of 32 keys
    as bf16 rows padded by 8 values."""
    group = key.hq // key.hkv
    return Launch((key.t // 16, key.hkv, 1), (32 * group, 1, 1), (group * 16 + 2 * 32) * (key.d + 8) * 2)


def mma_of(key: attn_prefill.Key) -> attn_prefill.Key:
    """The mma.sync INT8 kernel (templates/attn_prefill_int8.cu.j2) of `key`'s shape: the first of TILINGS whose
    shared memory fits the card — what sm_90 shipped before its wgmma kernel."""
    warps, tk = attn_prefill.mma_tiling(key.d, key.page, lookup(key.arch))
    return replace(key, warps=warps, tk=tk)


def wg_of(key: attn_prefill.Key) -> attn_prefill.Key:
    """The wgmma kernel (templates/attn_prefill_wg.cu.j2) of `key`'s shape: sm_90 only."""
    return replace(key, warps=attn_prefill.WG_TILING[0], tk=attn_prefill.WG_TILING[1])


VARIANTS = {"mma": mma_of, "wg": wg_of}


def causal_flops(key, length: int) -> int:
    """QK and PV, 2·d FLOPs each per head per visible (query, key) pair; queries at L − T … L − 1."""
    pairs = key.t * (length - key.t) + key.t * (key.t + 1) // 2
    return 4 * key.hq * key.d * pairs


def keys(args, target) -> tuple[V1Key, attn_prefill.Key]:
    """(v1, shipped) at the 27B's shape: the INT8 key the prefill plan compiles for `target`, and v1 of it."""
    key = attn_prefill.make_key(HQ, HKV, D, args.chunk, "int8", args.max_pages, target)
    return v1_of(key), key


def launches(args, target) -> dict:
    """{"v1": (key, launch), "shipped": (key, launch)}, and the `--variant`'s (mma or wg) under its name."""
    v1, key = keys(args, target)
    runs = {"v1": (v1, v1_launch(v1)), "shipped": (key, attn_prefill.launch(key))}
    if args.variant:
        other = VARIANTS[args.variant](key)
        runs[args.variant] = (other, attn_prefill.launch(other))
    return runs


def sampled_reference(key, q, gate_src, pages: dict, table_row, length: int, tokens):
    """attn_prefill.reference for the query tokens `tokens` (indices into the chunk) only: bf16 [len, hq, d]."""
    import torch

    from compiler.kernels.attn_decode import gather_kv

    grp, n = key.hq // key.hkv, len(tokens)
    k = gather_kv(pages, "k", table_row, length, key.hkv, key.d, key.page)          # [L, hkv, d] fp32
    v = gather_kv(pages, "v", table_row, length, key.hkv, key.d, key.page)
    qs = q[tokens].float().view(n, key.hkv, grp, key.d)
    s = torch.einsum("thgd,nhd->hgtn", qs, k) / key.d ** 0.5
    qpos = length - key.t + tokens.view(-1, 1)
    s = s.masked_fill(torch.arange(length, device=q.device).view(1, -1) > qpos, float("-inf"))
    o = torch.einsum("hgtn,nhd->thgd", torch.softmax(s, -1), v).reshape(n, key.hq, key.d)
    if key.gate:
        o = o * torch.sigmoid(gate_src.view(key.t, key.hq, 2 * key.d)[tokens, :, key.d:].float())
    return o.to(torch.bfloat16)


def check_tokens(t: int, count: int, seed: int):
    """The chunk's first and last tokens (block edges, the diagonal) and random ones between, sorted."""
    import torch

    edge = min(t, max(count // 4, 1))
    picked = sorted(set(range(edge)) | set(range(t - edge, t)))
    rest = torch.tensor([x for x in range(t) if x not in set(picked)], dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    extra = rest[torch.randperm(len(rest), generator=g)[:max(count - len(picked), 0)]].tolist()
    return torch.tensor(sorted(picked + extra), dtype=torch.long)


def error(actual, expected) -> dict:
    """The GPU tests' bf16 rule (|a − e| ≤ atol·max(1, rms(e)) + rtol·|e|): whether it holds, and the errors."""
    from lab.cases import TOLERANCES

    tol = TOLERANCES["bf16"]
    a, e = actual.double(), expected.double()
    scale = max(1.0, e.pow(2).mean().sqrt().item())
    excess = ((a - e).abs() - (tol.atol * scale + tol.rtol * e.abs())).max().item()
    finite = bool(a.isfinite().all())
    return {"ok": finite and excess <= 0, "max_abs_err": (a - e).abs().max().item(), "excess": excess,
            "ref_rms": e.pow(2).mean().sqrt().item()}


def dry_run(args) -> list[dict]:
    rows = []
    for hist in args.history:
        for key, cfg in launches(args, lookup(args.arch or "sm_90")).values():
            rows.append({"name": key.name, "history": hist, "grid": cfg.grid, "block": cfg.block,
                         "smem": cfg.smem, "flops": causal_flops(key, hist)})
    return rows


def _load(built, key, cfg):
    from ninfer_gen.executor.cuda_module import Kernel

    kernel = Kernel.load(built.cubin, key.name, cfg.smem)
    return kernel, lambda args: kernel.bind(attn_prefill.params(key), args, cfg)


def measure(args) -> dict:
    import torch

    from compiler.build_cache import DEFAULT_ROOT, build_kernels
    from lab.cases import make_case
    from lab.kernel_lab import time_launches
    from ninfer_gen.cli.env import build_root

    major, minor = torch.cuda.get_device_capability()
    target = lookup(args.arch or f"sm_{major}{minor}")
    if args.variant == "wg" and not gemm_wg.arch_supported(target.arch):
        raise SystemExit(f"error: --variant wg: wgmma needs sm_90, this device is {target.arch}")
    var = args.variant
    runs = launches(args, target)
    key = runs["shipped"][0]
    built = build_kernels([k for k, _ in runs.values()], root=build_root() or DEFAULT_ROOT, progress=False).by_name()
    kernels = {n: _load(built[k.name], k, cfg) for n, (k, cfg) in runs.items()}
    info = {n: {"name": k.name, "registers": built[k.name].meta["registers"],
                "spills": built[k.name].meta["spill_stores"] + built[k.name].meta["spill_loads"]}
            for n, (k, _) in runs.items()}
    rows = []
    for hist in args.history:
        row = {"history": hist, "chunk": args.chunk, "flops": causal_flops(key, hist)}
        try:
            case = make_case(key, "cuda", args.seed, ctx=hist)
            (_, kargs), = case.launches
            q, gate, pages = kargs[1], kargs[2], {"k": kargs[3], "v": kargs[4], "k_scales": kargs[5],
                                                  "v_scales": kargs[6]}
            tokens = check_tokens(args.chunk, args.check_tokens, args.seed).to(q.device)
            ref = sampled_reference(key, q, gate, pages, kargs[7], hist, tokens)
            outs = {}
            for name, (_, bind) in kernels.items():
                out = torch.full_like(kargs[0], float("nan"))
                launcher = bind([out, *kargs[1:]])
                launcher.launch()
                torch.cuda.synchronize()
                us = statistics.median(time_launches([[launcher]], args.iters, args.warmup))
                outs[name] = out[tokens]
                row[name] = {"us": us, "TFLOPs": row["flops"] / us / 1e6, **error(outs[name], ref)}
            row["shipped_vs_v1_max_abs"] = (outs["shipped"].float() - outs["v1"].float()).abs().max().item()
            row["speedup"] = row["v1"]["us"] / row["shipped"]["us"]
            if var:
                row["variant_vs_shipped_max_abs"] = (outs[var].float() - outs["shipped"].float()).abs().max().item()
                row["variant_speedup"] = row["shipped"]["us"] / row[var]["us"]
        except Exception as err:                       # one failing history must not hide the others
            row["error"] = f"{type(err).__name__}: {err}"
        rows.append(row)
        print(f"  history {hist}: " + (row.get("error") or ", ".join(f"{n} {row[n]['us']:.0f} us" for n in kernels)),
              flush=True)
        case = ref = outs = None
        torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "target": target.name, "iters": args.iters, "kernels": info,
            "variant": var, "results": rows}


def table(r: dict) -> str:
    k, var = r["kernels"], r.get("variant")
    lines = [f"device {r['device']} (median of {r['iters']}); v1 {k['v1']['name']} "
             f"({k['v1']['registers']} regs), shipped {k['shipped']['name']} ({k['shipped']['registers']} regs)",
             f"{'history':>8} {'chunk':>6} {'TFLOP':>7} {'v1 us':>11} {'TFLOP/s':>8} {'ok':>3} "
             f"{'shipped us':>11} {'TFLOP/s':>8} {'ok':>3} {'speedup':>8} {'max|s-v1|':>9}"
             + (f" {var + ' us':>11} {'TFLOP/s':>8} {'ok':>3} {'ship/' + var:>8} {'max|v-s|':>9}" if var else "")]
    if var:
        lines[0] += f", {var} {k[var]['name']} ({k[var]['registers']} regs)"
    for x in r["results"]:
        head = f"{x['history']:>8,} {x['chunk']:>6} {x['flops'] / 1e12:>7.2f}"
        if "error" in x:
            lines.append(f"{head} FAILED: {x['error'][:100]}")
            continue
        v, s = x["v1"], x["shipped"]
        line = (f"{head} {v['us']:>11,.0f} {v['TFLOPs']:>8.1f} {'y' if v['ok'] else 'N':>3} {s['us']:>11,.0f} "
                f"{s['TFLOPs']:>8.1f} {'y' if s['ok'] else 'N':>3} {x['speedup']:>7.2f}x {x['shipped_vs_v1_max_abs']:>9.2e}")
        if var:
            w = x[var]
            line += (f" {w['us']:>11,.0f} {w['TFLOPs']:>8.1f} {'y' if w['ok'] else 'N':>3} {x['variant_speedup']:>7.2f}x "
                     f"{x['variant_vs_shipped_max_abs']:>9.2e}")
        lines.append(line)
    return "\n".join(lines)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--history", default="8192,32768,131072", help="keys in the cache, the chunk's included "
                    "(default 8192,32768,131072)")
    ap.add_argument("--chunk", type=int, default=4096, help="query tokens T, a multiple of 16 (default 4096: the "
                    "27B's prefill chunk)")
    ap.add_argument("--max-pages", type=int, default=2048, help="block-table width (default 2048: the 128K profile)")
    ap.add_argument("--arch", default=None, help="sm_XX of the keys (default: the GPU's; sm_90 for --dry-run)")
    ap.add_argument("--iters", type=int, default=5, help="timed launches per kernel (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed launches first")
    ap.add_argument("--check-tokens", type=int, default=128, help="query tokens checked against the reference")
    ap.add_argument("--variant", default="", choices=("", *VARIANTS), help="also time the other INT8 kernel: mma "
                    "(mma.sync, templates/attn_prefill_int8.cu.j2: sm_90's before its wgmma one) or wg (warpgroup MMA, "
                    "templates/attn_prefill_wg.cu.j2; sm_90 only)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="attn_prefill_long.json", help="JSON results")
    ap.add_argument("--dry-run", action="store_true", help="keys, launches, shared memory and FLOPs only: no GPU")
    args = ap.parse_args(argv)
    args.history = int_list(args.history, "--history")
    if args.chunk < 16 or args.chunk % 16:
        raise SystemExit(f"error: --chunk: expected a positive multiple of 16, got {args.chunk}")
    if min(args.history) < args.chunk:
        raise SystemExit(f"error: --history: every history must hold the chunk ({args.chunk} tokens)")
    if max(args.history) > args.max_pages * PAGE:
        raise SystemExit(f"error: history {max(args.history)} exceeds the block table of {args.max_pages} pages "
                         f"({args.max_pages * PAGE} tokens): raise --max-pages")
    if args.variant == "wg" and args.arch and not gemm_wg.arch_supported(args.arch):
        raise SystemExit(f"error: --variant wg: wgmma needs sm_90 (compiled for sm_90a), not --arch {args.arch}")
    if min(args.iters, args.warmup + 1, args.check_tokens) < 1:
        raise SystemExit("error: --iters and --check-tokens must be ≥ 1, --warmup ≥ 0")
    return args


def main(argv=None) -> None:
    args = parse(argv)
    if args.dry_run:
        for x in dry_run(args):
            print(f"{x['name']:<72} {x['history']:>8,} grid {str(x['grid']):<14} block {x['block'][0]:>4} "
                  f"smem {x['smem']:>7,} TFLOP {x['flops'] / 1e12:.2f}")
        return
    t0 = time.time()
    result = measure(args) | {"seconds": time.time() - t0}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\n{table(result)}\n(JSON: {args.out})")


if __name__ == "__main__":
    main()
