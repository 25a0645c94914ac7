"""Step caches decided per request inside one batched transformer call.

diffusers' cache hooks (`apply_first_block_cache`, `apply_mag_cache`,
`apply_taylorseer_cache`) decide for a whole call: one state, one decision, the mean over
the whole batch. In a shared batch every request is at its own step with its own prompt,
so here each request (each *unit*: a request's rows that one pipeline call would hold
together) keeps its own state and decides for itself, exactly as the hook would decide for
that request's pipeline call alone, and the rows that skip work drop out of the call:

* `first_block`: the first block runs on every row; a unit whose first-block residual
  barely moved since its last full pass reuses its cached tail residual; only the other
  rows are gathered through the remaining blocks and scattered back.
* `mag`: a unit skips every block on the steps its magnitude-ratio schedule allows
  (decided on the host, from the step alone); its rows take the cached residual.
* `taylorseer`: every attention module predicts its output from Taylor factors on the
  unit's prediction steps; the other rows run the attention.
* `taylorseer` lite (`use_lite_mode`): diffusers skips every block on a prediction step
  and extrapolates `proj_out`, the last thing the transformer computes (the model only
  reshapes its rows after it), so here a unit on a prediction step leaves the call
  altogether and its rows of the output are extrapolated; on the other steps its rows run
  as uncached rows do (`run_call`), and a call with no other cached rows runs as an
  uncached one: through the captured graph, its rows padded to a bucket.

`RowCache` hooks the transformer's blocks and attention modules once (diffusers'
`HookRegistry`, pass-through when no call is bound); the runner binds a `CacheCall`
around each call that has rows with a cache. Rows without one run every block as usual.
"""
from __future__ import annotations

import contextlib
import re
from typing import Callable

import torch
from diffusers.hooks.hooks import ModelHook

from engine.models.cache_units import CacheCall, count_calls

#: the call arguments that carry one leading row per batch row (everything else, such as
#: FLUX's rotary embedding, is shared by all rows)
ROW_ARGUMENTS = ("hidden_states", "encoder_hidden_states", "temb", "encoder_hidden_states_mask", "modulate_index")
#: the name of a lite unit's TaylorSeer state: the transformer's output (diffusers': `proj_out`)
LITE_STATE = "output"
#: the attention modules TaylorSeer predicts by default (diffusers' own patterns)
ATTENTION_PATTERNS = ("^blocks.*attn", "^transformer_blocks.*attn", "^single_transformer_blocks.*attn")


def run_call(call: CacheCall, inputs, run_hooked: Callable, run_plain: Callable,
             bucket: Callable[[int], int] | None = None) -> torch.Tensor:
    """One denoiser call of `inputs` (`call.rows` rows) with its rows' step caches.

    Rows of TaylorSeer Lite units on a prediction step leave the call and take their
    extrapolated output; computing lite units update their factors from their rows of the
    output. The rows left run `run_hooked(inputs, call)` with the other units, or, when
    there are none, `run_plain(inputs)` as uncached rows do (a captured graph: `bucket(k)`
    gives the rows to pad k to, so few shapes are captured). `run_hooked` counts the other
    units' calls; this counts the lite units'."""
    lite = call.units_of("lite_compute", "lite_predict")
    if not lite:
        return run_hooked(inputs, call)
    n = call.rows
    predicted = {r for u in call.units_of("lite_predict") for r in u.rows}
    keep = [r for r in range(n) if r not in predicted]
    others = [u for u in call.units if not u.mode.startswith("lite")]
    kept = None
    if keep and others:
        position = {r: i for i, r in enumerate(keep)}
        for unit in others:  # their rows in the call that runs (only the count is read after it)
            unit.rows = [position[r] for r in unit.rows]
        sub = inputs if len(keep) == n else inputs.select(_index(keep, inputs.sample.device))
        kept = run_hooked(sub, CacheCall(len(keep), others))
    elif keep:
        rows = keep + [keep[-1]] * ((bucket(len(keep)) if bucket else len(keep)) - len(keep))
        sub = inputs if rows == list(range(n)) else inputs.select(_index(rows, inputs.sample.device))
        kept = run_plain(sub)[:len(keep)]
    predictions = []
    for unit in call.units_of("lite_predict"):
        state = unit.state.taylor_state(LITE_STATE)
        state.current_step = unit.state.calls
        predictions.append((unit, state.predict()[0]))
    if len(keep) == n:  # nothing left the call: its output is every row's
        out = kept
    else:
        like = kept if kept is not None else predictions[0][1]
        out = like.new_empty((n, *like.shape[1:]))
        if kept is not None:
            out.index_copy_(0, _index(keep, out.device), kept)
    device = out.device
    for unit, predicted_rows in predictions:
        out.index_copy_(0, _index(unit.rows, device), predicted_rows)
    for unit in call.units_of("lite_compute"):
        state = unit.state.taylor_state(LITE_STATE)
        state.current_step = unit.state.calls
        state.update((out.index_select(0, _index(unit.rows, device)),))
    count_calls(lite)
    return out


def _positions(current: list[int], rows: list[int]) -> list[int]:
    where = {row: i for i, row in enumerate(current)}
    return [where[r] for r in rows]


# ---- the hooks -------------------------------------------------------------------------------

def transformer_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer's blocks in call order, as diffusers' cache hooks find them."""
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS

    return [block for name, child in transformer.named_children()
            if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, torch.nn.ModuleList)
            for block in child]


class RowCache:
    """Per-row step caching on one transformer: hooks on its blocks (first, middle, last)
    and its attention modules, pass-through unless a `CacheCall` is bound."""

    def __init__(self, transformer: torch.nn.Module):
        from diffusers.hooks._helpers import TransformerBlockRegistry

        why = self.supports(transformer)
        if why:
            raise ValueError(why)
        self.transformer = transformer
        blocks = transformer_blocks(transformer)
        self.metadata = [TransformerBlockRegistry.get(type(block)) for block in blocks]
        self.call: CacheCall | None = None
        self._install(blocks)

    @staticmethod
    def supports(transformer) -> str | None:
        """Why this denoiser cannot cache per request, or None."""
        from diffusers.hooks._helpers import TransformerBlockRegistry

        blocks = transformer_blocks(transformer)
        if len(blocks) < 2:
            return f"{type(transformer).__name__} has {len(blocks)} transformer block(s); step caching needs two"
        for block in blocks:
            try:
                TransformerBlockRegistry.get(type(block))
            except ValueError:
                return f"diffusers' cache hooks do not know {type(block).__name__}"
        if getattr(transformer.config, "zero_cond_t", False):  # two timestep rows per batch row
            return f"{type(transformer).__name__} with zero_cond_t: step caches are not served"
        return None

    def _install(self, blocks) -> None:
        from diffusers.hooks.hooks import HookRegistry

        last = len(blocks) - 1
        for index, block in enumerate(blocks):
            role = "head" if index == 0 else "tail" if index == last else "middle"
            HookRegistry.check_if_exists_or_initialize(block).register_hook(
                _BlockHook(self, role, self.metadata[index]), "diffslot_row_cache_block")
        self.attention = []
        for name, module in self.transformer.named_modules():
            if any(re.fullmatch(p, name) for p in ATTENTION_PATTERNS):
                HookRegistry.check_if_exists_or_initialize(module).register_hook(
                    _AttentionHook(self, name), "diffslot_row_cache_attention")
                self.attention.append(name)

    @contextlib.contextmanager
    def bound(self, call: CacheCall, rebind: Callable[[torch.Tensor | None], None] | None = None):
        """The hooks act on `call` for the duration (one denoiser call)."""
        call.rebind = rebind or (lambda index: None)
        self.call = call
        try:
            yield call
        finally:
            self.call = None
            call.rebind(None)
        call.decided()


def _rows_of(kwargs: dict, index: torch.Tensor, rows: int, names=ROW_ARGUMENTS) -> dict:
    """`kwargs` with its per-row arguments (a leading dimension of `rows`) at `index`'s rows."""
    out = dict(kwargs)
    for name in names:
        value = out.get(name)
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
            out[name] = value.index_select(0, index)
    return out


def _fit_text(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """A text-stream tensor (rows × tokens × width) cut or zero-padded to `length` tokens:
    the tokens past a row's own text are padding, which the attention masks and nothing reads."""
    have = tensor.shape[1]
    if have == length:
        return tensor
    if have > length:
        return tensor[:, :length]
    return torch.nn.functional.pad(tensor, (0, 0, 0, length - have))


def _split(output, meta) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(output, tuple):
        encoder = None if meta.return_encoder_hidden_states_index is None else \
            output[meta.return_encoder_hidden_states_index]
        return output[meta.return_hidden_states_index], encoder
    return output, None


def _join(hidden, encoder, meta, like):
    if not isinstance(like, tuple):
        return hidden
    out = [None] * len(like)
    out[meta.return_hidden_states_index] = hidden
    if meta.return_encoder_hidden_states_index is not None:
        out[meta.return_encoder_hidden_states_index] = encoder
    return tuple(out)


def _index(rows: list[int], device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


class _BlockHook(ModelHook):
    """First block: runs on every row that does not skip all blocks, decides first-block
    hits, and hands only the rows that still compute to the next block. Middle blocks: run
    on those rows. Last block: scatters everything back to every row of the call."""

    def __init__(self, cache: RowCache, role: str, meta):
        super().__init__()
        self.cache, self.role, self.meta = cache, role, meta
        self.returns_encoder = None  # the last block's: learnt the first time it runs

    def new_forward(self, module, *args, **kwargs):
        call = self.cache.call
        original = self.fn_ref.original_forward
        if call is None or not call.block_caching:
            return original(*args, **kwargs)
        if args:  # the transformers call their blocks by keyword; a positional call is bound here
            import inspect

            names = list(inspect.signature(type(module).forward).parameters)[1:]
            kwargs = {**dict(zip(names, args)), **kwargs}
        if self.role == "head":
            return self._head(call, original, kwargs)
        if self.role == "middle":
            return kwargs_passthrough(kwargs, self.meta) if call.skip_tail else \
                original(**self._gathered(call, kwargs))
        return self._tail(call, original, kwargs)

    def _gathered(self, call: CacheCall, kwargs: dict) -> dict:
        """The block's per-row arguments for the rows it runs on (the hidden states, outputs of
        the block before, already are)."""
        if len(call.tail) == call.rows:
            return kwargs
        names = [n for n in ROW_ARGUMENTS if n not in ("hidden_states", "encoder_hidden_states")]
        return _rows_of(kwargs, call.tail_index, call.rows, names)

    def _head(self, call: CacheCall, original, kwargs: dict):
        hidden = kwargs["hidden_states"]
        device = hidden.device
        call.head_in = (hidden, kwargs.get("encoder_hidden_states"))
        skip_all = {r for u in call.units_of("mag_skip") for r in u.rows}
        call.head_rows = [r for r in range(call.rows) if r not in skip_all]
        call.current = call.head_rows
        if len(call.head_rows) == call.rows:
            head_kwargs = kwargs
        else:
            index = _index(call.head_rows, device)
            head_kwargs = _rows_of(kwargs, index, call.rows)
            call.rebind(index)
        output = original(**head_kwargs) if call.head_rows else None
        if output is not None:
            out_hidden, out_encoder = _split(output, self.meta)
            call.head_out = (out_hidden, out_encoder)
            residual = out_hidden - head_kwargs["hidden_states"]
            self._decide_first_block(call, residual)
        hit_rows = {r for u in call.units_of("first_block") if u.hit for r in u.rows}
        call.tail = [r for r in call.head_rows if r not in hit_rows]
        call.tail_index = _index(call.tail, device)
        call.skip_tail = not call.tail
        if call.skip_tail:
            return output if output is not None else kwargs_passthrough(kwargs, self.meta)
        if len(call.tail) != len(call.head_rows):
            keep = _index(_positions(call.head_rows, call.tail), device)
            out_hidden, out_encoder = call.head_out
            output = _join(out_hidden.index_select(0, keep),
                           None if out_encoder is None else out_encoder.index_select(0, keep), self.meta, output)
        if len(call.tail) != len(call.head_rows) or len(call.head_rows) != call.rows:
            call.rebind(call.tail_index if len(call.tail) != call.rows else None)
        call.current = call.tail
        return output

    def _decide_first_block(self, call: CacheCall, residual: torch.Tensor) -> None:
        """FBCHeadBlockHook's test per unit: the mean absolute change of the first block's
        residual relative to its previous one (one host read for the whole call)."""
        units = call.units_of("first_block")
        if not units:
            return
        call.fbc_residual = residual
        tests, tested = [], []
        for unit in units:
            previous = unit.state.head_residual
            if previous is None:
                continue
            current = residual.index_select(0, _index(_positions(call.head_rows, unit.rows), residual.device))
            tests.append((current - previous).abs().mean() / previous.abs().mean())
            tested.append(unit)
        if tests:
            diffs = torch.stack(tests).tolist()
            for unit, diff in zip(tested, diffs):
                unit.hit = not diff > unit.state.settings.threshold

    def _tail(self, call: CacheCall, original, kwargs: dict):
        in_hidden, in_encoder = call.head_in
        rows, device = call.rows, in_hidden.device
        out_hidden = out_encoder = None
        if not call.skip_tail:
            output = original(**self._gathered(call, kwargs))
            out_hidden, out_encoder = _split(output, self.meta)
            self.returns_encoder = out_encoder is not None
        like = (None, None) if self.meta.return_encoder_hidden_states_index is not None else None
        # every row's output has the shape of the block's input (the tail ran before any hit)
        hidden = torch.empty_like(in_hidden)
        encoder = torch.empty_like(in_encoder) if in_encoder is not None and self.returns_encoder is not False else None
        if call.tail:
            hidden.index_copy_(0, call.tail_index, out_hidden)
            if encoder is not None:
                encoder.index_copy_(0, call.tail_index, out_encoder)
        for unit in call.units_of("first_block"):
            self._first_block_rows(call, unit, hidden, encoder, out_hidden, out_encoder)
        for unit in call.units_of("mag_compute"):
            index = _index(unit.rows, device)
            unit.state.mag_residual = hidden.index_select(0, index) - in_hidden.index_select(0, index)
        for unit in call.units_of("mag_skip"):
            index = _index(unit.rows, device)
            hidden.index_copy_(0, index, in_hidden.index_select(0, index) + unit.state.mag_residual)
            if encoder is not None:
                encoder.index_copy_(0, index, in_encoder.index_select(0, index))
        call.current = list(range(rows))
        call.rebind(None)
        return _join(hidden, encoder, self.meta, like)

    def _first_block_rows(self, call, unit, hidden, encoder, out_hidden, out_encoder) -> None:
        state, device = unit.state, hidden.device
        index = _index(unit.rows, device)
        head_hidden, head_encoder = call.head_out
        at_head = _index(_positions(call.head_rows, unit.rows), device)
        here_hidden = head_hidden.index_select(0, at_head)
        here_encoder = None if head_encoder is None else head_encoder.index_select(0, at_head)
        if unit.hit:
            hidden.index_copy_(0, index, state.tail_hidden + here_hidden)
            if encoder is not None:
                encoder.index_copy_(0, index, _fit_text(state.tail_encoder, here_encoder.shape[1]) + here_encoder)
            return
        at_tail = _index(_positions(call.tail, unit.rows), device)
        state.head_residual = call.fbc_residual.index_select(0, at_head)
        state.tail_hidden = out_hidden.index_select(0, at_tail) - here_hidden
        state.tail_encoder = None
        if out_encoder is not None and here_encoder is not None:
            residual = out_encoder.index_select(0, at_tail) - here_encoder
            state.tail_encoder = residual if unit.text_length is None else _fit_text(residual, unit.text_length)


def kwargs_passthrough(kwargs: dict, meta):
    """A skipped block's output: its inputs, in its return order."""
    hidden = kwargs["hidden_states"]
    if meta.return_encoder_hidden_states_index is None:
        return hidden
    return _join(hidden, kwargs.get("encoder_hidden_states"), meta, (None, None))


class _AttentionHook(ModelHook):
    """TaylorSeer per row: units on a prediction step take their Taylor prediction; the
    other rows run the attention, and computing TaylorSeer units update their factors."""

    def __init__(self, cache: RowCache, name: str):
        super().__init__()
        self.cache, self.name = cache, name

    def new_forward(self, module, *args, **kwargs):
        call = self.cache.call
        original = self.fn_ref.original_forward
        if call is None or not call.has_taylor:
            return original(*args, **kwargs)
        computing = [u for u in call.units_of("taylor_compute") if u.rows[0] in set(call.current)]
        predicting = [u for u in call.units_of("taylor_predict") if u.rows[0] in set(call.current)]
        if not computing and not predicting:
            return original(*args, **kwargs)
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        device = hidden.device
        predicted_rows = {r for u in predicting for r in u.rows}
        run_rows = [r for r in call.current if r not in predicted_rows]
        if not predicting:
            output = original(*args, **kwargs)
            outputs = (output,) if isinstance(output, torch.Tensor) else tuple(output)
            run_positions = None
        else:
            if args:
                kwargs = {"hidden_states": args[0], **kwargs}
            outputs = None
            output = None
            if run_rows:
                index = _index(_positions(call.current, run_rows), device)
                sub = _rows_of(kwargs, index, len(call.current))
                call.rebind(_index(run_rows, device))
                output = original(**sub)
                call.rebind(None if len(call.current) == call.rows else _index(call.current, device))
                outputs = (output,) if isinstance(output, torch.Tensor) else tuple(output)
            run_positions = run_rows
        # a joint attention returns (image, text): the text part is kept at the unit's own length
        text_output = 1 if kwargs.get("encoder_hidden_states") is not None and len(outputs or ()) == 2 else None
        for unit in computing:
            state = unit.state.taylor_state(self.name)
            where = _positions(call.current if run_positions is None else run_rows, unit.rows)
            index = _index(where, device)
            state.current_step = unit.state.calls
            mine = [o.index_select(0, index) for o in outputs]
            if text_output is not None and unit.text_length is not None:
                mine[text_output] = _fit_text(mine[text_output], unit.text_length)
            state.update(tuple(mine))
        if not predicting:
            return output
        predictions = []
        text_now = kwargs["encoder_hidden_states"].shape[1] if kwargs.get("encoder_hidden_states") is not None \
            else None
        for unit in predicting:
            state = unit.state.taylor_state(self.name)
            state.current_step = unit.state.calls
            predicted = state.predict()
            if text_now is not None and len(predicted) == 2:
                predicted[1] = _fit_text(predicted[1], text_now)
            predictions.append((unit, predicted))
        template = outputs if outputs is not None else predictions[0][1]
        full = [torch.empty((len(call.current), *t.shape[1:]), dtype=t.dtype, device=device) for t in template]
        if run_rows:
            index = _index(_positions(call.current, run_rows), device)
            for f, o in zip(full, outputs):
                f.index_copy_(0, index, o)
        for unit, predicted in predictions:
            index = _index(_positions(call.current, unit.rows), device)
            for f, p in zip(full, predicted):
                f.index_copy_(0, index, p)
        return full[0] if len(full) == 1 else tuple(full)
