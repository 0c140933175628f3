"""The examples in examples/python run against the shared server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import clade
from conftest import REPO, SDK_DIR, Server, env_for

EXAMPLES = REPO / "examples" / "python"


def run_example(server: Server, name: str, *args: str, cwd: Path) -> "subprocess.CompletedProcess[str]":
    env = env_for(server)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SDK_DIR / "src"), env.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_fork_and_pick_best_promotes_the_passing_fix(server: Server, client: clade.Clade, tmp_path: Path) -> None:
    before = {s.id for s in client.sandboxes.list()}
    done = run_example(server, "fork_and_pick_best.py", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "len(values)" in done.stdout and "winner" in done.stdout
    assert {s.id for s in client.sandboxes.list()} <= before, "the example left sandboxes behind"


def test_data_analysis_saves_a_png_chart(server: Server, code_interpreter_ready: None, tmp_path: Path) -> None:
    done = run_example(server, "data_analysis.py", "chart.png", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "chart.png").read_bytes().startswith(b"\x89PNG")
    assert "north" in done.stdout
