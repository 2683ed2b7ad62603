"""The optional packages (gguf, safetensors, matplotlib) are imported only when a
feature needs them."""
import subprocess
import sys


def test_import_ggmlopt_loads_no_optional_package():
    code = ("import sys, ggmlopt, ggmlopt.io, ggmlopt.plotting\n"
            "h = ggmlopt.History(); h.to_dict()\n"
            "print(sorted(m for m in ('gguf', 'safetensors', 'matplotlib') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True, env=None)
    assert res.stdout.strip() == "[]"


def test_import_error_message(monkeypatch):
    import pytest

    from ggmlopt._optional import import_optional

    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ImportError) as info:
        import_optional("gguf", "interop", "GGUF export")
    assert str(info.value) == ("GGUF export needs the 'gguf' package, which is not installed: "
                               "pip install ggmlopt[interop]  (or pip install gguf)")
    assert isinstance(info.value.__cause__, ImportError)
