"""The adapter pool's loader thread: an adapter file read with diffusers' steps and its
factors copied to the layers' device and dtype, completely, off the engine's busy loop
(which only points the layers at them). On CUDA the copies run on a stream of the loader's
own, page-locked and asynchronous, so the busy loop's stream never waits for them and no
copy synchronises the device.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import pathlib

import torch

from engine.lora.files import AdapterError, AdapterReader, Factors, file_signature


class AdapterStager:
    """`submit(name, path)` → a future of `stage(name, path)`, run on one loader thread."""

    def __init__(self, reader: AdapterReader, layers: dict[str, dict], denoiser_name: str):
        self.reader, self._layers, self.denoiser_name = reader, layers, denoiser_name
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._stream = None  # the loader thread's CUDA stream

    def submit(self, name: str, path: pathlib.Path) -> concurrent.futures.Future:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="adapter-loader")
        return self._executor.submit(lambda: self.stage(name, path))

    def close(self) -> None:
        """Stop the loader thread (after the load it runs, if any)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def stage(self, name: str, path: pathlib.Path) -> tuple[tuple, list[Factors]]:
        """(On the loader thread.) The file read with diffusers' steps and its factors copied
        to the layers' device and dtype, completely (the busy loop only points at them).
        Returns the file's signature as read, and the factors."""
        before = file_signature(path)
        factors = self.reader.read(path)
        if file_signature(path) != before:
            raise AdapterError("its file changed while it was read")
        device = next(iter(self._layers[self.denoiser_name].values())).weights.device
        stream = None
        if device.type == "cuda":  # a stream of the loader's own: the busy loop's stream never waits for it
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
            stream = self._stream
        def placed(t: torch.Tensor, weights) -> torch.Tensor:
            t = t.to(dtype=weights.dtype).contiguous()  # converted on the host
            if weights.device.type != "cuda":
                return t.to(weights.device)
            # page-locked and asynchronous: no copy here synchronises the device (the busy
            # loop's steps may run under torch's sync debug mode, which is process-wide)
            return t.pin_memory().to(weights.device, non_blocking=True)

        staged = []
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for f in factors:
                weights = self._layers[f.component][f.module].weights
                staged.append(dataclasses.replace(f, A=placed(f.A, weights), B=placed(f.B, weights)))
        if stream is not None:  # the copies are done before the busy loop's stream reads the factors
            done = torch.cuda.Event()
            done.record(stream)
            done.synchronize()  # this thread waits, nothing else
        return before, staged
