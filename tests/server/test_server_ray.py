"""The server on Ray Serve (``serve MODEL --ray --replicas 2``), as its users meet it: a real local Ray
cluster started by the command, driven by the official `openai` client and raw HTTP.

One application for the module (starting Ray takes most of this file's time): two engine replicas of a tiny
model, one thread each. Checked: answers equal the single-process server's (greedy, streamed, chat, seeded
sampling with n > 1), requests sharing a prompt prefix land on the replica that holds it (its prefix-cache
hits in ``/metrics``), and a replica killed mid-stream fails its own requests with a clear error while the
other replica finishes its own, Ray replaces it and nothing hangs. The command leaves no Ray process behind.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from server_process import KEY, NAME, Server, run_servers, wait_for_start  # noqa: E402

REPLICA = re.compile(r'hf_paged_cache_blocks_used\{replica="(\w+)"\}')
PROMPTS = ["The quick brown fox", "Paged attention stores keys", "0123456789 abcdefghij"]


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory) -> Iterator[tuple[Server, Server]]:
    """The Ray application and the single-process server on the same model, started side by side. The Ray one
    computes a token per request and step (``--speculative off``): the replica-failure test needs its streams
    to last (drafts of these repetitive answers would end them several times sooner)."""
    ray_log = tmp_path_factory.mktemp("ray-server-log") / "server.log"
    lone_log = tmp_path_factory.mktemp("lone-server-log") / "server.log"
    with run_servers([
        (model_dir, ray_log, "--ray", "--replicas", "2", "--replica-threads", "1", "--replica-cpus", "0",
         "--num-blocks", "256", "--speculative", "off"),
        (model_dir, lone_log, "--num-blocks", "256"),
    ]) as (ray_running, lone_running):
        ray_processes = psutil.Process(ray_running.process.pid).children(recursive=True)
        yield ray_running, lone_running
    _assert_gone(ray_processes)


@pytest.fixture(scope="module")
def ray_server(servers) -> Server:
    return servers[0]


@pytest.fixture(scope="module")
def lone_server(servers) -> Server:
    return servers[1]


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_two_replicas_answer_as_the_single_process_server(ray_server, lone_server):
    answers = {}
    for name, server in (("ray", ray_server), ("lone", lone_server)):
        api = client(server)
        batch = api.completions.create(model=NAME, prompt=PROMPTS, max_tokens=12, temperature=0)
        stream = api.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True)
        chat = api.chat.completions.create(model=NAME, messages=[{"role": "user", "content": PROMPTS[1]}],
                                           max_tokens=10, temperature=0)
        sampled = api.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=10, temperature=0.8, n=2, seed=7)
        answers[name] = (
            [choice.text for choice in sorted(batch.choices, key=lambda c: c.index)],
            "".join(chunk.choices[0].text for chunk in stream if chunk.choices),
            chat.choices[0].message.content,
            [choice.text for choice in sorted(sampled.choices, key=lambda c: c.index)],
            batch.usage.prompt_tokens,
        )
    assert answers["ray"] == answers["lone"]
    assert all(answers["ray"][0]) and answers["ray"][3][0] != answers["ray"][3][1]  # real, different samples


def test_bad_requests_get_the_same_errors(ray_server, lone_server):
    for body in (b"{not json", b'{"model": "tiny-llama", "prompt": "x", "max_tokens": -1}'):
        replies = [httpx.post(server.url + "/v1/completions", content=body, timeout=30,
                              headers={**server.headers(), "Content-Type": "application/json"})
                   for server in (ray_server, lone_server)]
        assert [r.status_code for r in replies] == [400, 400]
        assert replies[0].json() == replies[1].json()
    assert httpx.get(ray_server.url + "/v1/models", timeout=30).status_code == 401  # the API key, as alone


def test_requests_sharing_a_prefix_land_on_the_replica_that_holds_it(ray_server):
    """Three prefixes of 6 blocks, four requests each, interleaved: every request after a prefix's first finds
    its 96 tokens cached, which with two replicas happens only if each prefix's requests share a replica."""
    api = client(ray_server)
    prefixes = [f"{letter * 8} system prompt {i}: ".ljust(96, letter) for i, letter in enumerate("xyz")]
    before = _settled_hit_tokens(ray_server)  # the earlier tests' hits included, however late they are posted
    for question in range(4):
        for prefix in prefixes:
            api.completions.create(model=NAME, prompt=prefix + f"question {question}?", max_tokens=2, temperature=0)
    expected = len(prefixes) * 3 * 96
    deadline = time.monotonic() + 10  # replicas post their stats twice a second
    while _hit_tokens(ray_server) - before < expected and time.monotonic() < deadline:
        time.sleep(0.25)
    assert _hit_tokens(ray_server) - before == expected


def test_a_replica_killed_mid_stream_fails_its_requests_and_the_others_go_on(ray_server):
    import ray

    api = client(ray_server)
    outcomes: dict[int, tuple[str, int, str]] = {}

    def stream(i: int) -> None:
        received = 0
        try:
            for chunk in api.completions.create(model=NAME, prompt=f"request {i} " * 8, max_tokens=900,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True}):
                received += len(chunk.choices[0].text) if chunk.choices else 0
            outcomes[i] = ("finished", received, "")
        except openai.APIError as error:
            outcomes[i] = ("failed", received, str(error))

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
    for thread in threads:  # spaced, so that the router sees each replica's queue (published twice a second)
        thread.start()
        time.sleep(0.6)
    running = _wait_for(lambda: _running(ray_server) if sum(_running(ray_server).values()) == 4 else None, 30)
    victim = max(running, key=running.get)
    assert 0 < running[victim] < 4, running  # both replicas have streams: the survivor's must finish
    ray.init(address="auto", logging_level="ERROR")
    try:
        ray.kill(ray.get_actor(f"SERVE_REPLICA::hf_paged_cache#EngineReplica#{victim}", namespace="serve"))
        for thread in threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in threads), "a client hangs"
        failed = [o for o in outcomes.values() if o[0] == "failed"]
        finished = [o for o in outcomes.values() if o[0] == "finished"]
        assert len(failed) == running[victim] and len(finished) == 4 - running[victim], outcomes
        assert all("the replica running this request failed" in message for _, _, message in failed)
        assert all(received > 0 for _, received, _ in finished)
        # Ray replaces the dead replica (a new process that loads the model: a start-up, waited for as one)

        def replaced() -> bool:
            replicas = _replicas(ray_server)
            return len(replicas) == 2 and victim not in replicas

        wait_for_start(ray_server.process, ray_server.log, replaced)
        answer = api.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0)
        assert answer.choices[0].finish_reason == "length"
    finally:
        ray.shutdown()


def test_a_prefix_summary_counts_the_leading_blocks_a_replica_holds():
    """The router's view of a replica (`PrefixSummary`) agrees with its pool: the leading full blocks of a
    prompt it cached (never the block of the prompt's last token), none for another model's, bounded keys."""
    from tiny_models import tiny_model

    from hf_paged_cache import ContinuousBatcher
    from hf_paged_cache.server.ray.summary import KEY_BYTES, PrefixSummary

    prompt = list(range(5, 55))  # 50 tokens: blocks 0-2 full, and the prompt's last token in block 3
    with ContinuousBatcher(tiny_model("llama"), num_blocks=32) as batcher, \
            ContinuousBatcher(tiny_model("llama", seed=1), num_blocks=32) as other:
        batcher.submit(prompt, max_new_tokens=2, do_sample=False).result()
        summary = PrefixSummary.of(batcher)
        assert summary.cached_blocks(prompt) == 3 and summary.in_flight == 0
        assert summary.cached_blocks(prompt[:33]) == 2  # 2 full blocks before its last token
        assert summary.cached_blocks(prompt[:20] + [99] * 30) == 1  # parts in block 1
        assert summary.cached_blocks([7] + prompt[1:]) == 0
        assert all(len(key) == KEY_BYTES for key in summary.keys)
        assert PrefixSummary.of(other).cached_blocks(prompt) == 0  # another model object: another root
        assert len(PrefixSummary.of(batcher, limit=1).keys) == 1  # the newest only: block 0's key is not in it
        assert PrefixSummary.of(batcher, limit=1).cached_blocks(prompt) == 0
        assert batcher.stats().prefix_hit_tokens == 0
        batcher.submit(prompt, max_new_tokens=2, do_sample=False).result()
        assert batcher.stats().prefix_hit_tokens == 3 * 16  # what the summary promised


def test_serve_run_arguments_are_the_serve_commands():
    from hf_paged_cache.server.launch import build_parser
    from hf_paged_cache.server.ray.app import builder_argv

    argv = builder_argv({"model": "some/model", "replicas": "2", "max_memory": "64MiB", "packed_linears": "false",
                         "trust_remote_code": "true", "metrics_need_key": "false", "router": "pow2"})
    assert argv == ["some/model", "--ray", "--replicas", "2", "--max-memory", "64MiB", "--no-packed-linears",
                    "--trust-remote-code", "--router", "pow2"]
    options = build_parser().parse_args(argv)
    assert options.ray and options.replicas == 2 and not options.packed_linears and options.router == "pow2"


# ----------------------------------------------------------------------------------------------- helpers


def _metrics(server: Server) -> str:
    return httpx.get(server.url + "/metrics", timeout=30).text


def _hit_tokens(server: Server) -> float:
    return sum(float(v) for v in re.findall(r"hf_paged_cache_prefix_cache_hit_tokens_total\{[^}]*\} (\S+)",
                                           _metrics(server)))


def _settled_hit_tokens(server: Server, quiet_s: float = 2.0, timeout_s: float = 30.0) -> float:
    """The prefix hit tokens in ``/metrics`` once both replicas report and the total has not moved for
    `quiet_s` (replicas post their stats every 0.5 s; under load a post can arrive seconds late)."""
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        reporting = len(_replicas(server))
        total = _hit_tokens(server)
        if reporting < 2 or total != last:
            last, since = total, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return total
        time.sleep(0.25)
    raise AssertionError(f"the replicas' prefix hits did not settle in {timeout_s} s")


def _running(server: Server) -> dict[str, float]:
    return {r: float(v) for r, v in re.findall(r'hf_paged_cache_requests_running\{replica="(\w+)"\} (\S+)',
                                              _metrics(server))}


def _replicas(server: Server) -> set[str]:
    return set(REPLICA.findall(_metrics(server)))


def _wait_for(probe, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"not so after {timeout} s")


def _assert_gone(processes: list[psutil.Process]) -> None:
    """The command's Ray processes (GCS, raylet, workers) all exited with it; any left are killed, and fail."""
    _, alive = psutil.wait_procs(processes, timeout=30)
    for process in alive:
        process.kill()
    assert not alive, f"Ray processes left behind: {[p.pid for p in alive]}"
