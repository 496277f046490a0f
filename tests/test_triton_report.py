"""pallas_kernels/triton_report.py's text tools: the register cap placed in a kernel's PTX and
the SASS instruction counts. (Compiling for sm_90 needs the triton package, which the project
does not depend on; these parts need none.)"""

from __future__ import annotations

import numpy as np
import pytest

from pallas_kernels import triton_report as tr


def test_register_cap_goes_after_the_kernels_thread_count():
    rng = np.random.default_rng()
    warps, cap = int(rng.choice([1, 2, 4, 8])), int(rng.integers(16, 256))
    ptx = (".visible .entry k(\n.param .u64 k_param_0\n)\n"
           f".reqntid {32 * warps}\n{{\n\tret;\n}}\n")
    out = tr.capped(ptx, warps, cap)
    lines = out.splitlines()
    i = lines.index(f".reqntid {32 * warps}")
    assert lines[i + 1] == f".maxnreg {cap}" and out.count(".maxnreg") == 1
    assert out.replace(f".maxnreg {cap}\n", "") == ptx
    with pytest.raises(ValueError, match=rf"\.reqntid {64 * warps}"):
        tr.capped(ptx, 2 * warps, cap)


def _sass(body: list[str]) -> str:
    """nvdisasm-like text: each line given as an instruction gets an address comment."""
    out, addr = [], 0
    for line in body:
        if line.startswith(".L_x_") or not line:
            out.append(line)
            continue
        out.append(f"        /*{addr:04x}*/                   {line} ;")
        addr += 16
    return "\n".join(out)


def test_sass_counts_kinds_and_loop_bodies():
    rng = np.random.default_rng()
    n_pre, n_loop, n_post = (int(x) for x in rng.integers(1, 20, 3))
    pre = ["MOV R1, c[0x0][0x28]"] + ["LDG.E.128 R4, desc[UR4][R2.64]"] * n_pre
    loop = [".L_x_0:"] + ["HMMA.16816.F32.BF16 R8, R12, R16, R8"] * n_loop + [
        "MUFU.EX2 R3, R3", "@P0 BRA `(.L_x_0)"]
    post = ["@!P1 STG.E desc[UR4][R2.64], R5"] * n_post + ["EXIT", ".L_x_1:", "BRA `(.L_x_1)"]
    c = tr.sass_counts(_sass(pre + loop + post))
    assert c["all"] == 1 + n_pre + n_loop + 2 + n_post + 2
    # the loop: its HMMAs, the MUFU and the branch back; the end's branch to itself is no loop
    assert c["loops"] == [n_loop + 2]
    assert (c["LDG"], c["HMMA"], c["MUFU"], c["STG"], c["BRA"]) == (n_pre, n_loop, 1, n_post, 2)
    assert "L_x_0" not in c and c.get("HGMMA", 0) == 0


def test_bad_register_caps_are_named(capsys):
    for caps in ("300", "8", "two"):
        with pytest.raises(SystemExit):
            tr.main(["--caps", caps])
        err = capsys.readouterr().err
        assert "--caps" in err and repr(caps) in err and "16 to 255" in err, err
