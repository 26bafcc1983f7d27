"""attn_long: the INT8 paged attention of a decode step (T = 1) and of a verify (T = K + 1) at long context (issue
31) — attn_decode + attn_combine at the 27B's shape (24 query / 4 KV heads × 256), one lane of 4K / 32K / 128K
tokens in a shuffled pool, keyed as the runtime's 128K profile builds them (a 2,048-page block table). Per
case: µs (median of CUDA-event timings; inputs rotated over copies bigger than 2 × L2), the bytes it must move
(K and V codes with their scales, q, the gate, the output; the split partials apart, as overhead), GB/s and the
fraction of a read-only stream and of a copy measured in the same run — alone and chained back to back (how it
runs inside a step) — and the decode kernel without its combine (timed alone, and chained: `dec. chain`).
`--splits` tries other split counts than the target's choice; `--variant` also times lab templates on the same
inputs: `vahead` (lab/templates/attn_decode_vahead.cu.j2, V a chunk ahead at one row tile), `direct` (the
direct-load kernel, templates/attn_decode.cu.j2), `ring` / `ring3` (templates/attn_decode_ring.cu.j2: each warp
cp.asyncs its K, V and scales S − 1 chunks ahead into its own shared-memory ring; S by attn_decode.ring_stages, or
3) — the shipped key is the one attn_decode.make_key chooses (`choose_layout`) — each checked bit for bit against
the shipped key on the same inputs (the `bits` column); `keys` (templates/attn_decode_keys.cu.j2: the keys split
over 4 chunk lanes of whole-dim warps, attn_decode.keys_split; shipped on sm_90) has its own arithmetic, so where
one of the pair splits the keys and the other the dims, column `diff` gives the largest |output − the shipped
output| instead (both within bf16 of the reference: the GPU tier checks it); `keys` is the split without its `early`
first copies (shipped with them on sm_90), `early` the split with them. `--combine-whole` also times attn_combine in
blocks over all dims (session 23's). Writes JSON (--out), prints a table last. `--dry-run` (any
machine, no GPU): the keys, launch grids, shared memory and byte counts only.

  python -m lab.attn_long --out attn_long.json [--contexts 4096,32768,131072] [--t 1,4] [--splits 66,132,264]
  python -m lab.attn_long --dry-run [--arch sm_90] [--variant direct,ring]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

from compiler.kernels import attn_combine, attn_decode
from compiler.targets import lookup

HQ, HKV, D, PAGE = 24, 4, 256, 64           # the 27B's attention layers (MODEL.md §4)
LAB_TEMPLATES = Path(__file__).resolve().parent / "templates"


@dataclass(frozen=True)
class VaheadKey(attn_decode.Key):
    """The lab variant of attn_decode that loads a chunk's V with its K, a chunk ahead, at one row tile (the same
    launch, partials and bits as the shipped kernel's: only the loads move)."""
    template, template_dir = "attn_decode_vahead.cu.j2", LAB_TEMPLATES

    def _name_parts(self):
        return super()._name_parts() + ["vahead"]


def _dims(key: attn_decode.Key, stages: int = 0) -> attn_decode.Key:
    return replace(key, kw=0, stages=stages, early=False)


VARIANTS = {"vahead": lambda key: VaheadKey(**_dims(key).fields()),
            "direct": lambda key: _dims(key),
            "ring": lambda key: _dims(key, attn_decode.ring_stages(_dims(key))),
            "ring3": lambda key: _dims(key, 3),
            "keys": lambda key: attn_decode.keys_split(_dims(key)),
            "early": lambda key: replace(attn_decode.keys_split(_dims(key)), early=True)}


def shipped_of(key: attn_decode.Key) -> attn_decode.Key:
    """The shipped key a variant is checked against: the same fields, the shipped layout (attn_decode.choose_layout)."""
    return attn_decode.choose_layout(attn_decode.Key(**{f.name: getattr(key, f.name) for f in fields(attn_decode.Key)}))


def variant_of(key) -> str:
    if isinstance(key, VaheadKey):
        return "vahead"
    if key == shipped_of(key):
        return "shipped"
    if key.kw:
        return "early" if key.early else "keys"
    if not key.stages:
        return "direct"
    return "ring" if key.stages == attn_decode.ring_stages(key) else f"ring{key.stages}"


def block_smem(key: attn_decode.Key) -> int:
    """Shared memory a block takes: the direct-load (and vahead) exchange is static, the ring's is all dynamic."""
    return key.dynamic_smem() or attn_decode.smem_bytes(key)


def int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: {option}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"error: {option}: expected positive integers, got {text!r}")
    return values


def keys(args, target) -> list[tuple[attn_decode.Key, int]]:
    """(key, context) per case: every T at every context, with the target's splits and each --splits."""
    out = []
    for ctx in args.contexts:
        if ctx > args.max_pages * PAGE:
            raise SystemExit(f"error: context {ctx} exceeds the block table of {args.max_pages} pages "
                             f"({args.max_pages * PAGE} tokens): raise --max-pages")
        for t in args.t:
            base = attn_decode.make_key(HQ, HKV, D, 1, t, "int8", args.max_pages, target)
            variants = [base] + [replace(base, splits=s) for s in args.splits if s != base.splits]
            variants += [VARIANTS[v](k) for v in args.variant for k in list(variants)]
            out += [(k, ctx) for k in dict.fromkeys(variants)]   # ring and ring3 are one key where 3 stages fit
    return out


def attn_bytes(key: attn_decode.Key, ctx: int) -> dict[str, int]:
    """What one call must move for a row of `ctx` keys: K and V codes + fp16 scales (one per 64 values), q,
    the gate half of gate_src, the bf16 output (`useful`, what lab.cases_seq counts); the fp32 split partials
    written by attn_decode and read back by attn_combine (`partials`)."""
    rows = key.b * key.t * key.hq
    kv = 2 * key.b * ctx * key.hkv * (key.d + 2 * (key.d // 64))        # K and V: codes + fp16 scales
    out = {"kv": kv, "q": rows * key.d * 2, "gate": rows * key.d * 2, "out": rows * key.d * 2}
    out["useful"] = sum(out.values())
    pages = -(-ctx // key.page)
    pps = max(-(-pages // key.splits), 1)                # templates/common/paged.cuh
    out["active_splits"] = -(-pages // pps)
    out["partials"] = 2 * rows * out["active_splits"] * (key.d * 4 + 8) if key.splits > 1 else 0
    return out


def dry_run(args) -> list[dict]:
    target = lookup(args.arch or "sm_90")
    rows = []
    for key, ctx in keys(args, target):
        moved = attn_bytes(key, ctx)
        launch = attn_decode.launch(key)
        rows.append({"name": key.name, "context": ctx, "t": key.t, "splits": key.splits, "grid": launch.grid,
                     "smem": block_smem(key), "variant": variant_of(key),
                     "combine": attn_combine.for_decode(key).name if key.splits > 1 else None, **moved})
    return rows


def same_bits(key: attn_decode.Key, ref: attn_decode.Key, case, bind) -> bool:
    """Whether `key` (a variant) writes `ref`'s partials and, through the combine, output bit for bit on `case`'s
    inputs: each run starts from the same NaN-filled buffers (the entries of inactive splits stay so in both),
    compared as bytes."""
    import torch

    (_, args), *rest = case.launches
    written = [t for t in args[:3] if t is not None]           # out, part_o, part_ml
    results = []
    for k in (ref, key):
        for t in written:
            t.fill_(float("nan"))
        for launcher in [bind(k, args)] + [bind(kc, a) for kc, a in rest]:
            launcher.launch()
        torch.cuda.synchronize()
        results.append([t.clone().view(torch.uint8) for t in written])
    return all(torch.equal(a, b) for a, b in zip(*results))


def max_diff(key: attn_decode.Key, ref: attn_decode.Key, case, bind) -> float:
    """The largest |output of `key` − output of `ref`| (both through the combine) on `case`'s inputs."""
    import torch

    (_, args), *rest = case.launches
    outs = []
    for k in (ref, key):
        args[0].fill_(float("nan"))
        for launcher in [bind(k, args)] + [bind(kc, a) for kc, a in rest]:
            launcher.launch()
        torch.cuda.synchronize()
        outs.append(args[0].float().clone())
    return (outs[0] - outs[1]).abs().max().item()


def measure(args) -> dict:
    import torch

    from lab.kernel_lab import DEVICE, KERNELS, time_chain, time_launches
    from lab.cases import make_case
    from ninfer_gen.cli.bench import copy_bandwidth
    from ninfer_gen.cli.read_stream import read_bandwidth

    major, minor = torch.cuda.get_device_capability()
    target = lookup(args.arch or f"sm_{major}{minor}")
    read_gbs, copy_gbs = read_bandwidth(args.iters), copy_bandwidth(args.iters)
    cases = keys(args, target)
    groups = [(g, None) for g in args.combine_groups or [0]]   # 0: the combine key the case builds (for_decode)
    groups += [(g, 0) for g, _ in groups] if args.combine_whole else []   # ds 0: a block over all dims (session 23's)

    def combine(k, g):
        if k.family != "attn_combine":
            return k
        return replace(k, groups=g[0] or k.groups, ds=k.ds if g[1] is None else g[1])
    KERNELS.build([combine(k, g) for key, _ in cases for g in groups
                   for k in ([key, attn_combine.for_decode(key)] if key.splits > 1 else [key])] +
                  [shipped_of(key) for key, _ in cases])
    rows = []
    for (key, ctx), g in ((case, g) for case in cases for g in groups):
        moved = attn_bytes(key, ctx)
        row = {"name": key.name, "context": ctx, "t": key.t, "splits": key.splits, "variant": variant_of(key),
               "combine_groups": f"{g[0] or (attn_combine.for_decode(key).groups if key.splits > 1 else 0)}"
                                 f"{'w' if g[1] == 0 else ''}", **moved}
        try:
            first = make_case(key, DEVICE, 0, ctx=ctx)
            assert first.bytes == moved["useful"], (first.bytes, moved["useful"])
            if row["variant"] != "shipped":          # at ctx keys and with a ragged last chunk (ctx − 37)
                ragged = make_case(key, DEVICE, 1, ctx=max(key.t, ctx - 37))
                bind = lambda k, a: KERNELS.bind(combine(k, g), a)      # noqa: E731
                if bool(key.kw) != bool(shipped_of(key).kw):       # the keys split beside the dims split
                    row["max_diff"] = max(max_diff(key, shipped_of(key), c, bind) for c in (first, ragged))
                else:
                    same = all(same_bits(key, shipped_of(key), c, bind) for c in (first, ragged))
                    row["bits"] = "same" if same else "DIFF"
                del ragged
            copies = max(1, min(32, -(-2 * target.l2_bytes // first.bytes)))
            built = [first] + [make_case(key, DEVICE, i, ctx=ctx) for i in range(1, copies)]
            runs = [[KERNELS.bind(combine(k, g), a) for k, a in c.launches] for c in built]
            us = statistics.median(time_launches(runs, args.iters))
            chain = time_chain(runs, args.iters)
            alone = statistics.median(time_launches([r[:1] for r in runs], args.iters))
            alone_chain = time_chain([r[:1] for r in runs], args.iters)
        except Exception as err:                       # one failing case must not hide the others
            rows.append(row | {"error": f"{type(err).__name__}: {err}"})
            print(f"  {key.name} @ {ctx}: FAILED {type(err).__name__}: {err}", flush=True)
            continue
        gbs = moved["useful"] / us / 1e3
        row |= {"us": us, "us_chain": chain, "us_decode_only": alone, "GBps": gbs, "read_fraction": gbs / read_gbs,
                "copy_fraction": gbs / copy_gbs, "read_fraction_chain": moved["useful"] / chain / 1e3 / read_gbs,
                "combine_share": max(0.0, 1 - alone / us), "us_decode_chain": alone_chain,
                "decode_read_fraction_chain": moved["useful"] / alone_chain / 1e3 / read_gbs}
        rows.append(row)
        print(f"  {key.name} @ {ctx}, combine groups {row['combine_groups']}: {us:.1f} us, chained {chain:.1f} us",
              flush=True)
        del runs, built, first
        torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "target": target.name, "read_GBps": read_gbs,
            "copy_GBps": copy_gbs, "iters": args.iters, "results": rows}


def table(r: dict) -> str:
    lines = [f"device {r['device']}; read stream {r['read_GBps']:,.0f} GB/s, copy {r['copy_GBps']:,.0f} GB/s "
             f"(median of {r['iters']})",
             f"{'context':>8} {'T':>2} {'splits':>6} {'variant':>8} {'groups':>6} {'bits':>4} {'us':>8} {'MB':>7} "
             f"{'GB/s':>7} {'read%':>6} {'chain us':>9} {'read%':>6} {'combine':>8} {'dec. chain':>10} {'read%':>6}"]
    for x in r["results"]:
        head = (f"{x['context']:>8,} {x['t']:>2} {x['splits']:>6} {x.get('variant', 'shipped'):>8} "
                f"{x.get('combine_groups', 1):>6} {x.get('bits', '-'):>4}")
        if "error" in x:
            lines.append(f"{head} FAILED: {x['error'][:90]}")
            continue
        lines.append(f"{head} {x['us']:>8.1f} {x['useful'] / 1e6:>7.1f} {x['GBps']:>7,.0f} "
                     f"{100 * x['read_fraction']:>6.1f} {x['us_chain']:>9.1f} {100 * x['read_fraction_chain']:>6.1f} "
                     f"{100 * x['combine_share']:>7.1f}% {x.get('us_decode_chain', 0):>10.1f} "
                     f"{100 * x.get('decode_read_fraction_chain', 0):>6.1f}"
                     + (f" {x['max_diff']:>8.1e}" if "max_diff" in x else ""))
    return "\n".join(lines)


def dry_table(rows: list[dict]) -> str:
    lines = [f"{'kernel':<64} {'context':>8} {'grid':>14} {'smem KB':>7} {'KV MB':>8} {'MB':>7} {'partials MB':>11} "
             f"{'active':>6}"]
    for x in rows:
        lines.append(f"{x['name']:<64} {x['context']:>8,} {str(x['grid']):>14} {x['smem'] / 1024:>7.1f} "
                     f"{x['kv'] / 1e6:>8.2f} {x['useful'] / 1e6:>7.2f} {x['partials'] / 1e6:>11.3f} "
                     f"{x['active_splits']:>6}")
    return "\n".join(lines)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096,32768,131072", help="keys per row (default 4096,32768,131072)")
    ap.add_argument("--t", default="1,4", help="query tokens per row: 1 = decode, K + 1 = verify (default 1,4)")
    ap.add_argument("--splits", default="", help="split counts to try beside the target's choice, e.g. 66,132,264")
    ap.add_argument("--variant", default="", help=f"lab template variants to time beside each key: {', '.join(VARIANTS)}")
    ap.add_argument("--max-pages", type=int, default=2048, help="block-table width of the keys (default 2048: "
                    "the runtime's 128K profile)")
    ap.add_argument("--arch", default=None, help="sm_XX of the keys (default: the GPU's; sm_90 for --dry-run)")
    ap.add_argument("--combine-groups", default="", help="attn_combine split groups to time each case with, e.g. 1,4 "
                    "(default: the shipped choice, attn_combine.split_groups)")
    ap.add_argument("--combine-whole", action="store_true", help="also time each case with attn_combine's blocks over "
                    "all dims (session 23's 1,024-thread blocks; `groups` column: 4w)")
    ap.add_argument("--iters", type=int, default=50, help="timings per case (median)")
    ap.add_argument("--out", default="attn_long.json", help="JSON results")
    ap.add_argument("--dry-run", action="store_true", help="keys, launches and byte counts only: no GPU")
    args = ap.parse_args(argv)
    args.contexts, args.t = int_list(args.contexts, "--contexts"), int_list(args.t, "--t")
    args.splits = int_list(args.splits, "--splits") if args.splits else []
    args.combine_groups = int_list(args.combine_groups, "--combine-groups") if args.combine_groups else []
    args.variant = [v for v in args.variant.split(",") if v]
    if any(v not in VARIANTS for v in args.variant):
        raise SystemExit(f"error: --variant: expected some of {', '.join(VARIANTS)}, got {','.join(args.variant)!r}")
    if args.max_pages < 1 or args.iters < 1:
        raise SystemExit("error: --max-pages and --iters must be ≥ 1")
    return args


def main(argv=None) -> None:
    args = parse(argv)
    if args.dry_run:
        print(dry_table(dry_run(args)))
        return
    t0 = time.time()
    result = measure(args) | {"seconds": time.time() - t0}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\n{table(result)}\n(JSON: {args.out})")


if __name__ == "__main__":
    main()
