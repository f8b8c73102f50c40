"""`pytest_test`: one test module of tests/ as a Bazel py_test, run by pytest."""

def pytest_test(name, src, deps = [], data = [], **kwargs):
    """A py_test that runs `src` under pytest through //tests:pytest_main.py.

    The module stays a plain pytest module (fixtures, markers, conftest.py), so the same file
    runs under `python -m pytest` and under `bazel test`.

    Args:
      name: target name, by convention the module's name without `.py`.
      src: the test module, a file of the calling package.
      deps: libraries the module imports, its conftest.py libraries included.
      data: files or binaries the tests use at run time (e.g. launchers run as subprocesses).
      **kwargs: passed to py_test (size, shard_count, tags, ...).
    """
    native.py_test(
        name = name,
        srcs = ["//tests:pytest_main.py", src],
        main = "//tests:pytest_main.py",
        args = ["$(rootpath :%s)" % src],
        deps = deps,
        # pytest reads its options and markers from pyproject.toml at the rootdir.
        data = data + ["//:pyproject.toml"],
        python_version = "PY3",
        srcs_version = "PY3",
        **kwargs
    )
