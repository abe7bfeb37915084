"""The `tandem` commands against a live tiny cluster (router, prefill and decode worker as
real processes, a real redis-server, an EAGLE-3 draft), each run as a person or a script
runs it: `generate`'s greedy text is the SDK's for the same prompt, `models` and `health`
print what the router says, `chat` in a pseudo-terminal keeps the conversation (the
second turn's prompt, as the router counts it, is the first turn's plus its answer),
/reset forgets it, Ctrl-C stops an answer and cancels its request; and each command's
exit code for a stopped router, a refused request and a timeout."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pexpect
import pytest
import redis
import torch
from transformers import PreTrainedTokenizerFast

from ledger.ledger import Ledger, RequestState
from serving.launcher import Cluster
from tandem_client import TandemClient
from tandem_client.exit_codes import ExitCode
from tandem_client.models import format_models
from tests.engine.tiny_drafts import build_random_draft
from tests.services.cluster_helpers import (
    TINY_WORKER_ARGS,
    build_tiny_target,
    non_final_requests,
    tiny_cluster_spec,
    wait_audit_clean,
)

REPO = Path(__file__).resolve().parents[2]
K = 3
MAX_TOKENS = 10
LONG = 1500  # tokens an answer would take seconds to finish: it is stopped before
WORKER_ARGS = (*TINY_WORKER_ARGS, "--kv-cache-memory", str(24 << 20))
# What the SDK's greedy parameters are on the command line.
GREEDY = ("--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--ignore-eos")
# The stats line after each answer (tandem_client.terminal.Streamed.stats_line).
STATS = re.compile(r"\[(\d+) tokens in [^\]]*; prompt (\d+) tokens[^\]]*finish: (\w+)\]")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    torch.set_num_threads(1)  # this process shares the cores with the cluster's
    out = tmp_path_factory.mktemp("cli_tiny")
    build_tiny_target(out / "target")
    build_random_draft(out / "target", out / "eagle3", "eagle3", seed=1, std=0.3)
    return out / "target", out / "eagle3"


@pytest.fixture(scope="module")
def cluster(
    model_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    target, draft = model_dirs
    log_dir = tmp_path_factory.mktemp("cli_logs")
    spec = tiny_cluster_spec(
        target,
        log_dir,
        draft=str(draft),
        num_draft_tokens=K,
        adaptive_speculation=False,  # K every step: drafts are counted
        worker_args=WORKER_ARGS,
    )
    started = Cluster(spec).start(timeout_s=120)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def ledger(cluster: Cluster) -> Iterator[Ledger]:
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    yield Ledger(client)
    client.close()


@pytest.fixture(scope="module")
def sdk(cluster: Cluster) -> Iterator[TandemClient]:
    with TandemClient(cluster.router_address, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def closed_port() -> str:
    """An address where nothing listens (a stopped router)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"127.0.0.1:{port}"


def env(**extra: str) -> dict[str, str]:
    values = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    values.update(TERM="dumb", OMP_WAIT_POLICY="PASSIVE", **extra)
    return values


def tandem(
    *args: str, stdin: str | None = None, **extra_env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tandem_client", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env(**extra_env),
        check=False,
    )


def one_error_line(result: subprocess.CompletedProcess[str], command: str) -> str:
    """The only line on stderr: the command's error."""
    lines = result.stderr.splitlines()
    errors = [line for line in lines if line.startswith(f"tandem {command}: error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    return errors[0]


def test_generate_streams_what_the_sdk_answers(cluster: Cluster, sdk: TandemClient) -> None:
    """Plain text, a chat (the default: the tiny model has a template), several prompts
    and the router from $TANDEM_ROUTER: stdout is the SDK's greedy text; stderr the
    figures."""
    params: dict = dict(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    text = sdk.generate("abc", **params)
    chat = sdk.generate([{"role": "user", "content": "hello"}], **params)

    plain = tandem("generate", "--router", cluster.router_address, *GREEDY, "--no-chat", "abc")
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == text.text + "\n"
    (stats,) = plain.stderr.splitlines()
    assert STATS.fullmatch(stats).groups() == (str(MAX_TOKENS), "3", "length"), stats  # type: ignore[union-attr]

    both = tandem("generate", *GREEDY, "hello", "again", TANDEM_ROUTER=cluster.router_address)
    assert both.returncode == 0, both.stderr
    again = sdk.generate([{"role": "user", "content": "again"}], **params)
    assert both.stdout == f">>> hello\n{chat.text}\n>>> again\n{again.text}\n"
    prompt_tokens = [int(STATS.fullmatch(line).group(2)) for line in both.stderr.splitlines()]  # type: ignore[union-attr]
    assert chat.usage is not None and again.usage is not None
    assert prompt_tokens == [chat.usage.prompt_tokens, again.usage.prompt_tokens]


def test_models_and_health(cluster: Cluster, sdk: TandemClient) -> None:
    (info,) = sdk.models()
    expected = format_models([info])
    draft = f"{info.draft_model} (eagle3)"
    assert expected.splitlines() == [
        f"NAME{' ' * (len(info.name) - 4)}  CONTEXT  {'DRAFT':<{len(draft)}}  PARENT",
        f"{info.name}     2048  {draft}  -",
    ]
    for argv in (["models"], ["models", "list"]):
        result = tandem(*argv, "--router", cluster.router_address)
        assert (result.returncode, result.stdout, result.stderr) == (0, expected, "")
    result = tandem("models", "list", TANDEM_ROUTER=cluster.router_address)
    assert (result.returncode, result.stdout) == (0, expected)
    result = tandem("health", "--router", cluster.router_address)
    assert (result.returncode, result.stdout, result.stderr) == (0, "SERVING\n", "")


def test_exit_codes_of_a_stopped_router(closed_port: str) -> None:
    """Each command, against an address where nothing listens: one line saying so, exit 3;
    `health --wait` asks until its time is up."""
    argv = {
        "generate": ("generate", "--router", closed_port, "hi"),
        "chat": ("chat", "--router", closed_port),
        "models": ("models", "--router", closed_port),
        "health": ("health", "--router", closed_port),
    }
    with ThreadPoolExecutor(len(argv)) as pool:  # the four at once: each waits for retries
        futures = {name: pool.submit(tandem, *args, stdin="hi\n") for name, args in argv.items()}
    runs = {name: future.result() for name, future in futures.items()}
    for command, result in runs.items():
        assert result.returncode == ExitCode.UNAVAILABLE, (command, result.stderr)
        line = one_error_line(result, command)
        assert f"the router at {closed_port} is unavailable" in line, line
        assert "--router HOST:PORT" in line
        assert result.stdout in ("", ">>> "), result.stdout
    started = time.monotonic()
    waited = tandem("health", "--router", closed_port, "--wait", "1")
    assert waited.returncode == ExitCode.UNAVAILABLE and time.monotonic() - started > 1.0
    assert "is unavailable" in one_error_line(waited, "health")


def test_exit_codes_of_refused_and_late_requests(cluster: Cluster) -> None:
    """A refused request names the field (exit 4), from generate and from a piped chat; an
    answer past --timeout is exit 5."""
    address = cluster.router_address
    refused = tandem("generate", "--router", address, "--max-tokens", "0", "hi")
    assert refused.returncode == ExitCode.INVALID_REQUEST, refused.stderr
    assert "refused the request: max_tokens: " in one_error_line(refused, "generate")
    unknown = tandem("generate", "--router", address, "--model", "no-such-model", "hi")
    assert unknown.returncode == ExitCode.INVALID_REQUEST, unknown.stderr
    assert "refused the request: model: " in one_error_line(unknown, "generate")
    chat = tandem("chat", "--router", address, "--temperature", "-1", stdin="hi\nhi again\n")
    assert chat.returncode == ExitCode.INVALID_REQUEST, chat.stderr
    assert "refused the request: temperature: " in one_error_line(chat, "chat")
    late = tandem(
        "generate", "--router", address, "--timeout", "0.5", "--max-tokens", str(LONG),
        "--ignore-eos", "--no-chat", "abc",
    )  # fmt: skip
    assert late.returncode == ExitCode.TIMEOUT, late.stderr
    assert "no answer within 0.5 s" in one_error_line(late, "generate")


def spawn_chat(address: str, *args: str) -> pexpect.spawn:
    child = pexpect.spawn(
        sys.executable,
        ["-m", "tandem_client", "chat", "--router", address, *args],
        cwd=str(REPO),
        env=env(),
        encoding="utf-8",
        timeout=60,
        dimensions=(40, 250),
    )
    child.expect(r"tandem chat: \S+ at ")
    child.expect_exact(">>> ")
    return child


def say(child: pexpect.spawn, line: str) -> tuple[str, int]:
    """Types ``line``; the answer printed and the prompt tokens its figures give."""
    child.sendline(line)
    child.expect(STATS)
    prompt_tokens = int(child.match.group(2))
    lines = child.before.replace("\r", "").split("\n")
    assert lines[0].endswith(line) and lines[-1] == "", lines  # the echo; the answer's newline
    child.expect_exact(">>> ")
    return lines[-2], prompt_tokens


def test_chat_in_a_terminal_keeps_the_conversation(
    cluster: Cluster, sdk: TandemClient, model_dirs: tuple[Path, Path]
) -> None:
    """Two turns: the second sends the first and its answer (the router's prompt count
    grows by exactly those tokens), and answers as the SDK does for that conversation;
    after /reset a turn stands alone; /exit quits with 0."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dirs[0]))

    def num_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    params: dict = dict(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    child = spawn_chat(cluster.router_address, *GREEDY)
    first, first_prompt = say(child, "hello")
    second, second_prompt = say(child, "tell me more")
    child.sendline("/reset")
    child.expect_exact("(the conversation starts over)")
    child.expect_exact(">>> ")
    alone, alone_prompt = say(child, "tell me more")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0

    conversation = [{"role": "user", "content": "hello"}]
    answer = sdk.generate(conversation, **params)
    assert first == answer.text and answer.usage is not None
    assert first_prompt == answer.usage.prompt_tokens
    conversation += [
        {"role": "assistant", "content": first},
        {"role": "user", "content": "tell me more"},
    ]
    answer = sdk.generate(conversation, **params)
    assert second == answer.text and answer.usage is not None
    assert second_prompt == answer.usage.prompt_tokens
    # The tiny template: "<s>ROLE: CONTENT</s>" per message, then "<s>assistant: ".
    turn = "</s><s>user: tell me more</s><s>assistant: "
    assert second_prompt == first_prompt + num_tokens(first) + num_tokens(turn)
    answer = sdk.generate([{"role": "user", "content": "tell me more"}], **params)
    assert (alone, alone_prompt) == (answer.text, answer.usage.prompt_tokens)  # type: ignore[union-attr]
    assert alone_prompt == num_tokens("<s>user: tell me more</s><s>assistant: ")


async def test_chat_ctrl_c_stops_the_answer_and_cancels_it(
    cluster: Cluster, ledger: Ledger
) -> None:
    """Ctrl-C mid-answer: back at the prompt, the request cancelled and its blocks freed;
    the conversation goes on; Ctrl-D quits with 0."""
    before = cancelled(ledger)
    child = spawn_chat(cluster.router_address, "--max-tokens", str(LONG), "--ignore-eos")
    child.sendline("go on and on")
    # Streaming, not reading the line: a Ctrl-C while readline still holds the terminal
    # (its escape sequences can pass for answer text) is a character, not a signal.
    await until_decoding(ledger)
    child.expect(r".{8}")  # some of the answer
    child.sendintr()
    child.expect_exact("[answer stopped]")
    child.expect_exact(">>> ")
    await wait_audit_clean(cluster, ledger, within_s=3.0)
    assert len(cancelled(ledger) - before) == 1
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


async def until_decoding(ledger: Ledger, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while "DECODING" not in non_final_requests(ledger).values():
        assert time.monotonic() < deadline, "the chat's request never started decoding"
        await asyncio.sleep(0.05)


def cancelled(ledger: Ledger) -> set[str]:
    """The keys of the ledger's CANCELLED requests."""
    found = set()
    for key in ledger.client.scan_iter(match=f"{ledger.ns}:{{req:*}}", count=1000):
        is_record = re.fullmatch(rf"{ledger.ns}:\{{req:[^}}]+\}}", key)
        if is_record and ledger.client.hget(key, "state") == RequestState.CANCELLED.value:
            found.add(key)
    return found
