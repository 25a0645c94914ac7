"""A decode worker process (spawned by `engine.decode.workers.MultiProcessDecodeStage`):
claims the oldest ready buffer of the shared arena, decodes it with the model's VAE,
post-processes it and publishes the output in place."""
from __future__ import annotations

import logging
import os
import pathlib
import signal
import sys
import time

import numpy as np

from engine.decode import arena as A


def worker_main(arena_name: str, index: int, model_dir: str, device: str, threads: int, parent_pid: int,
                arena_fd: int | None = None) -> None:
    """Entry point of decode worker `index` (a spawned process)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle; it stops us
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s")
    wlog = logging.getLogger(f"diffslot.decode.worker{index}")
    arena = A.Arena.attach(arena_name, parent_pid, arena_fd)
    import torch

    from engine.models.model import VaeDecoder

    torch.set_num_threads(max(1, threads))
    dev = torch.device(device)
    model = VaeDecoder.from_folder(pathlib.Path(model_dir), dev)
    if dev.type == "cuda":
        arena.pin()
    try:  # the first call pays for kernel selection and allocator warm-up: not a request's
        config = model.vae.config
        cells = max(1, int(config.sample_size) // model.scale)
        model.decode(torch.zeros(1, int(config.latent_channels), cells, cells))
    except Exception:
        wlog.warning("decode worker %d: warm-up decode failed", index, exc_info=True)
    wid = index + 1
    arena.store_global(A.G_WORKERS + index, os.getpid())  # ready
    wlog.debug("decode worker %d ready", index)
    while not arena.load_global(A.G_STOP):
        seq = arena.load_global(A.G_SUBMIT_SEQ)  # before the scan: a publish after it changes seq
        claimed = _claim_oldest(arena, wid)
        if claimed is None:
            if not arena.wait(A.G_SUBMIT_SEQ, seq, 0.5) and os.getppid() != parent_pid:
                wlog.warning("engine (pid %d) is gone; decode worker exiting", parent_pid)
                break
            continue
        try:
            _decode_one(arena, model, claimed[0], claimed[1], wid)
        except Exception:  # never leave a claimed buffer behind while alive
            wlog.exception("decode worker %d: unexpected error", index)
            _fail(arena, claimed[0], claimed[1], wid, "internal error in the decode worker")
    # Nothing to save: skip the interpreter's teardown of torch and diffusers, which
    # takes seconds of CPU (and would make close() wait for it).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _claim_oldest(arena: A.Arena, wid: int) -> tuple[int, int] | None:
    """Claim the READY buffer published first (decode in submit order); None if none."""
    while True:
        best = None
        for i in range(arena.buffers):
            word = arena.load(i, A.H_STATE)
            if word & 0xFF == A.READY:
                submitted = arena.load(i, A.H_SUBMIT_NS)
                if best is None or submitted < best[0]:
                    best = (submitted, i, word)
        if best is None:
            return None
        epoch = arena.claim(best[1], wid, best[2])
        if epoch is not None:
            return best[1], epoch
        # lost the race to another worker (or the engine took it back): look again


def _fail(arena: A.Arena, i: int, epoch: int, wid: int, message: str | None) -> None:
    if message is None:
        arena.store(i, A.H_FAIL, A.FAIL_CANCELED)
        arena.store(i, A.H_OUT_LEN, 0)
    else:
        data = message.encode()[:arena.output_bytes]
        arena.output_area(i)[:len(data)] = np.frombuffer(data, dtype=np.uint8)
        arena.store(i, A.H_OUT_LEN, len(data))
        arena.store(i, A.H_FAIL, A.FAIL_ERROR)
    arena.store(i, A.H_DONE_NS, time.monotonic_ns())
    arena.finish(i, epoch, wid, A.FAILED)


def _decode_one(arena: A.Arena, model, i: int, epoch: int, wid: int) -> None:
    import torch

    from engine.decode.stage import postprocess

    claim = time.monotonic_ns()
    arena.store(i, A.H_CLAIM_NS, claim)
    arena.store(i, A.H_WORKER_PID, os.getpid())
    timeout = arena.load(i, A.H_TIMEOUT_NS)
    arena.store(i, A.H_DEADLINE_NS, claim + timeout if timeout else 0)
    if arena.cancel_requested(i, epoch):
        _fail(arena, i, epoch, wid, None)
        return
    kind = A.KINDS[arena.load(i, A.H_KIND)]
    shape = tuple(arena.load(i, A.H_DIMS + k) for k in range(arena.load(i, A.H_NDIM)))
    delay = arena.load(i, A.H_DELAY_US)
    if delay:  # test hook: a slow (or, past the deadline, hung) decode
        time.sleep(delay / 1e6)
        if arena.cancel_requested(i, epoch):
            _fail(arena, i, epoch, wid, None)
            return
    latents = torch.from_numpy(arena.latent_array(i, shape))  # read in place from the arena
    try:
        payload, out_shape, dtype = postprocess(model, latents, kind)
    except Exception as exc:
        del latents
        _fail(arena, i, epoch, wid, f"{type(exc).__name__}: {exc}")
        return
    del latents
    if arena.cancel_requested(i, epoch):  # canceled (or revoked) while decoding: drop the output
        _fail(arena, i, epoch, wid, None)
        return
    data = np.frombuffer(payload, dtype=np.uint8) if isinstance(payload, bytes) \
        else np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
    if data.nbytes > arena.output_bytes:
        _fail(arena, i, epoch, wid, f"output of {data.nbytes} bytes exceeds the arena's {arena.output_bytes}-byte "
                                    f"buffers")
        return
    arena.output_area(i)[:data.nbytes] = data
    arena.store(i, A.H_OUT_LEN, data.nbytes)
    arena.store(i, A.H_OUT_NDIM, len(out_shape))
    for k, d in enumerate(out_shape):
        arena.store(i, A.H_OUT_DIMS + k, int(d))
    arena.store(i, A.H_OUT_DTYPE, A.DTYPES.index(dtype))
    arena.store(i, A.H_DONE_NS, time.monotonic_ns())
    arena.finish(i, epoch, wid, A.DONE)  # CAS: fails (and is counted) if the hand-off went stale
