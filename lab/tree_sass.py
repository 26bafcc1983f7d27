"""tree_sass: are the kernels a runtime profile launches SASS-identical in this tree and another checkout?

Runs on any machine (NVRTC needs no GPU): lists the 27B profile's kernel keys here (every bucket of
`--cohorts` with `--draft`, at each `--max-context`), asks the other tree to plan the same shapes and
build its keys of the same names, builds them here, and compares the cubins — bytes first, then the
SASS text (`cuobjdump -sass`, from the nvidia-cuda-cuobjdump wheel) where the bytes differ.

    PYTHONPATH=. python -m lab.tree_sass --old build/old_tree --arch sm_86,sm_90 --out /tmp/sass.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# Runs inside a tree (its own compiler package): plans the shapes, builds the keys, prints name → cubin.
BUILD_IN_TREE = r"""
import json, sys
from compiler.build_cache import build_kernels
from compiler.spec import load_spec
from compiler.targets import lookup
import compiler.buckets as buckets
args = json.loads(sys.argv[1])
spec = load_spec("model_specs/qwen3.8-27b.yaml")
keys = []
for arch in args["archs"]:
    for ctx in args["contexts"]:
        for entry, b, t in args["shapes"]:
            if hasattr(buckets, "profile_of"):
                plan = buckets.plan_bucket(spec, lookup(arch), entry, b, t, buckets.profile_of(spec, max_context=ctx))
            else:        # a tree from before runtime profiles: the spec's runtime section carries the context
                from dataclasses import replace
                rt_spec = replace(spec, runtime=replace(spec.runtime, max_context=ctx))
                plan = buckets.plan_bucket(rt_spec, lookup(arch), entry, b, t)
            keys += [k for k in plan.keys() if k.name in args["names"] or not args["names"]]
built = build_kernels(list(dict.fromkeys(keys)), root=args["root"], jobs=args["jobs"], progress=False)
print(json.dumps({b.key.name: str(b.cubin) for b in built.built}))
"""


def build_in(tree: Path, shapes, archs, contexts, root: str, jobs: int, names=()) -> dict[str, str]:
    arg = json.dumps({"shapes": shapes, "archs": archs, "contexts": contexts, "root": root, "jobs": jobs,
                      "names": list(names)})
    done = subprocess.run([sys.executable, "-c", BUILD_IN_TREE, arg], cwd=tree, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(tree)))
    if done.returncode:
        raise SystemExit(f"build in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def cuobjdump() -> str:
    """The nvidia-cuda-cuobjdump wheel's binary (`pip install nvidia-cuda-cuobjdump`), else one on PATH."""
    import shutil

    import nvidia
    found = [p for d in nvidia.__path__ for p in Path(d).glob("*/bin/cuobjdump")]
    tool = str(found[0]) if found else shutil.which("cuobjdump")
    if tool is None:
        raise SystemExit("cuobjdump not found: pip install nvidia-cuda-cuobjdump")
    return tool


def sass(cubin: str) -> str:
    out = subprocess.run([cuobjdump(), "-sass", cubin], capture_output=True, text=True, check=True).stdout
    return "\n".join(line for line in out.splitlines() if "code for sm_" not in line and "Function :" not in line)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="the other checkout (its repository root)")
    ap.add_argument("--arch", default="sm_86,sm_90")
    ap.add_argument("--cohorts", default="1,2,4,8")
    ap.add_argument("--draft", type=int, default=3)
    ap.add_argument("--max-context", default="32768,32832", help="the spec's and the bench's contexts")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from compiler.buckets import profile_of
    from compiler.spec import load_spec

    spec = load_spec("model_specs/qwen3.8-27b.yaml")
    cohorts = tuple(int(c) for c in args.cohorts.split(","))
    shapes = profile_of(spec, cohorts=cohorts, draft=args.draft).shapes()
    archs, contexts = args.arch.split(","), [int(c) for c in args.max_context.split(",")]
    here = build_in(Path.cwd(), shapes, archs, contexts, "/tmp/tree_sass/new", args.jobs)
    there = build_in(Path(args.old).resolve(), shapes, archs, contexts, "/tmp/tree_sass/old", args.jobs, here)
    missing = sorted(set(here) - set(there))
    same_bytes = [n for n in here if n in there and Path(here[n]).read_bytes() == Path(there[n]).read_bytes()]
    differ = [n for n in here if n in there and n not in same_bytes]
    sass_differ = [n for n in differ if sass(here[n]) != sass(there[n])]
    result = {"kernels": len(here), "same_cubin_bytes": len(same_bytes), "same_sass_only": len(differ) - len(sass_differ),
              "sass_differ": sass_differ, "not_in_old_tree": missing, "archs": archs, "contexts": contexts}
    print(json.dumps({k: v for k, v in result.items()}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
