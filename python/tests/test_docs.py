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


def _documented_python_commands():
    """The ``python ...`` lines of the pages' ``sh`` blocks (README.md and docs/src), but the
    test suite's own command: crates/cli/tests/documented.rs leaves them to this test."""
    import re
    import shlex
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    pages = [root / "README.md", *sorted((root / "docs" / "src").glob("*.md"))]
    out = []
    for page in pages:
        for block in re.findall(r"```(?:sh|bash|shell)\n(.*?)```", page.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                if not line.startswith("python "):
                    continue
                words = shlex.split(line, comments=True)
                if words[:1] == ["python"] and words[1:3] != ["-m", "pytest"]:
                    out.append((page.name, words))
    return root, out


def test_the_documented_python_commands_run():
    import subprocess
    import sys

    root, commands = _documented_python_commands()
    assert len(commands) >= 2, commands
    for page, words in commands:
        args = [sys.executable, *words[1:]]
        if "--steps" in args:  # small sizes: two steps, the first refit and one after it
            args[args.index("--steps") + 1] = "2"
        done = subprocess.run(args, cwd=root, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{page}: {' '.join(words)}\n{done.stderr[-4000:]}"
        assert " step " in done.stdout, f"{page}: {' '.join(words)} printed no step\n{done.stdout}"
