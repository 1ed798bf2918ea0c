"""An OpenAI-compatible endpoint on a rollout engine, whose sessions become experience.

An agent outside the run (its own program, its own framework) talks to the policy through the
`openai` client. The endpoint is vLLM's own server (`build_app` + `init_app_state` on the engine
already running: vLLM 0.32 serves an engine built in-process this way), not an imitation: /v1/chat/completions, /v1/completions,
/v1/models, and the run's bearer token required on every /v1 path (vLLM's middleware). Around it:

    agent --POST /v1/chat/completions, header X-RFT-Session: s1 --> vLLM's server
          --> RecordingEngine.generate   (records prompt ids, sampled ids, logprobs, version)
    agent --POST /rft/v1/sessions/s1/reward {"reward": 1.0} --> the session is finished
    explorer: endpoint.sessions.take_rewarded() -> session_experiences(...) -> shard

What is recorded is what vLLM processed and sampled, never re-tokenized text: a call whose prompt
continues the previous call's prompt and sampled ids (the agent appended only new messages) extends
the same row; otherwise (the chat template re-rendered an earlier turn differently) the call starts
a new row of the same trajectory. Calls without the session header are served and not recorded.
`X-RFT-Group` names the group a session is compared within (GRPO's baseline: several sessions of
one task); by default a session is its own group.

Requests in flight during a weight update finish on the weights they started with: the explorer
loads new weights between steps, while the endpoint keeps serving, and each recorded call carries
the version it was generated with (`Call.version`), so the trainer's staleness checks see it.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import socket
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from rft.buffer.experience import Experience
from rft.explorer.rewards import reward_values

SESSION_HEADER, GROUP_HEADER = "x-rft-session", "x-rft-group"
_CURRENT: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("rft_session", default=None)


@dataclass
class Call:
    """One model call of a session, as vLLM processed and sampled it."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version: int
    text: str = ""


@dataclass
class Session:
    id: str
    group: str
    calls: list[Call] = field(default_factory=list)
    reward: float | None = None


class SessionRecorder:
    """Sessions by id, filled from the engine's event loop, taken by the explorer's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}

    def record(self, session_id: str, group: str, call: Call) -> None:
        with self._lock:
            self._sessions.setdefault(session_id, Session(session_id, group)).calls.append(call)

    def reward(self, session_id: str, reward: float) -> bool:
        """Finish a session with its reward; False if no call of it was recorded."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                return False
            session.reward = reward
            return True

    def take_rewarded(self) -> list[Session]:
        """The finished sessions, removed from the recorder (each becomes experience once)."""
        with self._lock:
            done = [s for s in self._sessions.values() if s.reward is not None]
            for session in done:
                del self._sessions[session.id]
            return done

    def open_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)


def session_experiences(session: Session) -> list[Experience]:
    """A rewarded session as experience rows (see the module docstring): calls that continue the
    row's ids exactly extend it, with the tokens between (the new messages) masked out."""
    rows: list[Experience] = []
    for call in session.calls:
        row = rows[-1] if rows else None
        if row is not None and call.prompt_ids[: len(row.token_ids)] == row.token_ids:
            between = call.prompt_ids[len(row.token_ids):]
            row.token_ids += between
            row.loss_mask += [0] * len(between)
            row.logprobs += [0.0] * len(between)
            row.turns += 1
        else:
            row = Experience(token_ids=list(call.prompt_ids), loss_mask=[0] * len(call.prompt_ids),
                             logprobs=[0.0] * len(call.prompt_ids), prompt_length=len(call.prompt_ids),
                             turns=1, step_index=len(rows))
            rows.append(row)
        row.token_ids += call.token_ids
        row.loss_mask += [1] * len(call.token_ids)
        row.logprobs += call.logprobs
        row.finish_reason, row.response = call.finish_reason, call.text
        # a row's version is its oldest call's: what the trainer's staleness check must see
        row.version = min(row.version, call.version) if row.turns > 1 else call.version
    for row in rows:
        row.reward, row.group_id, row.trajectory_id = session.reward, session.group, session.id
        row.task_id = session.id
    return rows


class RecordingEngine:
    """vLLM's engine client as the OpenAI server sees it, recording the calls of sessions."""

    def __init__(self, engine, recorder: SessionRecorder):
        self._engine, self._recorder = engine, recorder  # engine: rft's RolloutEngine

    def __getattr__(self, name: str):
        return getattr(self._engine.llm, name)

    async def generate(self, prompt, sampling_params, request_id, *args, **kwargs) -> AsyncIterator:
        from vllm.sampling_params import RequestOutputKind

        session = _CURRENT.get()
        if session is not None and sampling_params.logprobs is None:
            sampling_params.logprobs = 0  # the sampled token's logprob; the response shows none unless asked
        # a streamed request (stream=true) comes as deltas: the completion is their concatenation
        delta = sampling_params.output_kind == RequestOutputKind.DELTA
        prompt_ids, finish, completions = None, {}, {}  # index -> [ids, logprobs, text]
        async with self._engine.request_slot():  # a weight update waits for it (RolloutEngine.updating_weights)
            version = self._engine.version
            async for output in self._engine.llm.generate(prompt, sampling_params, request_id, *args, **kwargs):
                prompt_ids = prompt_ids or output.prompt_token_ids
                for c in output.outputs:
                    ids = list(c.token_ids)
                    logprobs = [float(step[token].logprob) for step, token in zip(c.logprobs or [], ids)]
                    seen = completions.setdefault(c.index, [[], [], ""])
                    completions[c.index] = [seen[0] + ids, seen[1] + logprobs, seen[2] + c.text] if delta \
                        else [ids, logprobs, c.text]
                    finish[c.index] = c.finish_reason
                yield output
        if session is None or not all(finish.values()):
            return  # not a session's call, or cut short (client gone): nothing to train on
        for index, (ids, logprobs, text) in sorted(completions.items()):
            if len(logprobs) != len(ids) or not ids:
                continue  # not sampled here (an echo or a prompt-only request)
            self._recorder.record(session[0], session[1], Call(list(prompt_ids), ids, logprobs, finish[index],
                                                               version, text))


def server_args(model: str, token: str, served_name: str):
    """vLLM's OpenAI server arguments for one engine. `--api-key=<token>` in one word: a
    token_urlsafe token starts with "-" one time in 64, and argparse takes "--api-key -x..." for an
    option without its value (a judge rank failed to start so)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser()).parse_args(
        ["--model", model, f"--api-key={token}", "--served-model-name", served_name, "--disable-fastapi-docs"])


class OpenAIEndpoint:
    """vLLM's OpenAI server for `engine` on `host:port`, requiring `token`; `sessions` records."""

    def __init__(self, engine, host: str, port: int, token: str, served_name: str = "policy"):
        self.engine, self.host, self.port, self.token, self.served_name = engine, host, port, token, served_name
        self.sessions = SessionRecorder()
        self._server = None
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> None:
        self.engine.run(self._start())

    async def _start(self) -> None:
        import uvicorn
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app

        llm = self.engine.llm
        args = server_args(llm.model_config.model, self.token, self.served_name)
        tasks = await llm.get_supported_tasks()
        app = build_app(args, tasks, llm.model_config)
        await init_app_state(RecordingEngine(self.engine, self.sessions), app.state, args, tasks)
        config = uvicorn.Config(self._wrap(app), host=self.host, port=self.port, log_level="warning",
                                lifespan="off")
        self._server = uvicorn.Server(config)
        # bind here: uvicorn answers a taken port with sys.exit, which would stop the engine's loop
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as err:
            sock.close()
            raise RuntimeError(f"could not serve the OpenAI endpoint on {self.host}:{self.port}: {err.strerror} "
                               "(set rollout.openai_port to free ports, or 0 for any)") from None
        # on the engine's own loop: uvicorn sees it is not the main thread and leaves signals alone
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                raise RuntimeError(f"the OpenAI endpoint on {self.host}:{self.port} stopped while starting")
            await asyncio.sleep(0.01)

    def _wrap(self, app):
        """The session headers into a context variable the recording engine reads (a plain ASGI
        wrapper: vLLM's app is built, it takes no middleware any more), and rft's own routes."""
        from starlette.requests import Request
        from starlette.responses import JSONResponse
        from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

        auth = AuthenticationMiddleware(app, [self.token])  # vLLM's token check, for our routes too

        async def endpoint(scope, receive, send):
            if scope["type"] == "http" and scope["path"].startswith("/rft/v1/sessions/"):
                request = Request(scope, receive)
                response = await self._reward_route(request, auth)
                await response(scope, receive, send)
                return
            if scope["type"] == "http" and not scope["path"].startswith(("/v1", "/health")) \
                    and not auth.verify_token(Request(scope).headers):
                # vLLM guards /v1 only; its other routes (/classify of a reward model, /tokenize,
                # ...) need the token too here, on a shared cluster
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
            if scope["type"] == "http":
                headers = dict(scope["headers"])
                session = headers.get(SESSION_HEADER.encode(), b"").decode()
                group = headers.get(GROUP_HEADER.encode(), b"").decode()
                _CURRENT.set((session, group or session) if session else None)
            await app(scope, receive, send)

        return endpoint

    async def _reward_route(self, request, auth):
        """POST /rft/v1/sessions/{id}/reward with {"reward": <number>}."""
        from starlette.responses import JSONResponse

        parts = request.url.path.split("/")  # ['', 'rft', 'v1', 'sessions', id, 'reward']
        if not auth.verify_token(request.headers):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        if request.method != "POST" or len(parts) != 6 or parts[5] != "reward":
            return JSONResponse({"error": "use POST /rft/v1/sessions/{id}/reward"}, status_code=404)
        try:
            reward = reward_values(json.loads(await request.body())["reward"], batch=False, n=1)[0]
        except (ValueError, KeyError, TypeError) as e:  # NaN and Infinity parse as JSON, and are refused here
            return JSONResponse({"error": f'the body must be JSON like {{"reward": 1.0}} with a finite number ({e})'},
                                status_code=400)
        if not self.sessions.reward(parts[4], reward):
            return JSONResponse({"error": f"no call of session {parts[4]!r} was recorded (header "
                                        f"{SESSION_HEADER})"}, status_code=404)
        return JSONResponse({"session": parts[4], "reward": reward})

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self.engine.run(asyncio.wait_for(self._task, 30))
            self._server = None


def write_endpoints(path: str, token: str, urls: list[str], served_name: str) -> None:
    """`<run>/endpoints.json`: the URLs and the run's token, readable by its owner only (written to
    a temporary file created 0600, then renamed: never readable by others, never half-written)."""
    payload = {"token": token, "model": served_name,
               "endpoints": [{"engine": e, "url": url} for e, url in enumerate(urls)],
               "headers": {"session": "X-RFT-Session", "group": "X-RFT-Group"},
               "reward": "POST <url without /v1>/rft/v1/sessions/{id}/reward {\"reward\": <number>}"}
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)


def serve_endpoint(cfg, engine, dealer, index: int) -> OpenAIEndpoint:
    """Engine `index` of the job serves vLLM's OpenAI API for agents outside the run, on this
    node's address (127.0.0.1 for a local run), never on every interface; one token per run, made
    by engine 0 and shared through the job's store (`dealer`: rft/explorer/dealer.py); engine 0
    writes <run>/endpoints.json (owner-only) with every engine's URL."""
    import secrets

    from rft.runtime.topology import free_port

    token = dealer.gather("openai-token", secrets.token_urlsafe(32) if index == 0 else None)[0]
    host = "127.0.0.1" if cfg.cluster.kind == "local" else socket.gethostname()
    port = cfg.rollout.openai_port + index if cfg.rollout.openai_port else free_port()
    endpoint = OpenAIEndpoint(engine, host, port, token)
    endpoint.start()
    urls = list(dealer.gather("openai-urls", endpoint.url).values())
    path = os.path.join(cfg.run.output_dir, "endpoints.json")
    if index == 0:
        write_endpoints(path, token, urls, endpoint.served_name)
    print(f"engine {index}: OpenAI-compatible endpoint at {endpoint.url} (token in {path})", flush=True)
    return endpoint


def rewarded_experiences(endpoint: OpenAIEndpoint) -> list[Experience]:
    """The sessions rewarded since the last call, as experience: their groups are named
    `session:<group>`, apart from a workflow's groups in the same shard."""
    rows = [row for session in endpoint.sessions.take_rewarded() for row in session_experiences(session)]
    for row in rows:
        row.group_id = f"session:{row.group_id}"
    return rows
