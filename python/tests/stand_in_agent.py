#!/usr/bin/env python3
"""A stand-in for `agent deploy up ... --json`, for the tests that need the agent to misbehave on
cue (fail with a reason, never answer) or to log what each instance asked for. It speaks exactly
the contract the Python package relies on, as the real agent does:

- `agent deploy up [--deploy KIND] [--image IMG] [...] --json` starts one executor and prints
  ONE JSON line `{"url", "token_file", "tls_fingerprint", "deployment", "id", "owned"}`, then
  stays in the foreground;
- it tears the deployment down when its stdin reaches EOF (or on SIGTERM);
- on failure it exits non-zero after printing `{"error": "..."}`.

The "deployment" is a real `executor serve` ($STAND_IN_EXECUTOR) on a loopback port with a
fresh state directory and workspace. Every start and teardown is appended to $STAND_IN_LOG
(JSON lines), so tests can check which image each deployment was asked for and that it was torn
down. Images whose name contains `missing` fail; `silent` never answers (a start deadline test).
Standard library only: it runs under any python3.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def log(event: dict[str, object]) -> None:
    path = os.environ.get("STAND_IN_LOG")
    if path:
        with Path(path).open("a") as f:
            f.write(json.dumps(event) + "\n")


def main(argv: list[str]) -> int:
    if argv[:2] != ["deploy", "up"] or "--json" not in argv:
        print(json.dumps({"error": f"stand-in supports only `deploy up ... --json`: {argv}"}))
        return 2
    deploy = argv[argv.index("--deploy") + 1] if "--deploy" in argv else "local"
    image = argv[argv.index("--image") + 1] if "--image" in argv else None
    ident = f"stand-in-{os.getpid()}"
    log({"event": "up", "id": ident, "deploy": deploy, "image": image, "argv": argv})
    if image and "missing" in image:
        print(json.dumps({"error": f"image {image} not found"}), flush=True)
        return 1
    if image and "silent" in image:
        sys.stdin.buffer.read()
        return 1
    state = tempfile.mkdtemp(prefix="stand-in-state-", dir="/tmp")
    workspace = tempfile.mkdtemp(prefix="stand-in-ws-", dir="/tmp")
    Path(workspace).chmod(0o777)
    executor = subprocess.Popen(
        [
            os.environ["STAND_IN_EXECUTOR"],
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--state-dir",
            state,
            "--workspace",
            workspace,
            "--exit-on-stdin-eof",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert executor.stdout is not None
    ready, _, _ = select.select([executor.stdout], [], [], 20)
    line = executor.stdout.readline().decode() if ready else ""
    if not line.startswith("executor listening on "):
        executor.kill()
        print(json.dumps({"error": f"executor did not start: {line!r}"}), flush=True)
        return 1

    def down(*_: object) -> None:
        if executor.stdin is not None:
            executor.stdin.close()  # its lifeline: it drains and exits
        executor.wait(10)
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(workspace, ignore_errors=True)
        log({"event": "down", "id": ident, "executor_pid": executor.pid, "at": time.time()})
        sys.exit(0)

    signal.signal(signal.SIGTERM, down)
    print(
        json.dumps(
            {
                "url": line.split()[3],
                "token_file": str(Path(state) / "token"),
                "tls_fingerprint": None,
                "deployment": deploy,
                "id": ident,
                "owned": deploy != "remote",
            }
        ),
        flush=True,
    )
    log({"event": "ready", "id": ident, "executor_pid": executor.pid, "workspace": workspace})
    sys.stdin.buffer.read()  # until EOF: the client closed our stdin (or died)
    down()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
