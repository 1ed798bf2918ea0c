"""Judges: frozen LLMs that rewards ask, served by judge ranks of the same allocation.

    from rft.explorer.judge import judge

    async def judged(trajectory, task) -> float:                # algorithm.reward=my_rewards.judged
        verdict = await judge.chat([{"role": "user", "content": f"... {trajectory.response} ... yes or no?"}])
        return 1.0 if verdict.strip().lower().startswith("yes") else 0.0

`cluster.judge_ranks=J` starts J / judge.tensor_parallel_size judge engines after the rollout ranks
(rft/explorer/judge_rank.py): vLLM engines on `judge.model` (default: the policy's starting
weights) that are never synced, behind vLLM's own OpenAI server (the code rollout.openai_api uses).
Rewards reach them through the `openai` client: `judge.chat(messages)` (chat completions, for
models with a chat template) and `judge.complete(prompt)` (plain completions, any model); both
return the judge's text. With judge.kind=classify the judge is a reward model (an HF
sequence-classification model on vLLM's pooling runner): `judge.score(texts)` returns its
probability per text, from vLLM's /classify route (plain HTTP: the `openai` client has no such call). Concurrent calls from the many trajectories in flight reach vLLM together
and its scheduler batches them; `judge.chat_many` asks several at once; a call goes to the judge
engine with the fewest calls in flight.

A judge that hangs or dies costs a timeout, not the run: a call slower than judge.timeout_s raises
JudgeTimeout (a failed one JudgeError), so the reward scores 0 and is counted (rollout/reward_errors,
judge/timeouts, judge/errors) while the step goes on. Rewards that ask a judge must be async: plain
rewards run in a forked child process (rft/explorer/rewards.py) that cannot share the client.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from rft.config import JudgeConfig


class JudgeError(RuntimeError):
    """A judge call failed (the judge engine answered with an error, or is gone)."""


class JudgeTimeout(JudgeError):
    """A judge call took longer than judge.timeout_s."""


@dataclass
class JudgeCounts:
    calls: int = 0
    timeouts: int = 0
    errors: int = 0
    seconds: float = 0.0  # summed over finished calls
    parse_failures: int = 0  # answers a reward could not read in full (relative_judge: rft/explorer/relative_judge.py)

    def scalars(self) -> dict[str, float]:
        done = self.calls - self.timeouts - self.errors
        return {"judge/calls": float(self.calls), "judge/timeouts": float(self.timeouts),
                "judge/errors": float(self.errors), "judge/latency_s": self.seconds / done if done else 0.0,
                "judge/parse_failures": float(self.parse_failures)}


@dataclass(frozen=True)
class JudgeEndpoint:
    """Where judge engine k serves (published by its rank in the job's store: `store_key(k)`)."""

    url: str
    token: str
    model: str

    @staticmethod
    def store_key(index: int) -> str:
        return f"rft-judge/{index}"

    def to_json(self) -> str:
        return json.dumps({"url": self.url, "token": self.token, "model": self.model})

    @classmethod
    def from_json(cls, text: str | bytes) -> JudgeEndpoint:
        return cls(**json.loads(text))


class JudgeClient:
    """The judge engines of this job, as rewards see them. Usable from coroutines on one event
    loop (the rollout loop, where async rewards run); the `openai` clients are made there."""

    def __init__(self, endpoints: list[JudgeEndpoint], cfg: JudgeConfig):
        self.endpoints, self.cfg = endpoints, cfg
        self.counts = JudgeCounts()
        self._in_flight = [0] * len(endpoints)
        self._clients: list | None = None

    def _pick(self) -> int:
        """The judge engine with the fewest calls in flight (ties: the first)."""
        return min(range(len(self.endpoints)), key=self._in_flight.__getitem__)

    def _client(self, index: int):
        if self._clients is None:
            from openai import AsyncOpenAI

            # timeouts are ours (asyncio.wait_for, below); no retries by the client: a retry would double a
            # hang (a connection that failed at once is tried once more: _attempts)
            self._clients = [AsyncOpenAI(base_url=e.url, api_key=e.token, max_retries=0, timeout=None)
                             for e in self.endpoints]
        return self._clients[index]

    async def _call(self, request):
        """Run `request(client, endpoint)` on the least busy judge with the time limit; count it."""
        import openai

        index = self._pick()
        self.counts.calls += 1
        self._in_flight[index] += 1
        started = time.monotonic()
        try:
            answer = await asyncio.wait_for(self._attempts(request, index), self.cfg.timeout_s)
        except asyncio.TimeoutError:
            self.counts.timeouts += 1
            raise JudgeTimeout(f"judge engine {index} ({self.endpoints[index].url}) did not answer within "
                               f"judge.timeout_s={self.cfg.timeout_s:g}s") from None
        except openai.OpenAIError as err:
            self.counts.errors += 1
            raise JudgeError(f"judge engine {index} ({self.endpoints[index].url}): {err}") from None
        finally:
            self._in_flight[index] -= 1
        self.counts.seconds += time.monotonic() - started
        return answer

    async def _attempts(self, request, index: int):
        """`request` on judge `index`, tried a second time if the connection failed. The server
        (uvicorn) closes a keep-alive connection idle for 5 s, and a request the client sent on it
        meanwhile fails at once with a connection error (seen between rollout steps on a loaded
        machine); the second try opens a new connection. It cannot double a hang: judge.timeout_s
        bounds both tries together, and a timeout is not retried."""
        import openai

        try:
            return await request(self._client(index), self.endpoints[index])
        except openai.APIConnectionError:
            return await request(self._client(index), self.endpoints[index])

    def _sampling(self, max_new_tokens: int | None, temperature: float | None) -> dict:
        return {"max_tokens": max_new_tokens or self.cfg.max_new_tokens,
                "temperature": self.cfg.temperature if temperature is None else temperature}

    async def chat(self, messages: list[dict], max_new_tokens: int | None = None,
                   temperature: float | None = None) -> str:
        """The judge's reply to a conversation (its chat template applies; vLLM's chat completions)."""
        sampling = self._sampling(max_new_tokens, temperature)

        async def request(client, endpoint):
            reply = await client.chat.completions.create(model=endpoint.model, messages=messages, **sampling)
            return reply.choices[0].message.content or ""

        return await self._call(request)

    async def complete(self, prompt: str, max_new_tokens: int | None = None,
                       temperature: float | None = None) -> str:
        """The judge's continuation of a plain-text prompt (no template; any model)."""
        sampling = self._sampling(max_new_tokens, temperature)

        async def request(client, endpoint):
            reply = await client.completions.create(model=endpoint.model, prompt=prompt, **sampling)
            return reply.choices[0].text

        return await self._call(request)

    async def score(self, texts: list[str]) -> list[float]:
        """A reward model's score of each text (judge.kind=classify): the probability of its first
        label (for a single-label model, the sigmoid of its logit)."""
        async def request(client, endpoint):
            reply = await client.post(endpoint.url.removesuffix("/v1") + "/classify", cast_to=object,
                                      body={"model": endpoint.model, "input": texts})
            return [float(row["probs"][0]) for row in reply["data"]]

        return await self._call(request)

    async def token_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """The judge's logprob of each token of each sequence given the tokens before it (0.0 at
        position 0, which has no context): a teacher scoring a student's samples (on-policy
        distillation, rft/explorer/teacher.py). One completions request for all the sequences
        (token ids, never re-tokenized text; vLLM's `prompt_logprobs`, an extension of the OpenAI
        API); the one token it generates per sequence is discarded."""
        async def request(client, endpoint):
            reply = await client.completions.create(model=endpoint.model, prompt=sequences, max_tokens=1,
                                                    temperature=0.0, extra_body={"prompt_logprobs": 0})
            out = []
            for sequence, choice in zip(sequences, sorted(reply.choices, key=lambda c: c.index)):
                # position i: {str(token id): {"logprob": ...}, ...}, the scored token among them
                scored = choice.prompt_logprobs or []
                out.append([0.0] + [float(scored[i][str(token)]["logprob"]) for i, token in
                                    enumerate(sequence) if i > 0])
            return out

        return await self._call(request)

    async def chat_many(self, conversations: list[list[dict]], **sampling) -> list[str | BaseException]:
        """Several conversations at once (one batch in vLLM's scheduler); a failed or timed-out
        call is returned as its exception, so one slow answer does not lose the others."""
        return await asyncio.gather(*(self.chat(c, **sampling) for c in conversations), return_exceptions=True)

    def take_counts(self) -> JudgeCounts:
        """The counts since the last take (one rollout step's)."""
        counts, self.counts = self.counts, JudgeCounts()
        return counts


class _JudgeHandle:
    """`judge`, the object rewards import: the JudgeClient this rank connected (rft/explorer/rollout_rank.py)."""

    client: JudgeClient | None = None

    def __getattr__(self, name: str):
        if self.client is None:
            raise JudgeError("this run has no judge engines: set cluster.judge_ranks=1 (and judge.model=<HF "
                             "model directory>; the default is the policy's starting weights)")
        return getattr(self.client, name)


judge = _JudgeHandle()


def connect(store, count: int, cfg: JudgeConfig, timeout_s: float) -> JudgeClient:
    """Wait until every judge engine has published where it serves (its rank starts vLLM as the
    rollout ranks start theirs), then make `judge` reach them. Names the judge that never came."""
    import datetime

    keys = [JudgeEndpoint.store_key(k) for k in range(count)]
    deadline = time.monotonic() + timeout_s
    for k, key in enumerate(keys):
        try:
            store.wait([key], datetime.timedelta(seconds=max(deadline - time.monotonic(), 1.0)))
        except RuntimeError:  # torch's store timeout
            raise RuntimeError(f"judge engine {k} did not come up within {timeout_s:g}s (sync.timeout_s): see the "
                               "judge ranks' logs") from None
    judge.client = JudgeClient([JudgeEndpoint.from_json(store.get(key)) for key in keys], cfg)
    return judge.client
