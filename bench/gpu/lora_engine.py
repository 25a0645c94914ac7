"""Part `lora_engine`: LoRA inside the engine on CUDA. A tiny SD model with an adapter pool
whose budget holds two adapters at once, the bucketed layout with CUDA graphs, requests of
every kind (plain, img2img, inpainting; Linear, 1×1 and LoCon adapters, one and two a
request) arriving in waves so that adapters are loaded on the pool's loader thread,
evicted and loaded again, and the LoCon adapter moves the pool's layout (graphs of the old
layout dropped, new ones captured) while requests run: every request finishes, equal to
the same requests on the CPU (rel L2), the pool evicted and its count stayed within its
budget, the layout moved, and every denoiser call after the start-up captures replayed a
graph."""
from __future__ import annotations

import time

from . import judge
from .engine_internals import CoreConfig, EngineCore, cuda_graph_counts
from .report import check, row
from .tiny_lora import mixed_requests, model_with_pool, no_tf32

TOLERANCE = 1e-3  # fp32 on both, TF32 off; batch compositions differ (bucketed padding vs compact)


def serve_waves(device: str, waves: int = 3, cuda_graphs: bool = True) -> dict:
    """The mixed requests in `waves` waves (a wave joins when the one before has finished)
    on `device`; returns the final latents by id and what the pool and graphs did."""
    import torch

    from engine.core import DenoiseFinished, RequestFailed

    model, pool = model_with_pool(device)
    layout = "bucketed" if device.startswith("cuda") else "compact"
    core = EngineCore(model, CoreConfig(slots=4, layout=layout, device=device, cuda_graphs=cuda_graphs), adapters=pool)
    graphs_at_start, replays_at_start = cuda_graph_counts(core)
    latents, failed, versions, peak = {}, {}, {pool.layout_version}, pool.resident_bytes
    uncounted = 0  # the most the layers really held beyond the pool's count
    native = model.geometry.native_size
    t0 = time.perf_counter()
    with torch.no_grad():
        for wave in range(waves):
            for rid, params in mixed_requests(f"w{wave}", native, seed=wave):
                core.add_request(rid, params)
            while core.has_unfinished_requests():
                for o in core.step():
                    if isinstance(o, DenoiseFinished):
                        latents[o.request_id] = o.latents.float().cpu().clone()
                        core.decode_done(o.request_id)
                    elif isinstance(o, RequestFailed):
                        failed[o.request_id] = o.error
                versions.add(pool.layout_version)
                peak = max(peak, pool.resident_bytes)
                uncounted = max(uncounted, pool.held_bytes() - pool.resident_bytes)
                if time.perf_counter() - t0 > 240:
                    raise RuntimeError(f"{len(latents)} requests finished in 240 s")
    graphs, replays = cuda_graph_counts(core)
    stats = pool.stats()
    pool.uninstall()
    return dict(latents=latents, failed=failed, versions=len(versions), peak=peak, budget=pool.budget_bytes,
                uncounted=uncounted,
                evictions=stats["evictions"], loads=stats["loads"], graphs=graphs, replays=replays,
                replays_at_start=replays_at_start, graphs_at_start=graphs_at_start, calls=core.batches,
                graph_evictions=0 if core.graphed is None else core.graphed.evictions,
                requests=waves * len(mixed_requests("x", native)))


def run(args) -> None:
    no_tf32()
    t0 = time.perf_counter()
    gpu = serve_waves("cuda")
    cpu = serve_waves("cpu")
    case = f"{gpu['requests']} requests in 3 waves, 4 slots, bucketed + graphs"
    everyone = len(gpu["latents"]) == gpu["requests"] and not gpu["failed"]
    check("lora_engine", case, "finished on cuda", len(gpu["latents"]), everyone,
          f"{len(gpu['failed'])} failed" + (f": {next(iter(gpu['failed'].values()))[:120]}" if gpu["failed"] else ""))
    errors = {rid: float((gpu["latents"][rid] - cpu["latents"][rid]).norm() / cpu["latents"][rid].norm())
              for rid in cpu["latents"] if rid in gpu["latents"]}
    verdict = judge.equal_within(errors, TOLERANCE)
    check("lora_engine", case, "max rel L2 cuda vs cpu", max(errors.values(), default=float("inf")),
          verdict.ok and len(errors) == gpu["requests"], verdict.note)
    check("lora_engine", case, "pool evictions", gpu["evictions"], gpu["evictions"] >= 1,
          f"{gpu['loads']} loads; budget for two adapters at once")
    check("lora_engine", case, "peak resident bytes / budget", gpu["peak"] / gpu["budget"],
          gpu["peak"] <= gpu["budget"], f"{gpu['peak']} of {gpu['budget']} bytes by the pool's count")
    check("lora_engine", case, "bytes held beyond the pool's count", gpu["uncounted"], gpu["uncounted"] <= 0,
          "factors, stacks and tables the layers really held, at every step")
    check("lora_engine", case, "layouts seen (LoCon loads and evictions)", gpu["versions"], gpu["versions"] >= 2,
          f"{gpu['graph_evictions']} graphs dropped at layout changes or the limit")
    verdict = judge.graph_replays(gpu["graphs"], gpu["replays"], gpu["replays_at_start"], gpu["calls"])
    check("lora_engine", case, "graphs replayed across layout changes", gpu["graphs"], verdict.ok, verdict.note)
    row("lora_engine", "cuda + cpu runs", "wall s", time.perf_counter() - t0)
