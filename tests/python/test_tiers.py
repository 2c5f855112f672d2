"""Expert tiers through the Python gRPC client: knobs (get, set, refused values), residency, profile save and the
counter stream, on the split MoE fixture with about half of its experts in RAM (tools/fetch-model builds it)."""
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest

from test_grpc_client import START_TIMEOUT_S, _bin_dir, _channel, _model_path, _wait_ready, pb  # noqa: F401


@pytest.fixture(scope="module")
def moe_daemon(pb):  # noqa: F811
    model = _model_path().with_name("smollm2-moe-split.gguf")
    if not model.is_file():
        pytest.fail(f"{model} not found: run tools/fetch-model --model smollm2-moe-split")
    tmp = tempfile.mkdtemp(prefix="strata-tiers-")
    sock = os.path.join(tmp, "strata.sock")
    log_path = os.path.join(tmp, "daemon.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(_bin_dir() / "strata-daemon"), "--model", str(model), "--socket", sock,
                                 "--threads", "2", "--resident-budget-gib", "0.0286"],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not os.path.exists(sock) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with _channel(sock) as ch:
            _wait_ready(ch, pb, proc, log_path, deadline)
        yield sock
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_knobs_are_listed_validated_and_set(pb, moe_daemon):  # noqa: F811
    with _channel(moe_daemon) as ch:
        stub = pb.grpc.StrataStub(ch)
        knobs = {k.name: k for k in stub.GetKnobs(pb.pb2.GetKnobsRequest()).knobs}
        assert knobs["ram_adapt"].value == 0 and knobs["ram_adapt"].active
        assert knobs["adapt_decay"].value == pytest.approx(0.7) and knobs["adapt_decay"].range == "(0, 1]"
        assert not knobs["vram_reserve_mib"].active
        r = stub.SetKnob(pb.pb2.SetKnobRequest(name="ram-adapt", value="8"))
        assert (r.name, r.old_value, r.new_value, r.active) == ("ram_adapt", 0, 8, True)
        for name, value in [("ram_adapt", "-1"), ("adapt_decay", "2"), ("pcie_frac", "abc"), ("nope", "1")]:
            with pytest.raises(grpc.RpcError) as e:
                stub.SetKnob(pb.pb2.SetKnobRequest(name=name, value=value))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        knobs = {k.name: k.value for k in stub.GetKnobs(pb.pb2.GetKnobsRequest()).knobs}
        assert knobs["ram_adapt"] == 8 and knobs["adapt_decay"] == pytest.approx(0.7)


def test_counter_stream_residency_and_profile(pb, moe_daemon):  # noqa: F811
    with _channel(moe_daemon) as ch:
        stub = pb.grpc.StrataStub(ch)
        updates = []
        watch = stub.WatchCounters(pb.pb2.WatchRequest())

        def collect():
            for u in watch:
                updates.append(u)
                if not u.running:
                    break

        t = threading.Thread(target=collect)
        t.start()
        time.sleep(0.3)
        # a raw prompt (no chat template: no early end-of-turn), long enough to span several counter updates
        req = pb.pb2.GenerateRequest(prompt="The history of the Roman Empire begins", max_tokens=96)
        done = [e.done for e in stub.Generate(req) if e.HasField("done")][0]
        t.join(timeout=60)
        watch.cancel()
        running = [u.counters.generated_tokens for u in updates if u.running]
        assert done.counters.generated_tokens == 96
        assert len(running) >= 2 and running[-1] > running[0], running
        assert not updates[-1].running and updates[-1].counters.request_id == done.counters.request_id
        c = done.counters
        assert c.expert_lookups == c.ram_reads + c.file_blob_reads > 0
        assert c.blob_reads_per_token == pytest.approx(c.file_blob_reads / c.generated_tokens)

        res = stub.GetResidency(pb.pb2.ResidencyRequest(top=3))
        assert res.mode == "budget" and len(res.layers) == 30 and len(res.experts) == 3
        assert all(l.ram_experts + l.file_experts == 16 and l.vram_experts == 0 for l in res.layers)
        one = stub.GetResidency(pb.pb2.ResidencyRequest(layer=7))
        assert [l.layer for l in one.layers] == [7] and {e.layer for e in one.experts} == {7}
        with pytest.raises(grpc.RpcError) as e:
            stub.GetResidency(pb.pb2.ResidencyRequest(layer=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        path = os.path.join(tempfile.mkdtemp(), "p.prof")
        r = stub.SaveProfile(pb.pb2.SaveProfileRequest(path=path))
        assert r.ranked == 480 and Path(path).read_bytes()[:8] == b"STRATAPF"
        with pytest.raises(grpc.RpcError) as e:
            stub.SaveProfile(pb.pb2.SaveProfileRequest())
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
