"""The oracle for step caches: diffusers' own cache hook on the folder's pipeline, for one
request alone (`apply_first_block_cache`, `apply_mag_cache`, `apply_taylorseer_cache`
with their configs), and the pattern of transformer calls it skipped.

FLUX's and Qwen-Image's pipelines wrap each transformer call in a cache context ("cond",
and "uncond" for true CFG), which the hooks need; a pipeline that does not (SD3 in diffusers
0.42) gets its transformer calls wrapped in one context as FLUX's pipeline does. The hooks are removed
afterwards, so the shared pipeline object serves other oracles as before."""
from __future__ import annotations

import contextlib


from engine.core.input_kinds.step_cache import resolve
from engine.models.step_cache import transformer_blocks
from engine.testing.pipeline_oracle import load_pipeline, pipeline_output_of

HOOK_NAMES = ("fbc_leader_block_hook", "fbc_block_hook", "mag_cache_leader_block_hook", "mag_cache_block_hook",
              "taylorseer_cache")


def diffusers_config(cache, steps: int, model_ratios=None):
    """The diffusers config the engine's settings for `cache` stand for."""
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    s = resolve(cache, steps, model_ratios)
    if s.kind == "first_block":
        return FirstBlockCacheConfig(threshold=s.threshold)
    if s.kind == "mag":
        return MagCacheConfig(threshold=s.threshold, max_skip_steps=s.max_skip_steps,
                              retention_ratio=s.retention_ratio, num_inference_steps=steps,
                              mag_ratios=s.mag_ratios.clone())
    return TaylorSeerCacheConfig(cache_interval=s.cache_interval, disable_cache_before_step=s.disable_cache_before_step,
                                 disable_cache_after_step=s.disable_cache_after_step, max_order=s.max_order,
                                 taylor_factors_dtype=s.taylor_factors_dtype, use_lite_mode=s.lite)


@contextlib.contextmanager
def hooked(transformer, config, pattern: list):
    """`transformer` with diffusers' hook for `config`; `pattern` gets one entry per
    transformer call: True where the call skipped its cached part."""
    from diffusers.hooks import (FirstBlockCacheConfig, HookRegistry, MagCacheConfig, apply_first_block_cache,
                                 apply_mag_cache, apply_taylorseer_cache)

    last = transformer_blocks(transformer)[-1]
    if getattr(last, "context_pre_only", False):
        # SD3's last block returns no text stream, and FBC's tail hook subtracts it (a
        # TypeError in diffusers 0.42): hand the hook the block's text input instead, which
        # nothing after the last block reads
        block_forward = last.forward

        def with_text(*args, **kwargs):
            encoder, hidden = block_forward(*args, **kwargs)
            return (kwargs["encoder_hidden_states"] if encoder is None else encoder), hidden
        last.forward = with_text
    if isinstance(config, FirstBlockCacheConfig):
        apply_first_block_cache(transformer, config)
    elif isinstance(config, MagCacheConfig):
        apply_mag_cache(transformer, config)
    else:
        apply_taylorseer_cache(transformer, config)
    # the root registry caches its children's registries on first use: new hooks must be seen
    HookRegistry.check_if_exists_or_initialize(transformer)._child_registries_cache = None
    if isinstance(config, (FirstBlockCacheConfig, MagCacheConfig)):
        probe = list(last.modules())[-1]  # runs only when the last block computes
    else:
        probe = next(m for name, m in transformer.named_modules() if name.endswith("attn")).to_q
    handles = [transformer.register_forward_pre_hook(lambda module, args: pattern.append(True)),
               probe.register_forward_hook(lambda module, args, out: pattern.__setitem__(-1, False))]
    forward = transformer.forward
    # the pipelines that do not wrap their transformer calls in cache contexts (diffusers 0.42)
    pipeline_sets_context = not type(transformer).__name__.startswith("SD3")
    if not pipeline_sets_context:
        def in_context(*args, **kwargs):
            with transformer.cache_context("cond"):
                return forward(*args, **kwargs)
        transformer.forward = in_context
    try:
        yield pattern
    finally:
        for handle in handles:
            handle.remove()
        if not pipeline_sets_context:
            del transformer.forward
        registry = HookRegistry.check_if_exists_or_initialize(transformer)
        for name in HOOK_NAMES:
            registry.remove_hook(name, recurse=True)
        if "forward" in vars(last):
            del last.forward


def cached_pipeline_output(folder, params, model_ratios=None, lora_dir=None, run=None):
    """(latents C×h×w, skipped per transformer call) of the pipeline with `params.cache`
    (and, with `lora_dir`, with its adapters as diffusers loads them; with `run`, that call
    of the folder's shared pipeline object instead of `pipeline_output_of`)."""
    if run is not None:
        pipe = load_pipeline(str(folder))
    elif lora_dir is not None:
        from engine.testing.loras import lora_pipeline, lora_pipeline_output

        pipe = lora_pipeline(str(folder), str(lora_dir))
        run = lambda: lora_pipeline_output(folder, lora_dir, params)  # noqa: E731
    else:
        pipe = load_pipeline(str(folder))
        run = lambda: pipeline_output_of(folder, params)  # noqa: E731
    if not hasattr(pipe.transformer, "cache_context"):
        from diffusers.models.cache_utils import CacheMixin

        pipe.transformer.cache_context = CacheMixin.cache_context.__get__(pipe.transformer)
    pattern: list = []
    with hooked(pipe.transformer, diffusers_config(params.cache, params.steps, model_ratios), pattern):
        latents = run()
    return latents, pattern
