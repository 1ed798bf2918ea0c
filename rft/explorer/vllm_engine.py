"""The rollout engine: vLLM's async engine, run on its own event-loop thread, plus the calls
that reach its workers.

vLLM's workers have their own torch.distributed world. The extension (`WeightReceiver` in
rft/explorer/vllm_worker.py, mixed into vLLM's worker through `worker_extension_cls`) makes every
worker a receiver of rft's weight engine (rft/weights/engines.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import threading
import time
import uuid
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from rft.config import ModelConfig, RolloutConfig
from rft.config.rollout import CPU_KV_CACHE_GB

if TYPE_CHECKING:
    import numpy as np

    from rft.weights.engines import SyncLayout

T = TypeVar("T")
CPU_SHUTDOWN_S = 0.3  # how long a CPU engine core may take to exit when the rank closes it


@contextlib.contextmanager
def _engine_core_forked(config) -> Iterator[None]:
    """A CPU engine of one worker (TP=1) starts its engine core process by fork, not spawn.

    vLLM's CPU platform always asks for spawn (its config sets VLLM_WORKER_MULTIPROC_METHOD), for
    the NUMA binding of TP workers. A TP=1 engine core runs its model in that very process, and a
    spawned one imports torch and vLLM all over again: 6.7 s of a rollout rank's 15 s start on a
    2-core machine (measured), for the same tokens and logprobs. GPUs keep vLLM's choice (a forked
    CUDA context does not work), and so does TP>1 on CPU.
    """
    forked = config.device_config.device_type == "cpu" and config.parallel_config.world_size == 1
    previous = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
    if forked:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    try:
        yield
    finally:
        if forked and previous is None:
            os.environ.pop("VLLM_WORKER_MULTIPROC_METHOD")
        elif forked:
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = previous


def memory_kwargs(rollout: RolloutConfig, on_gpu: bool) -> dict[str, Any]:
    """vLLM's memory arguments. On GPUs the engine takes rollout.gpu_memory_utilization of the GPU
    and the KV cache whatever the weights leave of it; rollout.kv_cache_gb, when set, sizes the cache
    instead (vLLM's kv_cache_memory_bytes "ignores gpu_memory_utilization", vllm/config/cache.py).
    On CPU, gpu_memory_utilization would be a share of the NUMA node's RAM (its default 0.92 fails to
    allocate), so the cache is always sized: kv_cache_gb, else CPU_KV_CACHE_GB."""
    if on_gpu:
        sized = {} if rollout.kv_cache_gb is None else {"kv_cache_memory_bytes": int(rollout.kv_cache_gb * 2**30)}
        return {"gpu_memory_utilization": rollout.gpu_memory_utilization, **sized}
    gib = CPU_KV_CACHE_GB if rollout.kv_cache_gb is None else rollout.kv_cache_gb
    return {"kv_cache_memory_bytes": int(gib * 2**30)}


class RolloutEngine:
    """One vLLM engine (vLLM's async engine, `AsyncLLM`) for a rollout rank; `version` is the
    policy version it serves.

    Workflows await `generate` from an event loop that runs in a thread of its own (`run`), so
    many trajectories are in flight at once while the rank's own loop (votes, buffer writes,
    weight syncs) stays plain synchronous code. vLLM runs its engine core in a process of its own
    (always, for the async engine); on CPU with TP=1 the model worker lives inside that process.
    """

    def __init__(self, model: ModelConfig, rollout: RolloutConfig, seed: int, max_model_len: int,
                 name: str = "engine 0", loop: LoopThread | None = None, runner: str = "generate",
                 max_lora_rank: int = 0, return_routed_experts: bool = False, sleep_mode: bool = False):
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        # Fold the TP=1 worker into the engine core process: one process less, and weight loads and
        # generation need no extra hop.
        if rollout.tensor_parallel_size == 1:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        else:
            # vLLM's CPU build pins each TP worker to its own NUMA node and refuses to start when
            # there are fewer nodes than workers (one-socket machines); let the OS place threads.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        import torch
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs

        self.name, self.max_model_len, self.version, self.in_flight = name, max_model_len, 0, 0
        self.partial = rollout.partial_rollout  # a weight update cuts requests, which go on after it
        self.cuts = 0  # weight updates that cut requests in flight so far
        self.continued = 0  # samples continued on newer weights after a cut
        # the step's generation journal (rft/explorer/journal.py), set while a step's rollouts run
        self.journal = None
        self.replayed = 0  # samples taken from the journal an earlier attempt left, not generated
        self.resumed = 0  # samples an earlier attempt was stopped in the middle of, gone on from its tokens
        self.lora_request = None  # the adapter every request carries (LoRA stages with sync.lora=adapter)
        # requests are admitted while `_admitting` is set; `_idle` is set while none is in flight
        self._admitting, self._idle = asyncio.Event(), asyncio.Event()
        self._admitting.set()
        self._idle.set()
        kwargs = dict(model=model.path, dtype=model.dtype, seed=seed, max_model_len=max_model_len,
                      max_num_seqs=rollout.max_num_seqs, tensor_parallel_size=rollout.tensor_parallel_size,
                      worker_extension_cls="rft.explorer.vllm_worker.WeightReceiver",
                      enable_prefix_caching=True, disable_log_stats=True, runner=runner)
        if max_lora_rank:  # one adapter at a time: the newest version the trainer sent
            kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
        if return_routed_experts:  # MoE routing replay (trainer.routing_replay=rollout)
            if not torch.cuda.is_available():
                raise ValueError("trainer.routing_replay=rollout: vLLM 0.32 returns the routed experts only on "
                                 "GPUs (through its Model Runner V2, which needs Triton on a GPU), and this "
                                 f"rollout rank ({name}) has none; use trainer.routing_replay=none on CPU")
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
            kwargs["enable_return_routed_experts"] = True
        self.images = serves_images(model.path)
        self.images_per_prompt = rollout.images_per_prompt if self.images else 0
        if self.images:  # a vision-language model: prompts carry images (videos: not yet)
            kwargs["limit_mm_per_prompt"] = {"image": rollout.images_per_prompt, "video": 0}
            from rft.data.images import IMAGE_PAD, image_processor

            self.image_processor = image_processor(model.path)
        kwargs.update(memory_kwargs(rollout, on_gpu=torch.cuda.is_available()))
        if torch.cuda.is_available():
            # sleep() frees GPU memory only from vLLM's own allocator pool (cluster.colocate); on CPU
            # vLLM refuses the flag, and its sleep and wake_up run without it (freeing nothing)
            kwargs["enable_sleep_mode"] = sleep_mode
        else:
            kwargs["enforce_eager"] = True  # compilation only costs start-up on CPU
            # vLLM CPU (0.32) kills its engine when a seeded request's prefill is split across
            # steps ("CPU Generator does not use offset"): every rft request is seeded, and many
            # multi-turn prompts at once get split. Whole prefills only; GPUs keep chunking.
            kwargs["enable_chunked_prefill"] = False
            # vLLM's sampler wraps two small ops in torch.compile (the logprob rank count, top-k/top-p)
            # even under enforce_eager: on CPU, tracing them took 3.0 s of an engine's first request
            # (measured, tiny model, 2 cores), and again at a new batch shape. Eager gives the same
            # numbers. A forked engine core inherits the setting, a spawned one (TP>1) the variable.
            os.environ["TORCH_COMPILE_DISABLE"] = "1"
            torch._dynamo.config.disable = True
        self.tokenizer = AutoTokenizer.from_pretrained(model.path)
        self.image_pad = self.tokenizer.convert_tokens_to_ids(IMAGE_PAD) if self.images else None
        self.loop, self._own_loop = loop or LoopThread(), loop is None
        self._args = AsyncEngineArgs(**kwargs)
        # rollout.on_engine_failure=restart (rft/explorer/engine_restart.py): where each sync's weights
        # are kept as they arrive, and what a restarted engine loads: (HF directory, its version) or
        # None (the model's own weights)
        self.keep_weights_in: str | None = None
        self.restore_from: tuple[str, int] | None = None
        self.last_progress = time.monotonic()  # a request finished, or one came to an idle engine
        self.llm = self.run(self._start(dataclasses.replace(self._args)))  # its config is built anew

    @staticmethod
    async def _start(args):
        from vllm.v1.engine.async_llm import AsyncLLM

        config = args.create_engine_config()
        with _engine_core_forked(config):
            return AsyncLLM.from_vllm_config(config, disable_log_stats=args.disable_log_stats)

    def run(self, coroutine: Awaitable[T], timeout_s: float | None = None) -> T:
        """Run `coroutine` on the engine's event loop and wait for its result (from any other thread)."""
        return self.loop.run(coroutine, timeout_s)

    async def generate(self, prompt_ids: list[int], params, images: list[bytes] | None = None) -> list[Completion]:
        """Sample `params.n` completions of `prompt_ids` (vllm.SamplingParams). With
        rollout.partial_rollout a weight update may cut them: each cut sample then goes on from
        its tokens so far on the new weights, and every token keeps the version that sampled it.
        With a step's journal (rft/explorer/journal.py) what an earlier attempt finished is taken
        back, and what it had when it was stopped is gone on from. `images` (a vision-language
        model's, encoded): one <|image_pad|> each in `prompt_ids`, which vLLM widens."""
        from vllm.sampling_params import RequestOutputKind

        # one final output per request: with n > 1 vLLM otherwise streams one sample per output
        params.output_kind = RequestOutputKind.FINAL_ONLY
        params.logprobs = 0  # the sampled token's logprob
        journal = self.journal if params.seed is not None else None  # an unseeded request is a fresh draw each time
        recorded = journal.replay(prompt_ids, params, images) if journal is not None else None
        if recorded is not None and not any(c.finish_reason == "abort" for c in recorded):
            self.replayed += len(recorded)  # an earlier attempt finished it
            return [dataclasses.replace(c) for c in recorded]
        if recorded is not None:  # an earlier attempt was stopped in its middle: go on from its tokens
            self.resumed += sum(c.finish_reason == "abort" for c in recorded)
            completions, cut = [dataclasses.replace(c) for c in recorded], True
        else:
            completions, cut = await self._sample(prompt_ids, params, images)
        if cut:
            if journal is not None:  # the tokens so far survive a kill while the rest is sampled
                journal.record(prompt_ids, params, completions, images)
            completions = list(await asyncio.gather(*(self._go_on(prompt_ids, c, params, i, images)
                                                      for i, c in enumerate(completions))))
        if journal is not None:
            journal.record(prompt_ids, params, completions, images)
        return completions

    async def _sample(self, prompt_ids: list[int], params, images: list[bytes] | None = None
                      ) -> tuple[list[Completion], bool]:
        """One request: its completions, and whether rft cut it (a weight update with partial
        rollout, or `keep_in_flight`)."""
        from rft.data.images import decode

        pictures = [decode(image) for image in images] if images else None
        async with self.request_slot():
            version, cuts, final = self.version, self.cuts, None
            async for out in self.llm.generate(prompt_input(prompt_ids, pictures), params, request_id=uuid.uuid4().hex,
                                               lora_request=self.lora_request):
                final = out
            self.last_progress = time.monotonic()
        # vLLM ends a request it aborted with finish_reason "abort" and the tokens sampled so far
        cut = self.cuts != cuts and any(c.finish_reason == "abort" for c in final.outputs)
        return [Completion(token_ids=list(c.token_ids),
                           logprobs=[float(step[tok].logprob) for step, tok in zip(c.logprobs, c.token_ids)],
                           text=c.text, finish_reason=c.finish_reason or "length",
                           routed_experts=getattr(c, "routed_experts", None), versions=[version] * len(c.token_ids))
                for c in final.outputs], cut

    async def _go_on(self, prompt_ids: list[int], done: Completion, params, sample: int,
                     images: list[bytes] | None = None) -> Completion:
        """A sample rft cut (a weight update, `keep_in_flight`, a stopped earlier attempt), continued
        on the weights served now from where it stopped, as often as it is cut. Why not vLLM's pause_generation(mode="keep"): the tokens each
        request had when it was frozen are not reported, and each token's version must be exact;
        an aborted request reports them. Like "keep" with its cache cleared, the continuation
        computes the KV of the tokens so far again, on the new weights."""
        segment = 0
        while done.finish_reason == "abort" and len(done.token_ids) < params.max_tokens:
            segment += 1
            rest = params.clone()  # every sampling setting of the request, for one sample's rest
            rest.n, rest.max_tokens = 1, params.max_tokens - len(done.token_ids)
            rest.seed = None if params.seed is None else params.seed + 7919 * segment + sample
            more, _ = await self._sample(prompt_ids + done.token_ids, rest, images)
            self.continued += 1
            step = more[0]
            done = Completion(token_ids=done.token_ids + step.token_ids, logprobs=done.logprobs + step.logprobs,
                              text=self.tokenizer.decode(done.token_ids + step.token_ids, skip_special_tokens=True),
                              finish_reason=step.finish_reason, routed_experts=step.routed_experts,
                              versions=done.versions + step.versions)
        if done.finish_reason == "abort":  # cut after its last token: nothing left to sample
            done.finish_reason = "length"
        return done

    def keep_in_flight(self) -> None:
        """Cut every request in flight and let it go on at once on the same weights: each records
        the tokens it had in the step's journal first, so a kill from now on (Slurm's, after its
        time-limit signal) loses none of them; a restarted explorer goes on from them."""

        async def cut_and_go_on() -> None:
            self.cuts += 1
            await self.llm.pause_generation(mode="abort", clear_cache=False)  # the same weights: keep the KV
            await self.llm.resume_generation()

        self.run(cut_and_go_on())

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        """Call a `WeightReceiver` method on every vLLM worker of this engine."""
        return self.run(self.llm.collective_rpc(method, args=args))

    def open_weight_receiver(self, layout: "SyncLayout", first_index: int) -> None:
        """Make every vLLM worker a receiver (indices first_index, first_index + 1, ...)."""
        self.collective_rpc("rft_open_weight_receiver", (layout.as_dict(), first_index))

    def receive_weights(self, apply: bool = True, adapter: dict | None = None, version: int | None = None) -> float:
        """Block until the trainer's next sync arrives and load it (sets `version`); `adapter`: a
        LoRA adapter sync (WeightReceiver.rft_receive_weights), served from then on; `version`:
        the one being published, where known.

        Returns the seconds spent after the last bucket arrived (loading, re-processing, cache
        reset): the rollout side's share of the sync, which the sender's timing does not include.
        """
        from vllm.lora.request import LoRARequest

        with self.updating_weights():
            replies = self.collective_rpc("rft_receive_weights", (apply, adapter, version, self.keep_weights_in))
            start = time.perf_counter()
            if apply:
                self.version = int(replies[0][0])
                if replies[0][3] is not None:  # the copy kept on the way in: a restart loads it
                    self.restore_from = (replies[0][3], self.version)
                path = replies[0][2]
                # a new id per version: vLLM caches adapters by id
                self.lora_request = LoRARequest(f"v{self.version}", self.version + 1, path) if path else None
                self._forget_old_weights()
        return float(replies[0][1]) + (time.perf_counter() - start if apply else 0.0)

    def _forget_old_weights(self) -> None:
        """Drop what vLLM computed with the weights it served before: cached KV blocks, and a
        vision-language model's cached image features (its encoder cache outlives a request; with
        it kept, an image seen before a sync was read with the old vision tower after it)."""
        self.run(self.llm.reset_prefix_cache())
        if self.images:
            self.run(self.llm.reset_encoder_cache())

    def sleep(self, level: int) -> int | None:
        """vLLM's sleep (cluster.colocate): the scheduler pauses; on GPU the KV cache is dropped and
        the weights moved to host memory (level 1) or dropped (level 2). Returns the level vLLM was
        put to sleep at, or None if vLLM does not say it is asleep now (its is_sleeping: on CPU,
        where sleep frees nothing, the only sign that it slept)."""
        self.run(self.llm.sleep(level))
        return level if self.run(self.llm.is_sleeping()) else None

    def wake(self, tags: list[str] | None = None) -> bool:
        """vLLM's wake_up of `tags` ("weights", "kv_cache"; None: all); the scheduler resumes once
        everything is awake. Returns whether vLLM says it is fully awake (not after the weights alone)."""
        return self.run(self.llm.wake_up(tags))

    def load_hf_dir(self, path: str, version: int | None = None) -> None:
        """Serve the weights of the HF checkpoint in `path` (same architecture as the engine's),
        from now on as `version` where given."""
        with self.updating_weights():
            self.collective_rpc("rft_load_hf_dir", (path,))
            self._forget_old_weights()
            self.version = self.version if version is None else version
        self.restore_from = (path, self.version)

    @contextlib.asynccontextmanager
    async def request_slot(self):
        """Every request to the engine runs inside one: admitted unless weights are being
        updated, counted while in flight."""
        await self._admitting.wait()
        if self.in_flight == 0:  # an idle engine owes no progress: the stall clock starts now
            self.last_progress = time.monotonic()
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    @contextlib.contextmanager
    def updating_weights(self):
        """Requests in flight finish on the weights they started with; requests that arrive
        meanwhile (an agent on the OpenAI endpoint) wait and run on the new weights. Between a
        run's steps nothing is in flight: no cost there. (vLLM 0.32's own pause_generation in
        "wait" mode returned on CPU while a request was still generating, so rft drains its
        requests itself.) With rollout.partial_rollout the requests in flight are cut instead
        and go on once the new weights are in (`generate`)."""

        async def drain() -> None:
            self._admitting.clear()
            await self._idle.wait()

        async def cut() -> None:
            self._admitting.clear()
            self.cuts += 1  # the requests cut go on once the new weights are in (`generate`)
            await self.llm.pause_generation(mode="abort", clear_cache=True)

        async def admit() -> None:
            if self.partial:
                await self.llm.resume_generation()
            self._admitting.set()

        self.run(cut() if self.partial else drain())
        try:
            yield
        finally:
            self.run(admit())

    def prompt_logprobs(self, sequences: list[list[int]], images: list[list] | None = None) -> list[list[float]]:
        """log p(token t | tokens < t) under the served weights for t >= 1 of each sequence
        (weight-sync checks compare these with the trainer's). `images`: each sequence's (PIL
        images, one <|image_pad|> each in the sequence, which vLLM widens to the image's tokens);
        the logprobs are then of the widened sequence."""
        from vllm import SamplingParams

        async def one(ids: list[int], pictures: list | None) -> list[float]:
            params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
            final = None
            async for out in self.llm.generate(prompt_input(ids, pictures), params, request_id=uuid.uuid4().hex,
                                               lora_request=self.lora_request):
                final = out
            widened = final.prompt_token_ids
            return [float(step[tok].logprob) for step, tok in zip(final.prompt_logprobs[1:], widened[1:])]

        async def all_of() -> list[list[float]]:
            return list(await asyncio.gather(*(one(ids, pictures) for ids, pictures
                                               in zip(sequences, images or [None] * len(sequences)))))

        return self.run(all_of())

    def died(self) -> bool:
        """Whether the engine core is gone though no request failed (it died after its last answer)."""
        if self.llm is None:
            return False
        with contextlib.suppress(Exception):
            processes = self.llm.engine_core.resources.engine_manager.processes
            return self.llm.errored or not any(p.is_alive() for p in processes)
        return bool(self.llm.errored)  # an engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)

    def answers(self, within_s: float) -> bool:
        """Whether the engine core answers a call within `within_s` seconds. An idle core answers
        in milliseconds; a stopped or hung one never does, and with no request in flight nothing
        else would tell (the stall watch of rft/explorer/engine_restart.py needs requests)."""
        async def probe() -> None:
            await asyncio.wait_for(self.llm.is_sleeping(), within_s)  # a round trip to the core

        try:
            self.run(probe())
        except Exception:  # noqa: BLE001 - timed out, or vLLM found its core dead (EngineDeadError)
            return False
        return True

    def core_pids(self) -> list[int]:
        """The processes of vLLM's engine core (and its workers' with TP > 1) that still live."""
        with contextlib.suppress(Exception):
            return [p.pid for p in self.llm.engine_core.resources.engine_manager.processes if p.is_alive()]
        return []

    def restart(self) -> None:
        """Start vLLM again with this engine's arguments, after its engine core died or was killed
        (rft/explorer/engine_restart.py), and serve the weights it served: those kept at the last
        sync or loaded from a directory (`restore_from`), else the model's own. On the rank's
        devices: the rank's CUDA_VISIBLE_DEVICES is unchanged."""
        served = self.version  # keep_weights may have relabelled the weights kept since
        if self.restore_from is None and served:
            raise RuntimeError(f"{self.name} cannot be restarted: it serves version {served}, whose weights it "
                               "did not keep (neither received in this attempt nor loaded from a directory)")
        self._stop_core()
        self._admitting.set()
        self._idle.set()
        self.in_flight, self.lora_request = 0, None
        self.llm = self.run(self._start(dataclasses.replace(self._args)))  # its config is built anew
        self.last_progress = time.monotonic()
        if self.restore_from is not None:
            self.load_hf_dir(self.restore_from[0], served)

    def _stop_core(self) -> None:
        """Stop vLLM's engine core processes and drop the engine."""
        # A CPU engine core holds no device memory, and its graceful exit (finalizing an interpreter
        # with torch loaded, after vLLM's SIGTERM) took 2-3.5 s of every run's end on 2 cores
        # (measured): it is killed after CPU_SHUTDOWN_S. On GPUs vLLM's own grace period stands.
        import torch

        # its processes inherited the rank's blocked SIGTERM (rft/runtime/preemption.py), which vLLM's
        # shutdown sends: SIGINT takes them down the same graceful way (vllm/v1/engine/core.py handles both)
        for pid in self.core_pids():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGINT)
        with contextlib.suppress(Exception):
            self.llm.shutdown(timeout=None if torch.cuda.is_available() else CPU_SHUTDOWN_S)
        # drop it now: its __del__ shuts down again, which at interpreter exit fails noisily
        # ("'NoneType' object is not callable") in every rank's log
        self.llm = None

    def close(self) -> None:
        """Stop vLLM's engine core and the event loop."""
        self._stop_core()
        if self._own_loop:
            self.loop.close()


class LoopThread:
    """An asyncio event loop running in a daemon thread: where workflows and every engine of a
    rank run (vLLM's async engine binds to the loop it first runs on, so all share this one)."""

    def __init__(self, name: str = "rft-rollout-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine: Awaitable[T], timeout_s: float | None = None) -> T:
        """Run `coroutine` on the loop and wait for its result (from any thread but the loop's)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


def serves_images(model_path: str) -> bool:
    """Whether the HF model at `model_path` is a vision-language model (rft/models/families.py)."""
    import json

    from rft.models.families import is_vision_language

    try:
        with open(os.path.join(model_path, "config.json")) as f:
            return is_vision_language(json.load(f))
    except (OSError, ValueError):
        return False


def prompt_input(prompt_ids: list[int], images: list | None = None):
    """What vLLM is given for a prompt of token ids: the ids as they are, or with images, vLLM's
    prompt form that its processor widens (each <|image_pad|> to the image's tokens)."""
    from vllm.inputs import tokens_input

    if not images:
        return tokens_input(prompt_ids)
    return {"prompt_token_ids": prompt_ids, "multi_modal_data": {"image": list(images)}}


@dataclass
class Completion:
    """One sampled continuation: its token ids (the stop token included when the model stopped
    on it), vLLM's logprob of each, the text, and why it ended (stop | length | context)."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    # with routed experts returned: [prompt + sampled tokens run through the model, layers, k],
    # the experts vLLM routed each to (its last sampled token never ran through it)
    routed_experts: np.ndarray | None = None
    versions: list[int] = field(default_factory=list)  # the weights version that sampled each token
