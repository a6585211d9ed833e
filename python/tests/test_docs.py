"""The examples in the package's docstrings run and print what they say."""

import doctest

import reshard


def test_package_docstring_examples():
    result = doctest.testmod(reshard, raise_on_error=False)
    assert result.attempted >= 5 and result.failed == 0


def _readme_python_blocks():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", readme, flags=re.S)


def _run_block(rank, world, code):
    exec(compile(code, "<README.md example>", "exec"), {"__name__": "readme"})


def test_the_readme_python_example_runs_on_six_ranks():
    from conftest import run_ranks

    blocks = _readme_python_blocks()
    assert blocks, "README.md shows no Python example"
    for code in blocks:
        run_ranks(_run_block, 6, code, timeout=60)
