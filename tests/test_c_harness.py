"""The pure-C test harness (csrc/tests/) as part of the Python suite.

Each script builds csrc/tests/test_kernels from the kernel sources and runs it:
natively (every dispatch table this CPU runs), cross-compiled for aarch64 under
qemu (the NEON table), and with AddressSanitizer + UndefinedBehaviorSanitizer
(plus valgrind memcheck where installed).  The harness prints one line per
failed check and ends with "N passed, M failed".
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

if not (ROOT / "setup.py").is_file() or not (ROOT / "csrc").is_dir():
    pytest.skip("needs the source tree (setup.py, csrc/); the tests run from an installed "
                "package skip it", allow_module_level=True)
SCRIPTS = ROOT / "csrc" / "tests"
EXIT_SKIP = 77
SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed$", re.MULTILINE)

pytestmark = pytest.mark.skipif(
    os.name != "posix" or shutil.which("bash") is None or shutil.which("gcc") is None,
    reason="the C harness scripts need bash and gcc",
)


def run_script(name, *args, timeout=600):
    """Runs csrc/tests/<name> from the repository root; returns (exit code, output)."""
    proc = subprocess.run(
        ["bash", str(SCRIPTS / name), *args],
        check=False,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stdout


def excerpt(output, max_fail_lines=60, tail_lines=40):
    """The FAIL lines and the end of a long harness output, for the test report."""
    lines = output.splitlines()
    fails = [line for line in lines if line.startswith("FAIL")]
    shown = fails[:max_fail_lines]
    if len(fails) > max_fail_lines:
        shown.append(f"... and {len(fails) - max_fail_lines} more FAIL lines")
    return "\n".join(shown + ["--- end of output ---"] + lines[-tail_lines:])


def assert_harness_passed(code, output, what):
    summaries = SUMMARY.findall(output)
    if code != 0:
        pytest.fail(f"{what}: exit status {code}\n{excerpt(output)}", pytrace=False)
    assert summaries, f"{what}: no 'N passed, M failed' line\n{excerpt(output)}"
    for passed, failed in summaries:
        assert int(failed) == 0, f"{what}: {failed} checks failed\n{excerpt(output)}"
        # thousands of checks run on any machine; a handful means the harness broke
        assert int(passed) > 1000, f"{what}: only {passed} checks ran\n{excerpt(output)}"


def expected_native_tables():
    """The tables the native harness must test: every path this CPU runs."""
    from ggmlopt import kernels

    return [p for p in ("avx2", "avx512") if p in kernels.simd_paths()]


def test_harness_native():
    code, output = run_script("run_native.sh")
    assert_harness_passed(code, output, "native harness")
    tables = re.search(r"^kernel tables under test:(.*)$", output, re.MULTILINE)
    assert tables, excerpt(output)
    for path in expected_native_tables():
        assert path in tables.group(1).split(), f"the {path} table was not tested: {tables.group(0)}"


def test_harness_neon_under_qemu():
    code, output = run_script("run_neon_qemu.sh")
    if code == EXIT_SKIP:
        pytest.skip(output.strip().splitlines()[-1] if output.strip() else "cross tools missing")
    assert_harness_passed(code, output, "aarch64 harness under qemu")
    assert "kernel tables under test: scalar neon" in output


def test_harness_under_sanitizers():
    code, output = run_script("run_sanitizers.sh", "--valgrind")
    if code == 86:
        pytest.fail(f"sanitizer or valgrind report\n{output[-20000:]}", pytrace=False)
    assert "ERROR: AddressSanitizer" not in output and "runtime error:" not in output, output[
        -20000:
    ]
    assert_harness_passed(code, output, "harness under ASan/UBSan (and valgrind)")
    # the ASan build runs natively: every table this CPU runs (valgrind hides AVX-512)
    asan_tables = output.split("== valgrind")[0]
    for path in expected_native_tables():
        assert re.search(rf"^kernel tables under test:.* {path}\b", asan_tables, re.MULTILINE), (
            f"the {path} table was not tested under ASan")
