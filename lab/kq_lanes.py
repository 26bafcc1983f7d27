"""kq_lanes (issue 34, session 31): the Q4_K / Q5_K decode GEMVs on a LANE-ORDER unit layout, an experiment beside the
shipped tile order. Each GEMV unit (a 16-row tile's 16 super-blocks, one contiguous run in tile order) is permuted byte
for byte so that lane l = 4g + t's code bytes are 16-byte pieces at 512·i + 16·l and the rows' 16-byte headers follow:
a warp loads its unit straight into registers with 4 (Q5_K 5) + 2 LDG.128, each instruction 512 consecutive bytes —
no cp.async ring, no shared memory, no LDS (lab/templates/gemv_kq_lanes.cu.j2). The same Unit, the same unit math:
the same bits as the shipped key, which this script checks on the GPU before timing.

  python -m lab.kq_lanes --check                      CPU: the permutation against the shipped kernels' byte reads
  python -m lab.kq_lanes --out lanes.json             GPU: the 27B GGUF step's Q4_K / Q5_K GEMV keys (their folds),
                                                      shipped vs lane order (ahead 1 / 2, register caps), bits
                                                      compared, then timed chained; Σ launches × µs per variant
  python -m lab.kq_lanes --pf --out pf.json           the same for L2 prefetches of whole row tiles (PfKey: the next
                                                      block's tile, its own) on the shipped staged layout

Prediction (lab/NOTES.md session 31): the Q4_K gate/up 38.9 → 35–36 µs chained (the ring's ~10 % of a unit's issue
slots gone, each load one 512-byte warp instruction), the step's Q4_K/Q5_K GEMVs −3…−6 %. Measured (H100,
lab/results/s31_lanes_*, s31_pf_*): both refuted — lane order one unit ahead 39.8 → 41.5 µs at the gate/up (two ahead
45.2; only the under-a-wave shapes gained), Σ over the step −97 µs at the best variant per key; tile prefetch lost
everywhere (gate/up 38.8 → 46–60 µs).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from compiler.kernels import gemv
from compiler.kernels.weight_layout import device_bytes
from compiler.kquant import get_kformat

LAB_TEMPLATES = Path(__file__).resolve().parent / "templates"
CODE_OFF = {"q4_k": 16, "q5_k": 48}     # where a block's 128 code bytes start (Q5_K: 32 qh bytes before them)


@dataclass(frozen=True)
class LanesKey(gemv.Key):
    """A shipped Q4_K / Q5_K gemv key on the lane-order layout (lab/templates/gemv_kq_lanes.cu.j2); `ahead`: units a
    warp's loads run ahead of its math."""
    ahead: int = 1
    template_dir = LAB_TEMPLATES

    @property
    def template(self) -> str:
        return "gemv_kq_lanes.cu.j2"

    def __post_init__(self):
        super().__post_init__()
        if self.fmt not in CODE_OFF or self.stage_w or not 1 <= self.ahead <= 3:
            raise ValueError(f"kq_lanes: Q4_K / Q5_K, loaded (stage_w 0), ahead 1..3; got {self.fmt}, "
                             f"stage_w {self.stage_w}, ahead {self.ahead}")

    def _name_parts(self):
        return super()._name_parts() + [f"ln{self.ahead}"]


@dataclass(frozen=True)
class PfKey(gemv.Key):
    """A shipped staged k-quant key with L2 prefetches of whole row tiles (lab/templates/gemv_kq_pf.cu.j2): `pf_next`
    tiles ahead (the block that takes this slot next), `pf_own` its own tile at the start."""
    pf_next: int = 0
    pf_own: bool = False
    template_dir = LAB_TEMPLATES

    @property
    def template(self) -> str:
        return "gemv_kq_pf.cu.j2"

    def __post_init__(self):
        super().__post_init__()
        if not self.stage_w or self.stream_k or self.splits != 1 or self.pf_next < 0:
            raise ValueError("kq_lanes: L2 tile prefetch needs a staged one-tile-a-block key (no splits, no stream-K)")

    def _name_parts(self):
        return super()._name_parts() + ([f"pn{self.pf_next}"] if self.pf_next else []) + (["po"] if self.pf_own else [])


def pf_variants(key, sms: int) -> list:
    """The tile prefetch variants of a staged one-tile-a-block key: its own tile; multi-wave grids also the tile one
    and two waves of four blocks an SM ahead."""
    if not key.stage_w or key.stream_k or key.splits != 1:
        return []
    vs = [PfKey(**key.fields(), pf_own=True)]
    if -(-key.n // 16) > 4 * sms:
        vs += [PfKey(**key.fields(), pf_next=4 * sms), PfKey(**key.fields(), pf_next=8 * sms),
               PfKey(**key.fields(), pf_next=4 * sms, pf_own=True)]
    return vs


def lanes_of(key: gemv.Key, ahead: int = 1, **fields) -> LanesKey:
    return LanesKey(**{**key.fields(), "stage_w": 0, **fields}, ahead=ahead)


def lane_order(lo: torch.Tensor, fmt: str) -> torch.Tensor:
    """Tile-order device bytes → lane order: unit by unit, piece i of lane l = 4g + t (16 bytes at 512·i + 16·l) is
    rows g + 8·(i >> 1)'s code chunks 2·(i & 1) and 2·(i & 1) + 1 at lane t's 8 bytes (load_unit's qs[h][c]); Q5_K's
    piece 4 is rows g, g + 8's qh bytes 8t … 8t + 7; then the 16 rows' 16-byte headers."""
    qb = get_kformat(fmt).block_bytes
    u = lo.view(-1, 16, qb)
    off = CODE_OFF[fmt]
    qs = u[:, :, off:off + 128].reshape(-1, 2, 8, 2, 2, 4, 8)          # unit, h, g, chunk pair, e, t, byte
    parts = [qs.permute(0, 1, 3, 2, 5, 4, 6).reshape(-1, 4, 32, 16)]   # unit, i = 2h + pair, l = 4g + t, 8e + byte
    if fmt == "q5_k":
        qh = u[:, :, 16:48].reshape(-1, 2, 8, 4, 8)                      # unit, h, g, t, byte
        parts.append(qh.permute(0, 2, 3, 1, 4).reshape(-1, 1, 32, 16))  # l = 4g + t, 8h + byte
    parts.append(u[:, :, :16].reshape(-1, 1, 16, 16))
    return torch.cat([p.reshape(p.shape[0], -1) for p in parts], dim=1).flatten().contiguous()


def _lane_reads(unit: torch.Tensor, fmt: str, lane: int, lanes: bool) -> bytes:
    """The bytes lane `lane` puts in its Unit (hd[h], [qh[h]], qs[h][c]) from one unit: load_unit's offsets on tile order
    (`lanes` False) or load_lanes' on lane order."""
    g, t, qb = lane >> 2, lane & 3, get_kformat(fmt).block_bytes
    b = unit.tolist()
    out = []
    for h in range(2):
        if lanes:
            np_code = 5 if fmt == "q5_k" else 4
            hd = 512 * np_code + 16 * (g + 8 * h)
            out += b[hd:hd + 16]
            if fmt == "q5_k":
                out += b[512 * 4 + 16 * lane + 8 * h:][:8]
            for c in range(4):
                p = 512 * (2 * h + c // 2) + 16 * lane + 8 * (c & 1)
                out += b[p:p + 8]
        else:
            blk = (g + 8 * h) * qb
            out += b[blk:blk + 16]
            if fmt == "q5_k":
                out += b[blk + 16 + 8 * t:][:8]
            for c in range(4):
                p = blk + CODE_OFF[fmt] + 32 * c + 8 * t
                out += b[p:p + 8]
    return bytes(out)


def check() -> None:
    """Every lane's Unit bytes from the lane-order layout equal those the shipped kernel reads from tile order."""
    g = torch.Generator().manual_seed(0)
    for fmt in CODE_OFF:
        qb = get_kformat(fmt).block_bytes
        lo = torch.randint(0, 256, (3 * 16 * qb,), generator=g, dtype=torch.uint8)
        ln = lane_order(lo, fmt)
        assert ln.numel() == lo.numel() and torch.equal(ln.sort().values, lo.sort().values)
        for u in range(3):
            tile_unit, lane_unit = lo[u * 16 * qb:(u + 1) * 16 * qb], ln[u * 16 * qb:(u + 1) * 16 * qb]
            for lane in range(32):
                assert _lane_reads(tile_unit, fmt, lane, False) == _lane_reads(lane_unit, fmt, lane, True), (fmt, u, lane)
        print(f"{fmt}: lane order gives every lane the bytes load_unit reads (3 units × 32 lanes)")


def step_keys(fmts=tuple(CODE_OFF)):
    """(key, launches in the plain step) for the 27B Q4_K_M GGUF step's GEMVs of `fmts` (lab.kernel_lab's plan)."""
    from collections import Counter

    from compiler.targets import arch_path_target, lookup
    from lab.kernel_lab import gguf_step_plan

    if torch.cuda.is_available():          # the kernel lab's target: the device's arch and SM count
        major, minor = torch.cuda.get_device_capability()
        target = arch_path_target(f"sm_{major}{minor}", None, torch.cuda.get_device_properties(0).multi_processor_count)
    else:
        target = lookup("sm_90")
    label, thunks = next(gguf_step_plan(target, target.l2_bytes))
    out = Counter()
    for th in thunks:
        if th.key.fmt in fmts:
            out[th.key] += th.in_plan
    return target, list(out.items())


def variants(key) -> list:
    """Lane order one unit ahead (the shipped key's register cap), two ahead under a 3-block cap (136–152 registers;
    at 4 or 5 blocks it spills), and for Q5_K's 5-block keys one ahead under a 4-block cap (Q4_K one ahead under a
    5-block cap spills a few bytes)."""
    if key.stream_k:
        return [lanes_of(key, 1)]
    vs = [lanes_of(key, 1), lanes_of(key, 2, min_blocks=3)]
    if key.min_blocks == 5:
        vs.append(lanes_of(key, 1, min_blocks=4))
    return vs


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_int = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    return a.shape == b.shape and torch.equal(a.view(as_int.get(a.dtype, a.dtype)), b.view(as_int.get(b.dtype, b.dtype)))


def run_variant(key, copies: int, iters: int):
    """(outputs of one run on case 0, chained µs over `copies` rotated cases). A LanesKey's cases hold the same random
    blocks as the shipped key's (make_case draws by seed, not by stream fields), permuted into lane order. The
    correctness run comes first: the conv keys update their history in place."""
    from lab.cases import make_case
    from lab.kernel_lab import KERNELS, time_chain

    cases = [make_case(key, "cuda", i) for i in range(copies)]
    if isinstance(key, LanesKey):
        for c in cases:
            (args,) = [a for k, a in c.launches if k == key]
            args[2].copy_(lane_order(args[2], key.fmt))
    runs = [[KERNELS.bind(k, a) for k, a in c.launches] for c in cases]
    cases[0].poison()
    for r in runs[0]:
        r.launch()
    torch.cuda.synchronize()
    out = {k: v.clone() for k, v in cases[0].outputs.items()}
    us = time_chain(runs, iters)
    del runs, cases
    torch.cuda.empty_cache()
    return out, us


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="CPU: the permutation against the shipped byte reads")
    ap.add_argument("--keys", action="store_true", help="print the step's keys and their variants (no GPU)")
    ap.add_argument("--out", default="", help="JSON results (GPU)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--pf", action="store_true", help="time the L2 tile-prefetch variants (PfKey) instead of lane order")
    args = ap.parse_args(argv)
    if args.check:
        check()
        return
    target, keys = step_keys(("q4_k", "q5_k", "q6_k") if args.pf else tuple(CODE_OFF))
    pick = (lambda key: pf_variants(key, target.sms)) if args.pf else variants
    if args.keys:
        for key, n in keys:
            print(n, key.name, [v.name for v in pick(key)])
        return

    from lab.kernel_lab import KERNELS
    from ninfer_gen.cli.bench import copy_bandwidth

    copy = copy_bandwidth()
    print(f"copy {copy:.0f} GB/s, {torch.cuda.get_device_name()}", flush=True)
    all_keys = [k for key, _ in keys for k in (key, *pick(key))]
    KERNELS.build(all_keys)
    rows, totals = [], {"shipped": 0.0}
    for key, n_in_plan in keys:
        copies = max(1, min(32, -(-2 * target.l2_bytes // device_bytes(key.fmt, key.n, key.k))))
        ref, base_us = run_variant(key, copies, args.iters)
        row = {"key": key.name, "in_plan": n_in_plan, "shipped_us": base_us, "variants": {}}
        totals["shipped"] += n_in_plan * base_us
        print(f"{key.name} ×{n_in_plan}: shipped {base_us:.2f} us", flush=True)
        for v in pick(key):
            tag = (f"pn{v.pf_next}" + ("-own" if v.pf_own else "") if v.pf_next else "own") if isinstance(v, PfKey) \
                else f"ahead{v.ahead}" + (f"-b{v.min_blocks}" if v.min_blocks != key.min_blocks else "")
            try:
                out, us = run_variant(v, copies, args.iters)
                bits = all(same_bits(out[k], t) for k, t in ref.items())
                regs = KERNELS.get(v).registers
            except Exception as err:                                        # noqa: BLE001 — recorded, not fatal
                row["variants"][tag] = {"error": f"{type(err).__name__}: {err}"}
                print(f"  {v.name}: FAILED {type(err).__name__}: {err}", flush=True)
                continue
            row["variants"][tag] = {"name": v.name, "us": us, "same_bits": bits, "registers": regs}
            print(f"  {tag}: {us:.2f} us ({us / base_us - 1:+.1%}), same bits {bits}, {regs} registers", flush=True)
        rows.append(row)
    # Σ launches × chained µs per variant tag, a key without that variant (or with other bits) counted at its shipped
    # time; "best": each key at its fastest same-bits variant or shipped
    tags = sorted({t for r in rows for t in r["variants"]})
    for tag in tags + ["best"]:
        totals[tag] = sum(r["in_plan"] * min([r["shipped_us"]] + [v["us"] for t, v in r["variants"].items()
                                                                   if v.get("same_bits") and tag in (t, "best")])
                          for r in rows)
    print("Σ launches × chained µs over the step's Q4_K/Q5_K GEMVs: "
          + ", ".join(f"{k} {v:.0f}" for k, v in totals.items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"copy_gbs": copy, "device": torch.cuda.get_device_name(),
                                              "rows": rows, "totals_us": totals}, indent=1))


if __name__ == "__main__":
    main()
