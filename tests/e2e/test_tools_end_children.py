"""Tools end what they start: a tool that fails, or is killed, leaves no process behind (vLLM's
engine process once outlived tools/bench_weight_sync.py holding 1.4 GB and the caller's stdout).

Every process bench_weight_sync starts stays in the session the test starts it in (it runs no
sandbox and no launch, which take sessions of their own), so the survivors are the live processes
of that session once the tool has exited."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def session_members(sid: int) -> list[str]:
    """Live processes of session `sid`, as "pid command" lines."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:
            continue  # it ended meanwhile
        state, session = fields[0], int(fields[3])  # after "pid (comm)": state ppid pgrp session
        if session == sid and state != "Z":
            found.append(f"{entry} {command}")
    return found


def survivors(sid: int, wait_s: float = 10.0) -> list[str]:
    """The session's processes still alive after up to `wait_s` (exits take a moment)."""
    deadline = time.monotonic() + wait_s
    while session_members(sid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return session_members(sid)


@pytest.fixture
def start_tool():
    """Start a tool in a session of its own; whatever of it is left when the test ends is killed."""
    started = []

    def start(args: list[str]) -> subprocess.Popen:
        started.append(subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True))
        return started[-1]

    yield start
    for tool in started:
        for line in session_members(tool.pid):
            try:
                os.kill(int(line.split()[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def refused_model(tmp_path) -> str:
    """A small Llama config.json with dynamic RoPE scaling: vLLM serves it, the trainer refuses it
    (transformers and vLLM scale dynamic RoPE differently, so the two would score different models)."""
    path = tmp_path / "llama_dynamic.json"
    path.write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
        "bos_token_id": 1, "eos_token_id": 2}))
    return str(path)


def test_a_failing_tool_says_why_and_leaves_no_process(start_tool, refused_model):
    tool = start_tool(["tools/bench_weight_sync.py", "--model", refused_model, "--repeats", "1", "--timeout-s", "120"])
    out, _ = tool.communicate(timeout=300)  # returns only once nothing holds the pipe
    assert tool.returncode != 0, out[-3000:]
    assert "rope_type 'dynamic' is not supported" in out
    assert "trainer rank 0 exited with code 1" in out  # at once, not after the weight group's timeout
    assert survivors(tool.pid) == []


def test_a_tool_killed_while_vllm_starts_leaves_no_process(start_tool):
    tool = start_tool(["tools/bench_weight_sync.py", "--model", "tiny", "--repeats", "1"])
    deadline = time.monotonic() + 120
    while not any("EngineCore" in p for p in session_members(tool.pid)):  # vLLM's engine process is up
        assert tool.poll() is None and time.monotonic() < deadline, tool.communicate()[0][-3000:]
        time.sleep(0.2)
    tool.send_signal(signal.SIGTERM)
    out, _ = tool.communicate(timeout=120)
    assert tool.returncode != 0
    assert survivors(tool.pid) == [], out[-3000:]
