"""Round-trip latency of the engine process, over ipc and tcp loopback.

    python bench/bench_roundtrip.py [--core fake|real] [-n 2000]

For each transport it starts an engine process, then, one request at a time:
  submit→Accepted   Client.submit() until the Accepted message arrives (decode,
                    core.add_request validation, encode, both IO threads); each request
                    is canceled right after, so the engine stays idle between samples;
  stats             Stats → StatsReply, the same path without the core's admission.
`fake` runs tests/fake_core.py (no model: the transport and process overhead alone);
`real` runs `python -m engine serve --device cpu` on the embedded model (or --model).
"""
from __future__ import annotations

import argparse
import pathlib
import socket
import sys
import tempfile
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent

from engine.serve import transport  # noqa: E402
from frontend.launcher import launched_engine  # noqa: E402
from frontend import GenerateParams  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(client, n: int) -> tuple[np.ndarray, np.ndarray]:
    params = GenerateParams(prompt="a red circle", steps=50, output="latent")
    accepted, stats = [], []
    for i in range(n):
        handle = client.submit(params, progress=False)
        handle.accepted(timeout=10)
        accepted.append(handle.accepted_at - handle.submitted_at)
        handle.cancel()
        handle.result(timeout=10)
        start = time.perf_counter()
        client.stats()
        stats.append(time.perf_counter() - start)
    return np.array(accepted) * 1e6, np.array(stats) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--core", choices=("fake", "real"), default="fake")
    ap.add_argument("-n", type=int, default=2000, help="samples per transport")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--model", default="shapes", help="with --core real: 'shapes' or a diffusers model folder")
    args = ap.parse_args(argv)

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-", dir=transport.runtime_dir()) as tmp:
        for name, address in (("ipc", f"ipc://{tmp}/engine.sock"), ("tcp", f"tcp://127.0.0.1:{free_port()}")):
            if args.core == "fake":
                command = [sys.executable, str(REPO / "tests" / "fake_core.py"), "--address", address]
            else:
                command = [sys.executable, "-m", "engine", "serve", "--address", address, "--device", "cpu",
                           "--model", args.model]
            with launched_engine(command, address, pathlib.Path(tmp) / f"{name}.log") as (_, client):
                measure(client, args.warmup)
                accepted, stats = measure(client, args.n)
            rows.append((name, accepted, stats))

    print(f"core={args.core}{' model=' + args.model if args.core == 'real' else ''}, n={args.n} sequential "
          "samples per transport, microseconds")
    print(f"{'transport':<10}{'submit→Accepted p50':>21}{'p99':>9}{'stats p50':>11}{'p99':>9}")
    for name, accepted, stats in rows:
        print(f"{name:<10}{np.percentile(accepted, 50):>21.0f}{np.percentile(accepted, 99):>9.0f}"
              f"{np.percentile(stats, 50):>11.0f}{np.percentile(stats, 99):>9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
