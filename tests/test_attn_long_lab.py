"""lab/attn_long.py's dry run on the CPU: its options, the keys it would time (the runtime's 128K profile's
attn_decode at the 27B shape, and the split variants asked for), and its byte counts — the same as the kernel
lab's case builder counts, with the split partials by the rule templates/common/paged.cuh applies."""
import pytest

from compiler.kernels import attn_decode
from compiler.targets import lookup
from lab import attn_long
from lab.cases import make_case


def test_dry_run_lists_every_context_and_query_rows_with_the_profiles_keys(capsys):
    attn_long.main(["--dry-run"])
    text = capsys.readouterr().out
    rows = attn_long.dry_run(attn_long.parse(["--dry-run"]))
    assert [(r["context"], r["t"]) for r in rows] == [(c, t) for c in (4096, 32768, 131072) for t in (1, 4)]
    h200 = attn_decode.choose_splits(4, 2048, lookup("sm_90"))
    for r in rows:
        assert r["name"] in text and f"p64x2048_s{h200}" in r["name"] and r["grid"] == (h200, 4, 1)
    big = rows[-2]                                             # T = 1 at 131,072: 2,048 pages, 32 per split
    assert big["kv"] == 131072 * 4 * 2 * (256 + 8) and big["active_splits"] == -(-2048 // 32)
    variants = attn_long.dry_run(attn_long.parse(["--dry-run", "--contexts", "131072", "--t", "1",
                                                  "--splits", "132,264", "--arch", "sm_86"]))
    assert [r["splits"] for r in variants] == [attn_decode.choose_splits(4, 2048, lookup("sm_86")), 132, 264]
    assert [r["active_splits"] for r in variants][1:] == [128, 256]


@pytest.mark.parametrize("t", [1, 4])
def test_byte_counts_match_the_kernel_labs_cases(t):
    key = attn_decode.make_key(24, 4, 256, 1, t, "int8", 2048, lookup("sm_90"))
    moved = attn_long.attn_bytes(key, 4096)
    assert moved["useful"] == make_case(key, "cpu", 0, ctx=4096).bytes
    assert moved["partials"] == 2 * t * 24 * moved["active_splits"] * (256 * 4 + 8)


def test_bad_options_are_one_line(capsys):
    for argv, message in [(["--contexts", "4096,x"], "comma-separated integers"), (["--t", "0"], "positive"),
                          (["--contexts", "200000"], "exceeds the block table of 2048 pages")]:
        with pytest.raises(SystemExit) as err:
            attn_long.main(["--dry-run", *argv])
        assert message in str(err.value)


def test_the_table_of_a_gpu_run():
    """The table a GPU run prints last (checked here, not after the device time): a measured row and a failed one."""
    ok = {"context": 131072, "t": 1, "splits": 66, "us": 80.0, "useful": 276_860_000, "GBps": 3460.0,
          "read_fraction": 0.78, "us_chain": 75.0, "read_fraction_chain": 0.83, "combine_share": 0.02}
    bad = {"context": 4096, "t": 4, "splits": 264, "error": "CudaError: simulated"}
    text = attn_long.table({"device": "NVIDIA H200", "read_GBps": 4449.0, "copy_GBps": 4283.0, "iters": 50,
                            "results": [ok, bad]})
    assert "read stream 4,449 GB/s" in text and "78.0" in text and "83.0" in text and "FAILED: CudaError" in text
