"""End-to-end test of strata-daemon through a Python gRPC client.

The client stubs are generated from proto/strata.proto at test time with
grpcio-tools, so the test exercises the wire protocol exactly as a
third-party client would see it.  One daemon is started for the whole
session on a temporary Unix socket and stopped with SIGTERM at the end.

Setup and run (from the repository root):

    cargo build --release
    python3 -m venv .venv-test
    .venv-test/bin/pip install -r tests/python/requirements.txt
    .venv-test/bin/python -m pytest tests/python -v

Environment:
    STRATA_BIN_DIR  directory holding strata-daemon (default: target/release
                    under the repository root)
    STRATA_MODEL    GGUF model file (default:
                    $STRATA_MODELS/SmolLM2-135M-Instruct.Q4_1.gguf, with
                    STRATA_MODELS defaulting to ~/.cache/strata/models)
"""

import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO / "proto"
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVICE = "strata.v1.Strata"

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
RPC_TIMEOUT_S = 60.0

# grpcio (C core, >= 1.57) sends the percent-encoded socket path as the HTTP/2
# :authority of a "unix:" channel (e.g. "tmp%2Fx%2Fstrata.sock"), which the
# daemon's HTTP/2 layer (hyper/h2) rejects as malformed with RST_STREAM
# PROTOCOL_ERROR.  Clients of a tonic server on a Unix socket must therefore
# set a valid authority; "localhost" is the usual convention.
CHANNEL_OPTIONS = [("grpc.default_authority", "localhost")]


def _channel(sock):
    return grpc.insecure_channel("unix:" + sock, options=CHANNEL_OPTIONS)


from strata_paths import bin_dir as _bin_dir, model_path as _model_path  # noqa: E402


# --------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pb(tmp_path_factory):
    """The generated modules, as a namespace with .pb2 and .grpc."""
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("gen")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        str(PROTO_DIR / "strata.proto"),
    ]
    rc = protoc.main(args)
    assert rc == 0, f"protoc failed ({rc}) on {PROTO_DIR / 'strata.proto'}"
    sys.path.insert(0, str(out))
    try:
        pb2 = importlib.import_module("strata_pb2")
        pb2_grpc = importlib.import_module("strata_pb2_grpc")
    finally:
        sys.path.remove(str(out))

    class Gen:
        pass

    g = Gen()
    g.pb2 = pb2
    g.grpc = pb2_grpc
    return g


def _wait_ready(channel, pb, proc, log_path, deadline):
    """Polls the health service (then GetStats) until the daemon serves."""
    health = health_pb2_grpc.HealthStub(channel)
    stub = pb.grpc.StrataStub(channel)
    last_err = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(
                f"strata-daemon exited early with code {proc.returncode}:\n"
                + Path(log_path).read_text(errors="replace")[-4000:]
            )
        try:
            for name in ("", SERVICE):
                r = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=2)
                if r.status != health_pb2.HealthCheckResponse.SERVING:
                    raise RuntimeError(f"health of {name!r}: {r.status}")
            stub.GetStats(pb.pb2.StatsRequest(), timeout=2)
            return
        except (grpc.RpcError, RuntimeError) as e:
            last_err = e
            time.sleep(0.1)
    pytest.fail(f"strata-daemon not ready after {START_TIMEOUT_S:.0f} s: {last_err}")


@pytest.fixture(scope="session")
def daemon(pb):
    """Starts strata-daemon on a temporary socket; yields the socket path."""
    exe = _bin_dir() / "strata-daemon"
    model = _model_path()
    if not exe.is_file():
        pytest.fail(f"{exe} not found: run `cargo build --release` or set STRATA_BIN_DIR")
    if not model.is_file():
        pytest.fail(f"model {model} not found: set STRATA_MODEL or STRATA_MODELS")
    tmp = tempfile.mkdtemp(prefix="strata-test-")
    sock = os.path.join(tmp, "strata.sock")
    log_path = os.path.join(tmp, "daemon.log")
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [str(exe), "--model", str(model), "--socket", sock, "--threads", "2"],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not os.path.exists(sock):
            if proc.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        with _channel(sock) as ch:
            _wait_ready(ch, pb, proc, log_path, deadline)
        yield sock
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                log.close()
                pytest.fail("strata-daemon did not stop within 30 s of SIGTERM")
        log.close()
    output = Path(log_path).read_text(errors="replace")
    assert proc.returncode == 0, f"strata-daemon exited with {proc.returncode}:\n{output[-4000:]}"
    assert not os.path.exists(sock), "strata-daemon left its socket file behind"
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def channel(daemon):
    ch = _channel(daemon)
    yield ch
    ch.close()


@pytest.fixture(scope="session")
def stub(pb, channel):
    return pb.grpc.StrataStub(channel)


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def _request(pb, prompt="", messages=(), max_tokens=8, **sampling):
    req = pb.pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens)
    for role, content in messages:
        req.messages.add(role=role, content=content)
    s = pb.pb2.SamplingParams(temperature=sampling.pop("temperature", 0.0))
    for k, v in sampling.items():
        setattr(s, k, v)
    req.sampling.CopyFrom(s)
    return req


def _collect(stub, req):
    """Runs a Generate call; returns (token texts, done events, event kinds)."""
    texts, dones, kinds = [], [], []
    for ev in stub.Generate(req, timeout=RPC_TIMEOUT_S):
        kind = ev.WhichOneof("event")
        kinds.append(kind)
        if kind == "token":
            texts.append(ev.token.text)
        elif kind == "done":
            dones.append(ev.done)
    return texts, dones, kinds


def _check_stream(texts, dones, kinds):
    assert kinds, "empty stream"
    assert kinds.count("done") == 1, f"expected exactly one Done event, got kinds {kinds}"
    assert kinds[-1] == "done", "the Done event is not the last one"
    assert all(k == "token" for k in kinds[:-1]), f"unexpected events {kinds}"
    done = dones[0]
    assert done.text == "".join(texts) + done.tail
    return done


def _stats(pb, stub):
    return stub.GetStats(pb.pb2.StatsRequest(), timeout=RPC_TIMEOUT_S)


def _greedy_paris(pb, stub):
    texts, dones, kinds = _collect(stub, _request(pb, "The capital of France is", max_tokens=8))
    done = _check_stream(texts, dones, kinds)
    assert ("".join(texts) + done.tail).startswith(" Paris"), repr(done.text)
    return done


# --------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------


def test_greedy_generate(pb, stub):
    done = _greedy_paris(pb, stub)
    c = done.counters
    assert c.prompt_tokens == 5
    assert 1 <= c.generated_tokens <= 8
    assert c.finish_reason != pb.pb2.FINISH_REASON_UNSPECIFIED
    assert c.finish_reason in (pb.pb2.FINISH_REASON_MAX_TOKENS, pb.pb2.FINISH_REASON_EOS)
    if c.finish_reason == pb.pb2.FINISH_REASON_MAX_TOKENS:
        assert c.generated_tokens == 8
    assert c.decode_tok_s > 0
    assert c.prompt_ms >= 0 and c.decode_ms > 0
    assert c.request_id >= 1


def test_chat(pb, stub):
    req = _request(
        pb,
        messages=[
            ("system", "Answer in one short sentence."),
            ("user", "What is the capital of France?"),
        ],
        max_tokens=40,
    )
    texts, dones, kinds = _collect(stub, req)
    done = _check_stream(texts, dones, kinds)
    assert "Paris" in done.text, repr(done.text)
    assert done.counters.prompt_tokens > 10


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(prompt=""),
        dict(max_tokens=0),
        dict(max_tokens=10**6),
        dict(temperature=-1.0),
        dict(top_p=0.0),
        dict(top_p=1.5),
    ],
    ids=["empty-prompt", "max_tokens-0", "max_tokens-1e6", "temperature-neg", "top_p-0", "top_p-1.5"],
)
def test_invalid_request(pb, stub, kwargs):
    kw = dict(prompt="Hello", max_tokens=4)
    kw.update(kwargs)
    rejected = _stats(pb, stub).totals.rejected
    with pytest.raises(grpc.RpcError) as ei:
        # Consume the stream: the error surfaces on the first read.
        list(stub.Generate(_request(pb, **kw), timeout=RPC_TIMEOUT_S))
    err = ei.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    assert err.details(), "INVALID_ARGUMENT without a message"
    assert _stats(pb, stub).totals.rejected == rejected + 1


def test_valid_after_invalid(pb, stub):
    # Runs after test_invalid_request (file order): the daemon still serves.
    with pytest.raises(grpc.RpcError):
        list(stub.Generate(_request(pb, prompt="", max_tokens=4), timeout=RPC_TIMEOUT_S))
    _greedy_paris(pb, stub)


def test_concurrent_requests(pb, stub):
    prompts = ["Once upon a time", "The three primary colors are"]
    results = [None, None]
    errors = []

    def worker(i):
        try:
            results[i] = _collect(stub, _request(pb, prompts[i], max_tokens=24))
        except Exception as e:  # reported in the main thread
            errors.append((i, e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=2 * RPC_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a generation did not finish"
    assert not errors, errors
    ids = set()
    for texts, dones, kinds in results:
        done = _check_stream(texts, dones, kinds)
        c = done.counters
        assert c.generated_tokens >= 1
        if c.finish_reason == pb.pb2.FINISH_REASON_MAX_TOKENS:
            assert c.generated_tokens == 24
        assert len(texts) == c.generated_tokens
        ids.add(c.request_id)
    assert len(ids) == 2, "both requests got the same request id"


def test_cancellation(pb, stub):
    before = _stats(pb, stub).totals.cancelled
    # A prompt that keeps going (a list) so EOS does not end it early.
    call = stub.Generate(_request(pb, "Here is a list of 400 animals:\n1.", max_tokens=400), timeout=RPC_TIMEOUT_S)
    got = 0
    for ev in call:
        assert ev.WhichOneof("event") == "token", "finished before it could be cancelled"
        got += 1
        if got == 3:
            break
    assert got == 3
    call.cancel()
    with pytest.raises(grpc.RpcError) as ei:
        for _ in call:
            pass
    assert ei.value.code() == grpc.StatusCode.CANCELLED

    deadline = time.monotonic() + 5.0
    while True:
        s = _stats(pb, stub)
        if s.totals.cancelled >= max(1, before + 1):
            break
        assert time.monotonic() < deadline, f"totals.cancelled still {s.totals.cancelled} after 5 s"
        time.sleep(0.05)
    # The engine is free again and answers correctly.
    _greedy_paris(pb, stub)


def test_stats(pb, stub):
    # One request of our own, so the test also holds when run alone.
    _check_stream(*_collect(stub, _request(pb, "Hello", max_tokens=1)))
    s = _stats(pb, stub)
    assert s.model.architecture == "llama"
    assert s.model.n_layers == 30
    assert s.model.threads == 2
    assert s.model.path.endswith(".gguf")
    assert s.totals.requests >= 1
    assert s.totals.generated_tokens >= 1
    assert s.rss_bytes > 0
    assert s.uptime_s > 0
    assert s.version
    assert s.HasField("last_request")
    assert s.last_request.request_id >= 1


@pytest.mark.xfail(
    reason="grpcio sends the percent-encoded socket path as :authority, which h2 rejects "
    "(RST_STREAM PROTOCOL_ERROR); clients must set grpc.default_authority",
    raises=grpc.RpcError,
    strict=False,
)
def test_plain_unix_channel(pb, daemon):
    with grpc.insecure_channel("unix:" + daemon) as ch:
        s = pb.grpc.StrataStub(ch).GetStats(pb.pb2.StatsRequest(), timeout=10)
    assert s.model.architecture == "llama"
