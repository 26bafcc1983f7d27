"""codegen: renders a kernel key into CUDA C++ source from `templates/<family>.cu.j2`.

Owns the Jinja environment (StrictUndefined; the variables are exactly the key's fields), the NVRTC
options (each with its reason) and the content hash that names a build folder. Never compiles.
A key class may name another template (`template`) and another folder inside the repository to
find it in (`template_dir`, searched before `templates/`, whose common files stay importable and
includable: NVRTC's include path is always `templates/`). A template may render another family's
template inside it (`render_member(template, fields, member)`: a launch chain's members); the key class
lists those templates (`member_templates`) so that their text is part of its hash.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import jinja2

from .kernels import KernelKey

REPO_ROOT = Path(__file__).resolve().parent.parent
TEMPLATE_DIR = REPO_ROOT / "templates"

# (option, why). Include directories are added by compiler.nvrtc.include_options and are not hashed:
# they differ between machines, and the header text they point to is hashed instead.
NVRTC_OPTIONS: tuple[tuple[str, str], ...] = (
    ("-std=c++17", "constexpr if and structured bindings in templates; what CUDA.md checked"),
    ("--fmad=true", "allow FMA contraction (NVRTC default, made explicit: it is part of the numerics and "
                    "of the hash); bit-exact paths use explicit __fmaf_rn/__fmul_rn intrinsics instead"),
    ("--device-as-default-execution-space", "constexpr helpers in the common headers need no __device__"),
    ("-DNINFER_GEN=1", "lets headers tell NVRTC builds apart from host-side syntax checks"),
)


def nvrtc_options() -> list[str]:
    return [opt for opt, _why in NVRTC_OPTIONS]


@dataclass(frozen=True)
class Rendered:
    key: KernelKey
    source: str
    hash: str                     # 12 hex digits
    options: tuple[str, ...]
    template: str                 # path relative to the repository, e.g. templates/gemv.cu.j2


@lru_cache(maxsize=None)
def _env(search: tuple[str, ...]) -> jinja2.Environment:
    """One environment per search path (folders in order, `templates/` last)."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(list(search)),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True)
    env.globals["render_member"] = lambda template, fields, member: \
        env.get_template(template).render(**fields, member=member)
    return env


def template_name(key: KernelKey) -> str:
    """`<family>.cu.j2`, unless the key class names another (lab keys of archived versions)."""
    return getattr(key, "template", None) or f"{key.family}.cu.j2"


def template_dir(key: KernelKey) -> Path:
    """`templates/`, unless the key class sets `template_dir` (a folder inside the repository)."""
    return Path(getattr(key, "template_dir", None) or TEMPLATE_DIR).resolve()


def template_path(key: KernelKey) -> str:
    """The key's template relative to the repository, e.g. `templates/gemv.cu.j2` (banner and meta)."""
    return (template_dir(key) / template_name(key)).relative_to(REPO_ROOT).as_posix()


def _search_path(key: KernelKey) -> tuple[str, ...]:
    return tuple(dict.fromkeys((str(template_dir(key)), str(TEMPLATE_DIR))))


def _text_hash_inputs(key: KernelKey) -> str:
    """Template text plus every common file, headers and Jinja macros (a change there rebuilds
    everything: simple and safe)."""
    parts = [(template_dir(key) / name).read_text()
             for name in (template_name(key), *getattr(key, "member_templates", ()))]
    for header in sorted((TEMPLATE_DIR / "common").glob("*")):
        parts.append(f"//{header.name}\n{header.read_text()}")
    return "\n".join(parts)


def key_json(key: KernelKey) -> str:
    return json.dumps({"family": key.family, **key.fields()}, sort_keys=True)


def image_arch(key: KernelKey, ptx_only: bool = False) -> str:
    """What NVRTC's `--gpu-architecture` is for a build: the key's arch (a cubin, PTX beside it), or its
    compute_XX for a PTX-only build (an arch path run on a newer device, JIT-compiled by the driver)."""
    return "compute_" + key.compile_arch[3:] if ptx_only else key.arch


def kernel_hash(key: KernelKey, options: list[str], nvrtc_version: str, ptx_only: bool = False) -> str:
    h = hashlib.sha256()
    for part in (key_json(key), _text_hash_inputs(key), "\0".join(options), nvrtc_version, image_arch(key, ptx_only)):
        h.update(part.encode())
        h.update(b"\0\1")
    return h.hexdigest()[:12]


def render(key: KernelKey, nvrtc_version: str, ptx_only: bool = False) -> Rendered:
    """Key → source. The banner and `KERNEL_NAME` come from here; the template sees only key fields.
    `ptx_only`: the hash is the PTX-only build's (same source, another folder: build_cache.kernel_dir)."""
    key.check_arch()
    options = nvrtc_options()
    digest = kernel_hash(key, options, nvrtc_version, ptx_only)
    body = _env(_search_path(key)).get_template(template_name(key)).render(**key.fields())
    path = template_path(key)
    banner = (f"// kernel: {key.name}\n// key: {key_json(key)}\n// hash: {digest}\n"
              f"// template: {path}\n// generated by compiler.codegen; do not edit\n"
              f"#define KERNEL_NAME {key.name}\n")
    return Rendered(key, banner + body, digest, tuple(options), path)
