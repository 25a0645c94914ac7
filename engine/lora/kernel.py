"""Per-row LoRA in one batched call: `out[r] += Σ_k scale[r,k] · B_a (A_a · x[r])`, a = index[r,k].

Shapes. `x` is rows × tokens × in (the batch row first: attention and feed-forward linears
see rows × sequence × features, a 1×1 conv rows × (h·w) × channels as a strided view),
`out` rows × tokens × out. `index` is rows × K int32 pool slots (-1: none), `scale` rows × K
float32. A layer's adapters live in a `SlotWeights`: per slot its own A (rank × in) and
B (out × rank) at the adapter's own rank (no padding in memory), the layer scaling
(lora_alpha / r, as peft's) and device tables of their addresses and ranks for the kernel.
A slot whose adapter does not target this layer has rank 0 there and costs nothing.

Two implementations of one function:

* `add_lora_reference` (torch): the CPU path and the oracle. The call's entries (row,
  slot, scale) are prepared once per denoiser call (`RowGroups`) and shared by every layer;
  a layer gathers each entry's factors from its padded stack (BGMV's gather), gathers the
  entries' rows of x, and does one batched shrink and one batched expand, index-added into
  `out`: a fixed handful of ops whatever the number of adapters (on CPU, and on a small
  model above all, the op count is the cost). Rows with no adapter are never touched; a
  call whose every row has exactly one adapter skips the gather and adds in place.
* `add_lora_triton`: the same as two kernels, as Punica's SGMV. *Shrink*: one program per
  (entry, token block, rank block), entries ordered by adapter so programs sharing an
  adapter's A run together; V[entry] = x[row] @ Aᵀ, rounded to the weights' dtype (as
  peft's `lora_A(x)`), over the adapter's own rank. *Expand*: one program per (row, token
  block, out block) adds its row's K entries in order, each `(V @ Bᵀ) · scale` rounded as
  peft rounds `lora_B(lora_A(x)) * scaling` and then the sum, into `out` in place (no
  atomics: a row's adapters meet in one program). Entries with slot -1 or rank 0 exit at
  once; a row with no adapter loads its K index entries and nothing else.

Rank tiling. Both kernels walk the rank in blocks of `RANK_BLOCK` (the shrink as a grid
dimension, the expand as a loop bounded by each adapter's own rank read from the device
table), so the compiled kernels and their shared memory and registers do not depend on
any adapter's rank: any rank runs, and a new adapter never recompiles. Only the scratch V
is as wide as the layer's largest resident rank (rounded up to a block), or, inside a
CUDA-graph capture, as the layer's rank limit, so a graph stays valid whatever the pool
loads or evicts later.

Ragged ranks: the kernel reads each adapter at its own rank (nothing padded in memory);
the reference pads to the layer's largest resident rank in a host-side stack built after
each load or eviction (zeros cost a little compute).

Dispatch (`add_lora_`): the Triton kernel on CUDA, the reference on CPU. Conv layers of
kernel > 1 (LoCon's 3×3) have two torch versions: a conv per adapter where the call's
adapters are known on the host (CPU), and, on CUDA, one grouped conv over every (row, k)
entry against a stacked copy of the layer's adapters, which needs no host sync and can be
captured in a graph.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # platforms without a triton wheel still run the CPU path
    triton = None


#: The kernels' rank tile (tl.dot's minimum is 16): fixed, so no adapter's rank changes
#: what is compiled. 32 keeps the shrink's accumulator and the expand's operand tiles small
#: enough for registers at every dtype on sm_90.
RANK_BLOCK = 32

#: Launch options of both kernels: with 4 warps, ptxas spills registers (sm_90, every dtype).
LAUNCH_OPTIONS = {"num_warps": 8}

#: The largest adapter rank a layer takes unless told otherwise.
DEFAULT_RANK_LIMIT = 256


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class SlotWeights:
    """One layer's adapters, by pool slot: A (rank × in [× kh × kw]), B (out × rank), the
    layer scaling, and (on CUDA from the start, elsewhere on first use) the device tables
    the kernel reads. `rank_limit`: the largest rank `put` takes (what a graph-captured
    call sizes its scratch for)."""

    def __init__(self, capacity: int, in_features: int, out_features: int, device: torch.device,
                 dtype: torch.dtype, kernel_size: tuple[int, int] = (1, 1), rank_limit: int = DEFAULT_RANK_LIMIT):
        if rank_limit < 1:
            raise ValueError(f"rank_limit must be at least 1, not {rank_limit}")
        self.capacity, self.in_features, self.out_features = capacity, in_features, out_features
        self.device, self.dtype, self.kernel_size = torch.device(device), dtype, tuple(kernel_size)
        self.rank_limit = int(rank_limit)
        # bytes of one rank of one slot's factors (A's row and B's column), for `footprint`
        self._rank_bytes = (in_features * self.kernel_size[0] * self.kernel_size[1] + out_features) * \
            torch.empty((), dtype=dtype).element_size()
        self.A: list[torch.Tensor | None] = [None] * capacity
        self.B: list[torch.Tensor | None] = [None] * capacity
        self.scaling = [0.0] * capacity
        self.rank = [0] * capacity
        self.max_rank = 0  # over resident slots; 0: no adapter targets this layer now
        self._tables = None  # (a_ptrs int64, b_ptrs int64, ranks int32, scalings float32) on device
        self._stack = None  # the reference's padded stack, rebuilt after a change
        if self.device.type == "cuda" and self.is_pointwise:
            # made now, not at a first call that may be inside a graph capture (where the
            # host-to-device copy of a new table cannot run)
            self.tables()

    @property
    def is_pointwise(self) -> bool:
        """A Linear or a 1×1 conv: a matmul over features, the kernel's case."""
        return self.kernel_size == (1, 1)

    def put(self, slot: int, A: torch.Tensor, B: torch.Tensor, scaling: float) -> None:
        rank = int(A.shape[0])
        if rank > self.rank_limit:
            raise ValueError(f"LoRA rank {rank} is above this layer's limit of {self.rank_limit}")
        if self.is_pointwise and A.dim() == 4:  # a 1×1 conv's factors are matrices
            A = A.reshape(rank, -1)
        B = B.reshape(B.shape[0], -1)
        want_a = (rank, self.in_features, *self.kernel_size) if not self.is_pointwise else (rank, self.in_features)
        if tuple(A.shape) != want_a or tuple(B.shape) != (self.out_features, rank):
            raise ValueError(f"LoRA factors {tuple(A.shape)} / {tuple(B.shape)} do not fit a layer "
                             f"{self.in_features} → {self.out_features} (kernel {self.kernel_size})")
        self.A[slot] = A.to(self.device, self.dtype).contiguous()
        self.B[slot] = B.to(self.device, self.dtype).contiguous()
        self.scaling[slot], self.rank[slot] = float(scaling), rank
        self._changed(slot)

    def clear(self, slot: int) -> None:
        if self.A[slot] is None:
            return
        self.A[slot] = self.B[slot] = None
        self.scaling[slot], self.rank[slot] = 0.0, 0
        self._changed(slot)

    def _changed(self, slot: int) -> None:
        self.max_rank = max(self.rank)
        self._stack = None
        if self._tables is not None:  # keep the device tables in step: fills, no host copy, no sync
            # (an indexed assignment of a Python number goes through a host tensor and a copy)
            a, b, r, s = self._tables
            a[slot].fill_(0 if self.A[slot] is None else self.A[slot].data_ptr())
            b[slot].fill_(0 if self.B[slot] is None else self.B[slot].data_ptr())
            r[slot].fill_(self.rank[slot])
            s[slot].fill_(self.scaling[slot])

    def tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Device tables of A and B addresses, ranks and scalings, by slot (built once,
        then updated in place, so a captured graph keeps reading the current ones)."""
        if self._tables is None:
            ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
            self._tables = (torch.tensor([ptr(a) for a in self.A], dtype=torch.int64, device=self.device),
                            torch.tensor([ptr(b) for b in self.B], dtype=torch.int64, device=self.device),
                            torch.tensor(self.rank, dtype=torch.int32, device=self.device),
                            torch.tensor(self.scaling, dtype=torch.float32, device=self.device))
        return self._tables

    def scratch_rank(self, capturing: bool = False) -> int:
        """The width of the kernel's scratch V: the largest resident rank rounded up to the
        rank tile, or, in a graph capture, the rank limit's (the graph must hold whatever
        is loaded after it)."""
        return _round_up(self.rank_limit if capturing else max(self.max_rank, 1), RANK_BLOCK)

    def reference_stack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(Aᵀ stack: slots × in × rank, Bᵀ stack: slots × rank × out, scalings: slots) for
        the reference, indexed by slot up to the highest one resident in this layer (the
        pool hands out the lowest free slot, so it stays compact), then one zero row that
        every higher slot reads (`RowGroups.slots_below`); zero-padded to the layer's largest
        resident rank, zeros for slots that do not target this layer. A k×k conv's Aᵀ stack
        is slots × rank × in × kh × kw instead. Built on first use after a load or an
        eviction; the price of the reference's fixed op count is this padded copy (about
        the adapters' bytes again); the kernel never builds it."""
        if self._stack is None:
            resident = [s for s in range(self.capacity) if self.A[s] is not None]
            slots, rank = (max(resident) + 2 if resident else 1), self.max_rank
            kw = dict(dtype=self.dtype, device=self.device)
            if self.is_pointwise:
                stacked_A = torch.zeros(slots, self.in_features, rank, **kw)
            else:
                stacked_A = torch.zeros(slots, rank, self.in_features, *self.kernel_size, **kw)
            stacked_Bt = torch.zeros(slots, rank, self.out_features, **kw)
            scalings = torch.zeros(slots, dtype=torch.float32)
            for slot in resident:
                r = self.rank[slot]
                if self.is_pointwise:
                    stacked_A[slot, :, :r] = self.A[slot].t()
                else:
                    stacked_A[slot, :r] = self.A[slot]
                stacked_Bt[slot, :r] = self.B[slot].t()
                scalings[slot] = self.scaling[slot]
            if self.device.type == "cuda":  # page-locked, so the copy does not wait for the stream
                scalings = scalings.pin_memory().to(self.device, non_blocking=True)
            self._stack = (stacked_A, stacked_Bt, scalings)
        return self._stack

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.A + self.B if t is not None)

    @property
    def uses_stack(self) -> bool:
        """Whether calls through this layer build the padded reference stack: every layer
        on the reference path (CPU), and k×k convs on CUDA (the kernel reads the factors
        where they are)."""
        return not (self.is_pointwise and self.device.type == "cuda" and triton is not None)

    def footprint(self, ranks: dict[int, int]) -> int:
        """Bytes this layer holds with adapters of these ranks (by slot) resident: their
        factors and, where the layer uses one, the padded reference stack as
        `reference_stack` builds it (the device tables aside: `table_bytes`)."""
        if not ranks:
            return 0
        total = sum(ranks.values()) * self._rank_bytes
        if self.uses_stack:
            slots = max(ranks) + 2  # up to the highest slot, then the zero row
            total += slots * max(ranks.values()) * self._rank_bytes + slots * 4  # Aᵀ and Bᵀ stacks, scalings
        return total

    @property
    def table_bytes(self) -> int:
        """The device tables' bytes (made once, whatever is resident)."""
        return 0 if self._tables is None else sum(t.numel() * t.element_size() for t in self._tables)

    @property
    def held_bytes(self) -> int:
        """What this layer's adapters really hold now: factors, the stack if built, tables."""
        stack = 0 if self._stack is None else sum(t.numel() * t.element_size() for t in self._stack)
        return self.nbytes + stack + self.table_bytes


@dataclasses.dataclass
class AdapterGroup:
    """The entries of one call that use one pool slot: their rows and per-entry scales."""

    slot: int
    rows: torch.Tensor  # int64 on the call's device
    scales: torch.Tensor  # float32, one per row
    all_rows: bool  # rows == 0..n-1 in order: no gather, no scatter needed


@dataclasses.dataclass
class RowGroups:
    """One denoiser call's adapter rows, prepared once and read by every wrapped layer.

    `index`/`scale`: rows × K (int32 / float32, contiguous, on the call's device).
    For the reference: the call's entries (row, slot, scale), one per (row, k) with a slot,
    and `identity` when they are exactly rows 0..n-1 in order (one adapter a row, every
    row: no gather of x, the expand adds straight into `out`). For the kernel: `order`,
    the entries sorted by slot with the -1 entries last, built on the device (no sync)."""

    rows: int
    index: torch.Tensor
    scale: torch.Tensor
    entry_rows: torch.Tensor | None = None
    entry_slots: torch.Tensor | None = None
    entry_scales: torch.Tensor | None = None
    identity: bool = False
    order: torch.Tensor | None = None

    @property
    def width(self) -> int:
        return int(self.index.shape[1])

    @classmethod
    def build(cls, index: torch.Tensor, scale: torch.Tensor, for_kernel: bool | None = None) -> "RowGroups | None":
        """None when no row has an adapter (known without a sync on CPU only)."""
        if index.dim() == 1:
            index, scale = index[:, None], scale[:, None]
        if index.shape != scale.shape or index.dim() != 2:
            raise ValueError(f"lora_index {tuple(index.shape)} and lora_scale {tuple(scale.shape)} "
                             "must both be rows × K")
        index = index.to(torch.int32).contiguous()
        scale = scale.to(torch.float32).contiguous()
        rows = int(index.shape[0])
        for_kernel = index.is_cuda and triton is not None if for_kernel is None else for_kernel
        if for_kernel:
            flat = index.reshape(-1)
            key = torch.where(flat < 0, torch.iinfo(torch.int32).max, flat)
            order = torch.argsort(key, stable=True).to(torch.int32)
            return cls(rows, index, scale, order=order)
        groups = cls(rows, index, scale)
        groups._entries()
        return None if groups.entry_rows.numel() == 0 else groups

    def _entries(self) -> None:
        """The reference's entries (on CUDA only if a k×k conv asks for them: a host sync)."""
        if self.entry_rows is not None:
            return
        row_of, k_of = (self.index >= 0).nonzero(as_tuple=True)
        self.__dict__["_entry_k"] = k_of
        self.entry_rows, self.entry_slots = row_of, self.index[row_of, k_of].long()
        self.entry_scales = self.scale[row_of, k_of]
        self.identity = row_of.numel() == self.rows and bool(
            (row_of == torch.arange(self.rows, device=row_of.device)).all())

    def column_splits(self) -> list[torch.Tensor] | None:
        """The reference's entries split by k (positions into the entries), so that a row's
        adapters are added one at a time; None when no row has more than one (made once)."""
        if "_columns" not in self.__dict__:
            self._entries()
            k_of = self.__dict__["_entry_k"]
            counts = torch.bincount(self.entry_rows, minlength=self.rows)
            self.__dict__["_columns"] = None if counts.numel() == 0 or int(counts.max()) <= 1 else [
                (k_of == k).nonzero(as_tuple=True)[0] for k in range(self.width) if bool((k_of == k).any())]
        return self.__dict__["_columns"]

    def dense_entries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every (row, k) as an entry, -1 ones included: (rows, slots, scales), flat, on the
        call's device, made with no host sync (the k×k conv path on CUDA); made once."""
        cache = self.__dict__.get("_dense")
        if cache is None:
            width = self.width
            rows = torch.arange(self.rows, device=self.index.device).repeat_interleave(width)
            cache = self.__dict__["_dense"] = (rows, self.index.reshape(-1).long(), self.scale.reshape(-1))
        return cache

    def slots_below(self, zero_row: int) -> torch.Tensor:
        """The entries' slots, those ≥ `zero_row` sent to it (a stack's zero row); made once
        per call and stack height (layers mostly share one)."""
        cache = self.__dict__.setdefault("_slots_below", {})
        slots = cache.get(zero_row)
        if slots is None:
            self._entries()
            slots = cache[zero_row] = self.entry_slots.clamp(max=zero_row)
        return slots

    @functools.cached_property
    def groups(self) -> list[AdapterGroup]:
        """The entries grouped by slot (the k×k conv path: one conv per adapter)."""
        self._entries()
        out = []
        for slot in torch.unique(self.entry_slots).tolist():
            pick = self.entry_slots == slot
            rows = self.entry_rows[pick]
            all_rows = rows.numel() == self.rows and bool((rows == torch.arange(self.rows, device=rows.device)).all())
            out.append(AdapterGroup(slot, rows, self.entry_scales[pick], all_rows))
        return out


def _check_operands(out: torch.Tensor, x: torch.Tensor, weights: SlotWeights, groups: RowGroups) -> None:
    if x.dim() != 3 or out.dim() != 3 or x.shape[:2] != out.shape[:2]:
        raise ValueError(f"lora: x {tuple(x.shape)} and out {tuple(out.shape)} must be rows × tokens × features")
    if x.shape[2] != weights.in_features or out.shape[2] != weights.out_features:
        raise ValueError(f"lora: x {tuple(x.shape)} / out {tuple(out.shape)} do not fit a layer "
                         f"{weights.in_features} → {weights.out_features}")
    if x.shape[0] != groups.rows:
        raise ValueError(f"lora: the layer sees {x.shape[0]} rows, the call bound adapters for {groups.rows} "
                         "(a layer that folds the batch into another dimension cannot take per-row adapters)")


def _entry_scales(entry_scales: torch.Tensor, slots: torch.Tensor, scalings: torch.Tensor) -> torch.Tensor:
    """Each entry's scale times its adapter's layer scaling (peft's `scaling`: the adapter
    weight × lora_alpha / r), float32, as an entries × 1 × 1 column."""
    return (entry_scales * scalings.index_select(0, slots))[:, None, None]


def _scaled(delta: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`delta * scaling` as peft computes `lora_B(lora_A(x)) * scaling`: the product
    rounded once to delta's dtype."""
    if delta.dtype == torch.float32:
        return delta.mul_(scales)
    return (delta.float() * scales).to(delta.dtype)


def add_lora_reference(out: torch.Tensor, x: torch.Tensor, weights: SlotWeights, groups: RowGroups) -> None:
    """out[r] += Σ_k round(round(B_a (A_a x[r])) · scale[r,k] · scaling_a), in place, in x's
    dtype, each entry added in its order (peft's rounding, adapter by adapter).

    A fixed handful of ops whatever the number of adapters in the call (on a small model
    the op count is the cost): each entry gathers its adapter's factors from the layer's
    padded stack (BGMV's gather), then one batched shrink and one batched expand."""
    _check_operands(out, x, weights, groups)
    if weights.max_rank == 0:
        return
    groups._entries()
    stacked_At, stacked_Bt, scalings = weights.reference_stack()
    slots = groups.slots_below(stacked_At.shape[0] - 1)
    At = stacked_At.index_select(0, slots)  # entries × in × rank
    Bt = stacked_Bt.index_select(0, slots)  # entries × rank × out
    scales = _entry_scales(groups.entry_scales, slots, scalings)
    xe = x if groups.identity else x.index_select(0, groups.entry_rows)
    v = torch.bmm(xe, At)  # shrink: entries × tokens × rank
    if x.dtype == torch.float32:  # no rounding to follow: the scale where it costs least
        v.mul_(scales)
        if groups.identity:
            out.baddbmm_(v, Bt)  # expand, added in place
        else:
            out.index_add_(0, groups.entry_rows, torch.bmm(v, Bt))
        return
    delta = _scaled(torch.bmm(v, Bt), scales)
    columns = None if groups.identity else groups.column_splits()
    if groups.identity:
        out.add_(delta)
    elif columns is None:
        out.index_add_(0, groups.entry_rows, delta)
    else:  # index_add sums a row's entries before rounding; peft rounds after each adapter
        for picked in columns:
            out.index_add_(0, groups.entry_rows.index_select(0, picked), delta.index_select(0, picked))


def add_lora_conv_reference(out: torch.Tensor, x: torch.Tensor, weights: SlotWeights, groups: RowGroups,
                            stride, padding, dilation) -> None:
    """The same for a conv of any kernel (peft's conv LoRA: A is a conv with the base kernel,
    stride and padding, B a 1×1 conv): x rows × in × h × w, out rows × out × h' × w'. On
    CPU a conv per adapter in the call; on CUDA `add_lora_conv_gathered` (no host sync)."""
    if x.shape[0] != groups.rows:
        raise ValueError(f"lora: the conv sees {x.shape[0]} rows, the call bound adapters for {groups.rows}")
    if weights.max_rank == 0:
        return
    if x.is_cuda:
        add_lora_conv_gathered(out, x, weights, groups, stride, padding, dilation)
        return
    conv_shape = (weights.in_features, *weights.kernel_size)
    for g in groups.groups:
        A, B = weights.A[g.slot], weights.B[g.slot]
        if A is None:
            continue
        xa = x if g.all_rows else x.index_select(0, g.rows)
        v = F.conv2d(xa, A.reshape(A.shape[0], *conv_shape), None, stride, padding, dilation)
        delta = _scaled(torch.einsum("nrhw,or->nohw", v, B),
                        (g.scales * weights.scaling[g.slot])[:, None, None, None])
        if g.all_rows:
            out.add_(delta)
        else:
            out.index_add_(0, g.rows, delta)


def add_lora_conv_gathered(out: torch.Tensor, x: torch.Tensor, weights: SlotWeights, groups: RowGroups,
                           stride, padding, dilation) -> None:
    """A conv layer's deltas with no host sync: every (row, k) entry (-1 ones reading the
    stack's zero row) in one grouped conv against the entries' stacked A, one batched
    matmul with their B, one index_add into `out`. The op count and shapes depend only on
    the call's rows and K, so it runs inside a graph capture."""
    stacked_A, stacked_Bt, scalings = weights.reference_stack()
    zero_row = stacked_A.shape[0] - 1
    rows, slots, entry_scales = groups.dense_entries()
    slots = torch.where(slots < 0, zero_row, slots.clamp(max=zero_row))
    entries, rank = int(slots.shape[0]), stacked_Bt.shape[1]
    A = stacked_A.index_select(0, slots)
    if weights.is_pointwise:  # in × rank matrices: back to rank × in × 1 × 1 convs
        A = A.transpose(1, 2)
    A = A.reshape(entries * rank, weights.in_features, *weights.kernel_size)
    xe = x.index_select(0, rows)
    v = F.conv2d(xe.reshape(1, -1, *x.shape[2:]), A, None, stride, padding, dilation, groups=entries)
    v = v.reshape(entries, rank, -1)  # entries × rank × h'w'
    delta = torch.bmm(stacked_Bt.index_select(0, slots).transpose(1, 2), v)  # entries × out × h'w'
    delta = _scaled(delta, _entry_scales(entry_scales, slots, scalings))
    out.index_add_(0, rows, delta.view(entries, *out.shape[1:]))


if triton is not None:

    @triton.jit
    def _lora_shrink_kernel(x_ptr, v_ptr, index_ptr, order_ptr, a_ptrs, ranks_ptr,
                            tokens, in_features, v_width, sx_row, sx_tok, sx_in,
                            K: tl.constexpr, R_BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr,
                            PRECISION: tl.constexpr):
        # programs in adapter order: neighbours share an adapter's A (in cache)
        e = tl.load(order_ptr + tl.program_id(0))
        slot = tl.load(index_ptr + e)
        if slot >= 0:
            rank = tl.load(ranks_ptr + slot)
            r0 = tl.program_id(2) * R_BLOCK
            if r0 < rank:
                row = (e // K).to(tl.int64)
                a_base = tl.load(a_ptrs + slot).to(x_ptr.dtype)  # A: rank × in, contiguous, x's dtype
                t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
                r = r0 + tl.arange(0, R_BLOCK)
                acc = tl.zeros((BLOCK_T, R_BLOCK), dtype=tl.float32)
                for i0 in range(0, in_features, BLOCK_I):
                    i = i0 + tl.arange(0, BLOCK_I)
                    xt = tl.load(x_ptr + row * sx_row + t[:, None] * sx_tok + i[None, :] * sx_in,
                                 mask=(t[:, None] < tokens) & (i[None, :] < in_features), other=0.0)
                    at = tl.load(a_base + r[None, :].to(tl.int64) * in_features + i[:, None],
                                 mask=(r[None, :] < rank) & (i[:, None] < in_features), other=0.0)
                    acc = tl.dot(xt, at, acc, input_precision=PRECISION)
                # rounded to the weights' dtype, as peft's lora_A(x)
                v_ptrs = v_ptr + (e.to(tl.int64) * tokens + t[:, None]) * v_width + r[None, :]
                tl.store(v_ptrs, acc.to(v_ptr.dtype.element_ty), mask=(t[:, None] < tokens) & (r[None, :] < rank))

    @triton.jit
    def _lora_expand_kernel(out_ptr, v_ptr, index_ptr, scale_ptr, b_ptrs, ranks_ptr, scalings_ptr, tokens,
                            out_features, v_width, so_row, so_tok, so_out,
                            K: tl.constexpr, R_BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_O: tl.constexpr,
                            PRECISION: tl.constexpr):
        row = tl.program_id(0)
        used = row * 0  # adapters of this row (a runtime int, so it can change in the loop)
        for k in range(K):
            slot = tl.load(index_ptr + row * K + k)
            if slot >= 0:
                if tl.load(ranks_ptr + slot) > 0:
                    used += 1
        if used > 0:
            t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
            o = tl.program_id(2) * BLOCK_O + tl.arange(0, BLOCK_O)
            mask = (t[:, None] < tokens) & (o[None, :] < out_features)
            ptrs = out_ptr + row.to(tl.int64) * so_row + t[:, None] * so_tok + o[None, :] * so_out
            current = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            for k in range(K):
                e = row * K + k
                slot = tl.load(index_ptr + e)
                if slot >= 0:
                    rank = tl.load(ranks_ptr + slot)
                    if rank > 0:
                        b_base = tl.load(b_ptrs + slot).to(out_ptr.dtype)  # B: out × rank, contiguous
                        s = tl.load(scale_ptr + e) * tl.load(scalings_ptr + slot)
                        acc = tl.zeros((BLOCK_T, BLOCK_O), dtype=tl.float32)
                        for r0 in range(0, rank, R_BLOCK):
                            r = r0 + tl.arange(0, R_BLOCK)
                            vt = tl.load(v_ptr + (e.to(tl.int64) * tokens + t[:, None]) * v_width + r[None, :],
                                         mask=(t[:, None] < tokens) & (r[None, :] < rank), other=0.0)
                            bt = tl.load(b_base + o[None, :].to(tl.int64) * rank + r[:, None],
                                         mask=(r[:, None] < rank) & (o[None, :] < out_features), other=0.0)
                            acc = tl.dot(vt, bt, acc, input_precision=PRECISION)
                        # peft: result + lora_B(lora_A(x)) * scaling, each step rounded to the dtype
                        term = (acc.to(out_ptr.dtype.element_ty).to(tl.float32) * s).to(out_ptr.dtype.element_ty)
                        current = (current + term.to(tl.float32)).to(out_ptr.dtype.element_ty).to(tl.float32)
            tl.store(ptrs, current.to(out_ptr.dtype.element_ty), mask=mask)


def rank_block(max_rank: int = 0) -> int:
    """The kernels' rank tile, whatever the rank (kept for callers that ask)."""
    return RANK_BLOCK


def capturing(device: torch.device) -> bool:
    """Inside a CUDA-graph capture on `device`'s current stream."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def add_lora_triton(out: torch.Tensor, x: torch.Tensor, weights: SlotWeights, groups: RowGroups,
                    block_t: int = 64, block_i: int = 64, block_o: int = 64) -> None:
    """The kernel version of `add_lora_reference` (Linear or 1×1 conv layers). Inside a
    graph capture it launches even while the layer has no adapter, with scratch for the
    rank limit, so the graph serves whatever the pool holds when it is replayed."""
    _check_operands(out, x, weights, groups)
    if not weights.is_pointwise:
        raise ValueError("lora: the kernel takes Linear and 1×1 conv layers; k×k convs use the reference")
    captured = capturing(out.device)
    if weights.max_rank == 0 and not captured:
        return
    if groups.order is None:
        raise ValueError("lora: these RowGroups were built for the reference (no device entry order)")
    if x.dtype != weights.dtype or out.dtype != weights.dtype:
        raise ValueError(f"lora: x {x.dtype} / out {out.dtype} must be the adapters' dtype {weights.dtype}")
    device = out.device
    for name, t in (("x", x), ("index", groups.index), ("scale", groups.scale)):
        if t.device != device:
            raise ValueError(f"lora: {name} is on {t.device}, out on {device}")
    rows, tokens, _ = x.shape
    if rows == 0 or tokens == 0:
        return
    width = groups.width
    a_ptrs, b_ptrs, ranks, scalings = weights.tables()
    v_width = weights.scratch_rank(captured)
    # fp32 stays fp32 (no TF32), so the kernel matches the reference and the oracle
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    block_t = min(block_t, max(16, triton.next_power_of_2(tokens)))
    v = torch.empty(rows * width, tokens, v_width, dtype=x.dtype, device=device)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _lora_shrink_kernel[(rows * width, triton.cdiv(tokens, block_t), v_width // RANK_BLOCK)](
            x, v, groups.index, groups.order, a_ptrs, ranks,
            tokens, weights.in_features, v_width, x.stride(0), x.stride(1), x.stride(2),
            K=width, R_BLOCK=RANK_BLOCK, BLOCK_T=block_t, BLOCK_I=block_i, PRECISION=precision,
            **LAUNCH_OPTIONS)
        _lora_expand_kernel[(rows, triton.cdiv(tokens, block_t), triton.cdiv(weights.out_features, block_o))](
            out, v, groups.index, groups.scale, b_ptrs, ranks, scalings, tokens, weights.out_features, v_width,
            out.stride(0), out.stride(1), out.stride(2),
            K=width, R_BLOCK=RANK_BLOCK, BLOCK_T=block_t, BLOCK_O=block_o, PRECISION=precision,
            **LAUNCH_OPTIONS)


def add_lora_(out: torch.Tensor, x: torch.Tensor, weights: SlotWeights, groups: RowGroups) -> None:
    """out += the rows' LoRA deltas: the Triton kernel on CUDA, the torch reference on CPU."""
    if out.is_cuda and triton is not None and groups.order is not None:
        add_lora_triton(out, x, weights, groups)
    else:
        add_lora_reference(out, x, weights, groups)


def lora_delta(x: torch.Tensor, weights: SlotWeights, index: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """For each row r: Σ_k scale[r,k] · B[index[r,k]] @ (A[index[r,k]] @ x_r) over the row's
    tokens (x rows × tokens × in → rows × tokens × out); slot -1 adds nothing."""
    out = torch.zeros(*x.shape[:2], weights.out_features, dtype=x.dtype, device=x.device)
    groups = RowGroups.build(index, scale)
    if groups is not None:
        add_lora_(out, x, weights, groups)
    return out
