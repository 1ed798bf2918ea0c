"""mode=serve through the real launcher (rft/explorer/serve.py): rollout ranks that only serve
vLLM's OpenAI API. An agent using the real `openai` client runs sessions and rewards them; they land
in the run's buffer as shards; a trainer's new weights version appearing in sync.checkpoint_dir is
loaded and served (the same prompt's logprobs change and the next session's shard carries it); a
session rewarded just before Ctrl-C is written, not lost."""

import json
import signal
import subprocess
import sys
import time

import httpx
from openai import OpenAI
from safetensors.torch import load_file, save_file

from tests.e2e.helpers import REPO, stop_launcher


def _wait_for(what: str, check, launcher: subprocess.Popen, timeout_s: float = 240):
    deadline = time.time() + timeout_s
    while not (found := check()):
        assert launcher.poll() is None, f"the launcher ended while waiting for {what}: {launcher.communicate()}"
        assert time.time() < deadline, f"no {what} within {timeout_s}s"
        time.sleep(0.3)
    return found


def _shards(run_dir) -> list[dict]:
    manifest = run_dir / "buffer" / "manifest.jsonl"
    return [json.loads(line) for line in manifest.read_text().splitlines()] if manifest.exists() else []


def _publish_version(model_dir, checkpoint_dir, version: int) -> None:
    """What a trainer's checkpoint engine writes (rft/weights/engines.py CheckpointSender): an HF
    checkpoint in <dir>/v<version>/, its index file last. Here: the starting weights, scaled."""
    tensors = {name: t * 1.5 for name, t in load_file(str(model_dir / "model.safetensors")).items()}
    vdir = checkpoint_dir / f"v{version:06d}"
    vdir.mkdir(parents=True)
    save_file(tensors, str(vdir / "model.safetensors"), metadata={"format": "pt"})
    (vdir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {name: "model.safetensors" for name in tensors}}))


def test_serve_mode_turns_sessions_into_shards_and_follows_published_weights(tmp_path):
    run_dir, checkpoint_dir = tmp_path / "run", tmp_path / "weights"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "rft.launch", "+experiment=quickstart", "cluster=local", "mode=serve",
         f"run.output_dir={run_dir}", f"sync.checkpoint_dir={checkpoint_dir}", "serve.step_s=3",
         "monitor.progress=false"], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        endpoints = _wait_for("endpoints.json", lambda: (run_dir / "endpoints.json").exists(), launcher)
        endpoints = json.loads((run_dir / "endpoints.json").read_text())
        url, token = endpoints["endpoints"][0]["url"], endpoints["token"]
        client = OpenAI(base_url=url, api_key=token)

        def session(name: str) -> list[float]:
            out = client.completions.create(model="policy", prompt="12+34=", max_tokens=3, temperature=0.0,
                                            logprobs=1, extra_headers={"X-RFT-Session": name})
            httpx.post(f"{url.removesuffix('/v1')}/rft/v1/sessions/{name}/reward", json={"reward": 1.0},
                       headers={"Authorization": f"Bearer {token}"}).raise_for_status()
            return out.choices[0].logprobs.token_logprobs

        before = session("first")
        first = _wait_for("the first session's shard", lambda: _shards(run_dir), launcher)
        assert [(s["producer"], s["step"], s["rows"], s["version"]) for s in first] == [(0, 0, 1, 0)]

        _publish_version(run_dir / "initial_model", checkpoint_dir, 1)
        log = next((run_dir / "logs").glob("*_0_log.out"))
        _wait_for("the new weights", lambda: "serving weights version 1" in log.read_text(), launcher)
        after = session("second")
        assert after != before  # the same greedy prompt, other weights
        shards = _wait_for("the second session's shard", lambda: _shards(run_dir)[1:], launcher)
        assert [(s["step"], s["rows"], s["version"]) for s in shards] == [(1, 1, 1)]
        session("third")  # rewarded right after a step (serve.step_s=3): the next step would write it...
        launcher.send_signal(signal.SIGINT)  # ...but the user stops the server first
        out, err = launcher.communicate(timeout=120)
    finally:
        stop_launcher(launcher)
    assert launcher.returncode == 130, out[-3000:] + err[-3000:]
    assert "mode serve: vLLM's OpenAI API on every engine" in " ".join(out.replace("│", " ").split())
    assert [(s["step"], s["rows"], s["version"]) for s in _shards(run_dir)][2:] == [(2, 1, 1)]  # not lost
    assert "Traceback" not in out + err
    assert not (run_dir / "owner.json").exists()
