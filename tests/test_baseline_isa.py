"""The baseline C objects hold no AVX code, so the package imports on any x86-64.

Each baseline source is compiled with setup.py's own flags (read from setup.py,
plus Python's compile flags as setuptools adds them) and disassembled: no ymm or
zmm register and no VEX-encoded (v-prefixed) instruction may appear.  The AVX2
unit compiled with its flags must show ymm registers (and no zmm), the AVX-512
unit zmm registers, so the check can fail.
"""

import ast
import platform
import re
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

if not (ROOT / "setup.py").is_file() or not (ROOT / "csrc").is_dir():
    pytest.skip("needs the source tree (setup.py, csrc/); the tests run from an installed "
                "package skip it", allow_module_level=True)

pytestmark = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64")
    or shutil.which("objdump") is None
    or shutil.which("gcc") is None,
    reason="needs x86-64 with gcc and objdump",
)

WIDE_REGISTER = r"%[yz]mm\d"
BASELINE_SOURCES = ["csrc/decode_block.c", "csrc/dispatch.c", "csrc/kernels_scalar.c",
                    "csrc/quantize_k.c", "csrc/threadpool.c"]


def setup_py_flags():
    """(BASE_CFLAGS, KERNEL_SOURCES, {isa source: flags}) as setup.py assigns them on POSIX."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    base, sources, isa = None, None, {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target, value = node.targets[0], node.value
        if isinstance(target, ast.Name) and target.id == "BASE_CFLAGS":
            base = ast.literal_eval(value.body if isinstance(value, ast.IfExp) else value)
        elif isinstance(target, ast.Name) and target.id == "KERNEL_SOURCES":
            sources = ast.literal_eval(value)
        elif (
            isinstance(target, ast.Subscript)
            and isinstance(target.value, ast.Name)
            and target.value.id == "ISA_SOURCES"
        ):
            isa[ast.literal_eval(target.slice)] = ast.literal_eval(value)
    assert base and sources and isa, (
        "setup.py no longer assigns BASE_CFLAGS/KERNEL_SOURCES/ISA_SOURCES"
    )
    return base, sources, isa


def compiler():
    cc = shlex.split(sysconfig.get_config_var("CC") or "gcc")
    return cc if shutil.which(cc[0]) else ["gcc"]


def compile_and_disassemble(source, extra_flags, tmp_path):
    """Compiles one C file like setup.py does and returns objdump -d of the object."""
    base, _, _ = setup_py_flags()
    python_flags = shlex.split(sysconfig.get_config_var("CFLAGS") or "")
    python_flags += shlex.split(sysconfig.get_config_var("CCSHARED") or "")
    obj = tmp_path / (Path(source).stem + ".o")
    cmd = [
        *compiler(),
        *python_flags,
        "-I" + str(ROOT / "ggmlopt" / "include"),
        "-I" + str(ROOT / "csrc"),
        "-c",
        str(ROOT / source),
        "-o",
        str(obj),
        *base,
        *extra_flags,
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(obj)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def wide_instructions(disassembly):
    """Instructions that name a ymm/zmm register or are VEX/EVEX-encoded (v-prefixed)."""
    found = []
    for line in disassembly.splitlines():
        parts = line.split("\t")
        if len(parts) < 2 or not re.match(r"\s*[0-9a-f]+:$", parts[0]):
            continue
        insn = parts[-1].strip()
        if re.search(WIDE_REGISTER, insn) or re.match(r"v(?!err|erw)[a-z0-9]+\s", insn + " "):
            found.append(insn)
    return found


def test_setup_py_compiles_every_baseline_source_checked_here():
    _, sources, isa = setup_py_flags()
    assert sorted(sources) == BASELINE_SOURCES
    assert list(isa) == ["csrc/kernels_avx2.c", "csrc/kernels_avx512.c",
                         "csrc/kernels_avx512bf16.c"]


@pytest.mark.parametrize("source", BASELINE_SOURCES)
def test_baseline_object_holds_no_avx(source, tmp_path):
    wide = wide_instructions(compile_and_disassemble(source, [], tmp_path))
    assert not wide, f"{source} compiled with baseline flags uses AVX: {wide[:10]}"


def test_avx2_object_does_hold_ymm(tmp_path):
    _, _, isa = setup_py_flags()
    source = "csrc/kernels_avx2.c"
    disassembly = compile_and_disassemble(source, isa[source], tmp_path)
    wide = wide_instructions(disassembly)
    assert any("ymm" in insn for insn in wide), "the AVX2 unit shows no ymm: the check cannot fail"
    assert any(insn.startswith("vfmadd") for insn in wide), "the AVX2 unit shows no FMA"
    # an AVX2-only CPU runs it: not one AVX-512 register
    zmm = [insn for insn in wide if re.search(r"%zmm\d|%k[1-7]", insn)]
    assert not zmm, f"the AVX2 unit uses AVX-512: {zmm[:10]}"


def test_avx512_object_does_hold_zmm(tmp_path):
    _, _, isa = setup_py_flags()
    source = "csrc/kernels_avx512.c"
    wide = wide_instructions(compile_and_disassemble(source, isa[source], tmp_path))
    assert any("zmm" in insn for insn in wide), "the AVX-512 unit shows no zmm"
    assert any(re.search(r"%k[1-7]", insn) for insn in wide), "the AVX-512 unit uses no mask"


def test_avx512bf16_object_holds_vdpbf16ps_and_is_apart_from_the_avx512_unit(tmp_path):
    """vdpbf16ps is in the bf16 unit alone: the avx512 unit runs on AVX-512 CPUs
    without AVX512-BF16 (Skylake-X, Ice Lake), which would fault on it."""
    _, _, isa = setup_py_flags()
    bf16 = wide_instructions(compile_and_disassemble("csrc/kernels_avx512bf16.c",
                                                     isa["csrc/kernels_avx512bf16.c"], tmp_path))
    assert any(insn.startswith("vdpbf16ps") for insn in bf16), "the bf16 unit shows no vdpbf16ps"
    avx512 = wide_instructions(compile_and_disassemble("csrc/kernels_avx512.c",
                                                       isa["csrc/kernels_avx512.c"], tmp_path))
    assert not any(insn.startswith(("vdpbf16ps", "vcvtne2ps2bf16", "vcvtneps2bf16"))
                   for insn in avx512), "the avx512 unit uses AVX512-BF16"
