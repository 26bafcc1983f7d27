"""targets: the table of GPUs the compiler can specialise for (SMs, memory, bandwidth, shared memory, L2).

Tile and split choices read these numbers; nothing here touches CUDA. `lookup("rtx3090")` or
`lookup("sm_86")` (an arch alone maps to that arch's reference card); unknown names raise TargetError.
`arch_path_target` picks the code a device runs: its own, another card's, or another arch's at the device's SMs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB


class TargetError(ValueError):
    """An unknown target name or a malformed `sm_XX` arch."""


@dataclass(frozen=True)
class Target:
    name: str
    arch: str                 # "sm_86": cubin arch; the PTX arch is the matching compute_XX
    sms: int
    memory_bytes: int
    bandwidth_gbs: float      # vendor peak DRAM bandwidth
    smem_per_sm: int          # shared memory per SM
    smem_per_block: int       # largest dynamic shared memory one block may opt into
    l2_bytes: int

    @property
    def cc(self) -> int:
        """Compute capability as an integer, 86 for sm_86."""
        return int(self.arch[3:])

    @property
    def ptx_arch(self) -> str:
        return "compute_" + self.arch[3:]


TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("rtx3090", "sm_86", 82, 24 * GIB, 936.0, 100 * KIB, 99 * KIB, 6 * MIB),
    Target("rtx3080", "sm_86", 68, 10 * GIB, 760.0, 100 * KIB, 99 * KIB, 5 * MIB),
    Target("a6000", "sm_86", 84, 48 * GIB, 768.0, 100 * KIB, 99 * KIB, 6 * MIB),
    Target("a100", "sm_80", 108, 80 * GIB, 2039.0, 164 * KIB, 163 * KIB, 40 * MIB),
    Target("rtx4090", "sm_89", 128, 24 * GIB, 1008.0, 100 * KIB, 99 * KIB, 72 * MIB),
    Target("h200", "sm_90", 132, 141 * 10**9, 4800.0, 228 * KIB, 227 * KIB, 50 * MIB),
)}

# An arch given alone (`--arch sm_XX`) borrows the numbers of one card of that arch.
ARCH_DEFAULT = {"sm_80": "a100", "sm_86": "rtx3090", "sm_87": "rtx3090", "sm_89": "rtx4090",
                "sm_90": "h200"}
SUPPORTED_ARCHS = tuple(sorted(ARCH_DEFAULT))


def parse_arch(arch: str) -> str:
    """Normalise `sm_86`, `sm86` or `86` to `sm_86`; anything else is a TargetError."""
    m = re.fullmatch(r"(?:sm_?)?(\d{2,3})", arch.strip().lower())
    if not m or f"sm_{m.group(1)}" not in ARCH_DEFAULT:
        raise TargetError(f"unsupported arch {arch!r}: expected one of {', '.join(SUPPORTED_ARCHS)} "
                          "(Ampere features only, so sm_80 or newer)")
    return f"sm_{m.group(1)}"


def supports_pdl(arch: str) -> bool:
    """Programmatic dependent launch (a kernel may start while its predecessor finishes): sm_90 and newer,
    where the templates compile `pdl_entry()` in (common/ptx.cuh)."""
    return int(parse_arch(arch)[3:]) >= 90


def arch_path_target(device_arch: str, path: str | None = None, device_sms: int | None = None) -> Target:
    """The target whose code a device of `device_arch` (`sm_XX`) runs: its own (`path` None), or the card or arch
    `path` names, whose kernels run there as compute_XX PTX that the driver JIT-compiles — PDL and gemm_wg follow
    the path's arch. A card (`rtx3090`) gives that card's kernels exactly: its tiles, and grids sized for its SMs
    (on a 132-SM H200 a 3090's one-wave grid of 82 × k blocks leaves 50 SMs idle). An arch alone (`sm_86`) gives
    that arch's code — its features and shared-memory limits — with the grids sized for the device it runs on
    (`device_sms`, else the device arch's reference card): the code path's efficiency apart from the SM count.
    PTX runs on its own compute capability and newer: a path above the device's is a TargetError."""
    if path is None:
        return lookup(parse_arch(device_arch))
    target = lookup(path)
    m = re.fullmatch(r"(?:sm_?)?(\d{2,3})", device_arch.strip().lower())
    if m is None:
        raise TargetError(f"device arch {device_arch!r}: expected sm_XX")
    if target.cc > int(m.group(1)):
        raise TargetError(f"arch path {target.arch} ({target.name}) cannot run on this {m.group(1)[:-1]}."
                          f"{m.group(1)[-1]} device: {target.ptx_arch} PTX needs compute capability "
                          f"{target.cc // 10}.{target.cc % 10} or newer; choose sm_{m.group(1)} or an older arch")
    if path.strip().lower() in TARGETS:
        return target
    device = TARGETS[ARCH_DEFAULT[f"sm_{m.group(1)}"]] if f"sm_{m.group(1)}" in ARCH_DEFAULT else target
    sms = device_sms or device.sms
    if sms == target.sms:
        return target
    return replace(target, name=f"{target.arch}@{sms}sm", sms=sms, l2_bytes=device.l2_bytes)


def lookup(name: str) -> Target:
    """A target by card name (`rtx3090`) or by arch (`sm_86`, taking that arch's reference card's numbers)."""
    key = name.strip().lower()
    if key in TARGETS:
        return TARGETS[key]
    if key.startswith("sm") or key.isdigit():
        arch = parse_arch(key)
        base = TARGETS[ARCH_DEFAULT[arch]]
        return base if base.arch == arch else Target(f"{base.name}@{arch}", arch, base.sms,
                                                     base.memory_bytes, base.bandwidth_gbs,
                                                     base.smem_per_sm, base.smem_per_block, base.l2_bytes)
    raise TargetError(f"unknown target {name!r}: expected one of {', '.join(TARGETS)} or an arch "
                      f"({', '.join(SUPPORTED_ARCHS)})")


def resolve(target: str | None = None, arch: str | None = None) -> Target:
    """The CLI rule: `--arch` wins over `--target`; neither gives the RTX 3090."""
    if arch is not None:
        return lookup(parse_arch(arch))
    return lookup(target or "rtx3090")
