"""kq_loop_count: instructions per unit in the unit loop of the k-quant decode GEMVs (templates/gemv_kq.cu.j2), shipped
keys beside experiment fields (e.g. `kq_lean`), with registers — the issue-slot side of issue 34, on any machine.

The loop is the largest backward branch whose body holds an mma (staged keys: one unit per trip; loaded keys of
≤ 16 rows: two). PTX always (NVRTC); SASS when nvdisasm or cuobjdump is found (the nvidia-cuda-nvdisasm /
nvidia-cuda-cuobjdump wheels, PATH, or --disasm), which is what the warps issue. Static counts: a branch inside the
loop (the staging of the last units) is counted as taken.

    PYTHONPATH=. python -m lab.kq_loop_count --arch sm_90 --ms 1,8 --variant kq_lean=1 [--ops]
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

from compiler.build_cache import build_kernels
from compiler.kernels import gemv, gemv_rules
from compiler.targets import lookup

SHAPES = {"gate_up": (34816, 5120, "silu_mul"), "qkv": (10240, 5120, "none"), "out": (5120, 6144, "residual"),
          "down": (5120, 17408, "residual")}


def disassembler(explicit: str | None = None) -> list[str] | None:
    """The command that prints a cubin's SASS: nvdisasm (labels) or cuobjdump -sass (addresses); None if neither."""
    if explicit:
        return [explicit, "-c"] if "nvdisasm" in explicit else [explicit, "-sass"]
    import nvidia
    for name, args in (("nvdisasm", ["-c"]), ("cuobjdump", ["-sass"])):
        found = [p for d in nvidia.__path__ for p in Path(d).glob(f"*/bin/{name}")] or \
            ([Path(shutil.which(name))] if shutil.which(name) else [])
        if found:
            return [str(found[0]), *args]
    return None


def _largest_loop(ins: list[str], target_of, marker: str) -> list[str]:
    best: list[str] = []
    for i, s in enumerate(ins):
        j = target_of(i, s)
        if j is not None and j <= i and any(marker in b for b in ins[j:i + 1]) and i + 1 - j > len(best):
            best = ins[j:i + 1]
    return best


def sass_loop(text: str) -> list[str]:
    ins, labels, addrs = [], {}, {}
    for line in text.splitlines():
        if m := re.match(r"\s*\.(L_x_\d+):", line):
            labels[m.group(1)] = len(ins)
        elif m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line):
            addrs[int(m.group(1), 16)] = len(ins)
            ins.append(m.group(2))

    def target(i, s):
        if "BRA" not in s:
            return None
        if m := re.search(r"(L_x_\d+)", s):
            return labels.get(m.group(1))
        m = re.search(r"BRA\s+(?:\S+,\s*)?(0x[0-9a-f]+)", s)
        return addrs.get(int(m.group(1), 16)) if m else None
    return _largest_loop(ins, target, "HMMA")


def ptx_loop(text: str) -> list[str]:
    ins, labels = [], {}
    for line in text.splitlines():
        s = line.strip()
        if m := re.match(r"(\$L__\w+):", s):
            labels[m.group(1)] = len(ins)
        elif s.endswith(";") and not s.startswith(("//", ".", "{", "}")):
            ins.append(s)

    def target(i, s):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+)", s)
        return labels.get(m.group(1)) if m else None
    return _largest_loop(ins, target, "mma")


def opcode(s: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", s).split()[0].split(".")[0]


def units_per_trip(key) -> int:
    return 1 if key.stage_w or key.m > 16 else 2


def count(key, root: str, disasm: list[str] | None) -> dict:
    """Registers and per-unit PTX / SASS instruction counts of one k-quant GEMV key's unit loop."""
    b = build_kernels([key], root=root, jobs=1, ptx=True, progress=False).built[0]
    per = units_per_trip(key)
    ptx = ptx_loop((b.dir / "kernel.ptx").read_text())
    row = {"name": key.name, "registers": b.meta["registers"], "stack": b.meta["stack_bytes"],
           "ptx_per_unit": len(ptx) / per}
    if disasm:
        sass = sass_loop(subprocess.run([*disasm, str(b.cubin)], capture_output=True, text=True, check=True).stdout)
        row.update(sass_per_unit=len(sass) / per, ops={k: v / per for k, v in Counter(map(opcode, sass)).most_common()})
    return row


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--fmts", default="q4_k,q5_k")
    ap.add_argument("--shapes", default="gate_up", help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--ms", default="1,8")
    ap.add_argument("--variant", action="append", default=[], help="a NINFER_GEMV rule set beside the shipped key "
                    "(repeatable), e.g. kq_lean=1")
    ap.add_argument("--root", default="/tmp/kq_loop_count")
    ap.add_argument("--disasm", default=None, help="nvdisasm or cuobjdump binary (default: found in the nvidia wheels)")
    ap.add_argument("--ops", action="store_true", help="print each loop's instruction mix")
    args = ap.parse_args(argv)
    target, disasm = lookup(args.arch), disassembler(args.disasm)
    rows = []
    for fmt in args.fmts.split(","):
        for shape in args.shapes.split(","):
            n, k, epi = SHAPES[shape]
            for m in (int(v) for v in args.ms.split(",")):
                base = gemv.make_key(fmt, n, k, m, target, epi)
                for key in dict.fromkeys([base] + [gemv_rules.apply_overrides(base, v) for v in args.variant]):
                    r = count(key, args.root, disasm)
                    rows.append(r)
                    sass = f"SASS {r['sass_per_unit']:5.0f}" if disasm else "SASS     -"
                    print(f"{r['name']:<58} {r['registers']:>4} regs  {sass}  PTX {r['ptx_per_unit']:5.0f}  per unit")
                    if args.ops and disasm:
                        print("    " + " ".join(f"{o}:{c:g}" for o, c in r["ops"].items()))
    if not disasm:
        print("(no nvdisasm / cuobjdump: pip install nvidia-cuda-nvdisasm for SASS counts)")
    return rows


if __name__ == "__main__":
    main()
