"""gemv_rules: experiment rules for decode-GEMV key fields (CompileOptions.gemv, `NINFER_GEMV`): how units stream
and the registers, for A/B runs of a whole step without a code change. A rule replaces fields of the shipped key
where the result is a valid key (the key's own checks decide); the lowering applies them to a projection's key
after the passes' folds (lower_rules._matmul), the kernel lab to the keys it times.

    "prefetch=2,interleave=0"                   every key
    "5120x6144:min_blocks=3;prefetch=1"        the first rule that applies and gives a valid key wins
    "m8:code_bias=1,stage_w=2;m8:stage_w=2"    keys of at most 8 rows; a k-quant field passes other formats on
    "m9-32:tiles=2,depth=2"                     keys of 9 to 32 rows
    "10240x5120/m8:min_blocks=3"                both: that shape at most 8 rows
    "q6_k/5120x17408:splits=3"                  a weight format too (splits replace a stream-K grid)
    "q6_k/5120x17408:splits=1,stream_k=396"     a stream-K grid of 396 blocks
"""
from __future__ import annotations

from dataclasses import replace

from ..kquant import KFORMATS
from .weight_layout import FORMATS


# Fields an experiment rule may set: how units stream, row tiles per block and the registers (never the bits), and
# `warps`, `splits`, `stream_k`, `code_bias` and `kq_lean`, which change the summation (bits; batch invariance still holds).
def _flag(v: str) -> bool:
    if v not in ("0", "1", "false", "true"):
        raise ValueError(v)
    return v in ("1", "true")


OVERRIDABLE = {"prefetch": int, "interleave": _flag, "min_blocks": int, "stage_x": _flag, "warps": int, "splits": int,
               "stage_w": int, "code_bias": _flag, "tiles": int, "depth": int, "x_early": _flag, "kq_lean": _flag,
               "q6_lean": _flag, "stream_k": int}


def _rows(text: str) -> range | None:
    """`mR` → rows 1..R; `mA-B` → rows A..B; else None."""
    if not text.startswith("m"):
        return None
    lo, dash, hi = text[1:].partition("-")
    if dash and lo.isdigit() and hi.isdigit() and int(lo) <= int(hi):
        return range(int(lo), int(hi) + 1)
    return range(1, int(lo) + 1) if not dash and lo.isdigit() else None


def parse_overrides(rules: str) -> list[tuple[list[tuple[int, int] | range | str], dict]]:
    """"prefetch=2,interleave=0" → [([], fields)]: each rule's selectors (all must hold) and fields. Rules are
    separated by ';', and a rule may start with a shape `NxK:` that limits it to keys of that shape (e.g.
    "5120x6144:min_blocks=3;prefetch=1"), or with `mR:` / `mA-B:`, which limit it to keys of at most R rows / of A to
    B rows (e.g. "m8:min_blocks=4;stage_w=2", "m9-32:tiles=2"), or with both joined by '/'
    ("10240x5120/m8:min_blocks=3"), and a weight format may join them ("q6_k/5120x17408:splits=3"). A malformed rule
    raises ValueError naming it."""
    out = []
    for rule in (r.strip() for r in rules.split(";") if r.strip()):
        selector, _, body = rule.rpartition(":")
        where = []
        for part in (p.strip() for p in selector.split("/") if p.strip()):
            if rows := _rows(part):
                where.append(rows)
                continue
            if part in FORMATS or part in KFORMATS:
                where.append(part)
                continue
            n, _, k = part.partition("x")
            if not (n.strip().isdigit() and k.strip().isdigit()):
                raise ValueError(f"gemv override {rule!r}: {part!r} is not a shape NxK (e.g. 5120x6144), "
                                 "rows mR / mA-B (e.g. m8, m9-32) or a weight format (e.g. q6_k)")
            where.append((int(n), int(k)))
        fields = {}
        for item in body.split(","):
            name, _, value = (part.strip() for part in item.partition("="))
            if name not in OVERRIDABLE:
                raise ValueError(f"gemv override {rule!r}: {name!r} is not one of {', '.join(OVERRIDABLE)}")
            try:
                fields[name] = OVERRIDABLE[name](value)
            except ValueError:
                raise ValueError(f"gemv override {rule!r}: {item.strip()!r} needs a value, e.g. {name}=1") from None
        out.append((where, fields))
    return out


def apply_overrides(key, rules: str):
    """The first rule that applies to the key's shape and gives a valid key wins; else the key as it is."""
    for where, fields in parse_overrides(rules):
        if any(isinstance(w, range) and key.m not in w or isinstance(w, tuple) and w != (key.n, key.k)
               or isinstance(w, str) and w != key.fmt for w in where):
            continue
        if "splits" in fields and "stream_k" not in fields:
            fields = {"stream_k": 0, **fields}      # K splits in place of a stream-K grid
        try:
            return replace(key, **fields)
        except ValueError:
            continue
    return key
