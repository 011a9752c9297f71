"""fsdp_lab.toolchain: what building C++ lacks on a machine (a compiler, ninja, Python's headers),
each case made here by pointing the lookups at names and folders that do not exist."""

from __future__ import annotations

import sysconfig

import pytest

from fsdp_lab import toolchain


@pytest.fixture
def no_headers(monkeypatch, tmp_path):
    """Python's include folder is an empty one, as with a distribution's Python without its -dev package."""
    real = sysconfig.get_paths

    def paths(*args, **kwargs):
        return dict(real(*args, **kwargs), include=str(tmp_path))

    monkeypatch.setattr(sysconfig, "get_paths", paths)
    return tmp_path


def test_headers_are_found_where_this_python_has_them(no_headers):
    missing = toolchain.python_headers_missing()
    assert f"no Python.h in {no_headers}" in missing and "-dev on Debian and Ubuntu" in missing
    (no_headers / "Python.h").write_text("")
    assert toolchain.python_headers_missing() is None


def test_a_compiler_is_found_by_any_of_its_names(tmp_path):
    assert toolchain.compiler_missing(["no-such-c++", "no-such-g++"]) == (
        "a C++ compiler ('no-such-c++' or 'no-such-g++' is not on PATH: install g++ or clang, or set CXX to one)")
    compiler = tmp_path / "my-c++"
    compiler.write_text("#!/bin/sh\n")
    compiler.chmod(0o755)
    assert toolchain.compiler_missing(["no-such-c++", str(compiler)]) is None


def test_torch_compile_names_inductor_s_compiler_and_the_headers(monkeypatch, no_headers):
    from torch._inductor import config

    monkeypatch.setattr(config.cpp, "cxx", (None, "no-such-c++"))
    missing = toolchain.missing_for_torch_compile()
    assert missing.startswith("a C++ compiler ('no-such-c++' is not on PATH") and " and Python's C headers" in missing
    (no_headers / "Python.h").write_text("")
    assert toolchain.missing_for_torch_compile().endswith("or set CXX to one)")


def test_an_extension_names_cxx_ninja_and_the_headers(monkeypatch, no_headers):
    import torch.utils.cpp_extension

    monkeypatch.setenv("CXX", "no-such-c++")
    monkeypatch.setattr(torch.utils.cpp_extension, "is_ninja_available", lambda: False)
    missing = toolchain.missing_for_extension()
    assert missing.index("'no-such-c++'") < missing.index("ninja (`pip install ninja`)") < missing.index("Python.h")
