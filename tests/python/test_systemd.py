"""The daemon under systemd's notify protocol, as the packaged unit runs it.

The test owns a datagram socket and passes it as NOTIFY_SOCKET (with WATCHDOG_USEC) to the unit's own ExecStart line
(packaging/strata.service, binary and paths mapped to this checkout; its config file is packaging/strata.toml with the
model and socket paths mapped the same way): READY=1 arrives once the daemon answers,
watchdog pings arrive while it serves, STOPPING=1 at SIGTERM, and it exits 0.
"""

import os
import re
import shlex
import signal
import socket
import subprocess
import tempfile
import time
import tomllib

from strata_paths import REPO, bin_dir, model_path

UNIT = REPO / "packaging" / "strata.service"
CONFIG = REPO / "packaging" / "strata.toml"


def _config_copy(tmp, sock_path):
    """packaging/strata.toml with its model and socket mapped to this checkout (the other lines as shipped)."""
    text = CONFIG.read_text()
    settings = tomllib.loads(text)
    assert settings["model"].startswith("/var/lib/strata/models/"), settings
    assert settings["socket"] == "/run/strata/strata.sock", settings
    text = text.replace(settings["model"], str(model_path())).replace(settings["socket"], sock_path)
    path = os.path.join(tmp, "strata.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def _exec_start(tmp, sock_path):
    line = next(l for l in UNIT.read_text().splitlines() if l.startswith("ExecStart="))
    argv = shlex.split(line[len("ExecStart="):])
    assert argv[0] == "/usr/local/bin/strata-daemon", argv
    argv[0] = str(bin_dir() / "strata-daemon")
    out = []
    it = iter(argv)
    for a in it:
        if a == "--model":
            out += [a, str(model_path())]
            next(it)
        elif a == "--socket":
            out += [a, sock_path]
            next(it)
        elif a == "--config":
            assert next(it) == "/etc/strata/strata.toml"
            out += [a, _config_copy(tmp, sock_path)]
        else:
            out.append(a)
    return out


def _recv_all(s, until, timeout):
    msgs = []
    end = time.time() + timeout
    while time.time() < end:
        s.settimeout(max(0.05, end - time.time()))
        try:
            msgs.append(s.recv(4096).decode())
        except socket.timeout:
            break
        if until(msgs):
            break
    return msgs


def test_notify_protocol_with_the_units_exec_start():
    unit = UNIT.read_text()
    assert re.search(r"^Type=notify$", unit, re.M) and re.search(r"^WatchdogSec=", unit, re.M)
    tmp = tempfile.mkdtemp(prefix="strata-sd-")
    ns = os.path.join(tmp, "notify.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(ns)
    env = dict(os.environ, NOTIFY_SOCKET=ns, WATCHDOG_USEC="400000")
    # systemd names the watched process in WATCHDOG_PID: a shell that execs the daemon keeps its pid
    argv = ["sh", "-c", 'export WATCHDOG_PID=$$; exec "$@"', "sh"] + _exec_start(tmp, os.path.join(tmp, "strata.sock"))
    proc = subprocess.Popen(argv, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        msgs = _recv_all(s, lambda m: any("READY=1" in x for x in m), 120)
        assert any("READY=1" in m for m in msgs), msgs
        assert os.path.exists(os.path.join(tmp, "strata.sock")), "READY before the socket listens"
        pings = _recv_all(s, lambda m: sum("WATCHDOG=1" in x for x in m) >= 3, 5)
        assert sum("WATCHDOG=1" in m for m in pings) >= 3, pings
        proc.send_signal(signal.SIGTERM)
        msgs = _recv_all(s, lambda m: any("STOPPING=1" in x for x in m), 30)
        assert any("STOPPING=1" in m for m in msgs), msgs
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        s.close()
