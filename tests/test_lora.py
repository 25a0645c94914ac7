"""Per-request LoRA (R20): the adapter pool, the per-row layers and the kernel.

Oracles:
* the denoiser: diffusers' own pipeline with `load_lora_weights(..., adapter_name=...)` and
  `set_adapters(names, adapter_weights=scales)`, one row at a time, against one batched
  call of the engine's model whose rows hold different adapters (≤ 1e-5 relative L2);
* the text encoder: the PEFT model the adapter was made from (the LoRA as trained), its
  scales set by diffusers' `set_adapters_for_text_encoder`. (diffusers' `load_lora_weights`
  cannot load text-encoder LoRA here: transformers 5 wants peft ≥ 0.22, the project pins
  0.21; the pool reads it with diffusers' converters and peft directly.)
* the Triton kernel: the torch reference, through the suite's Triton-interpreter worker
  (the `triton_interpreter` fixture; tests/triton_interpreter.py says why a worker), random
  shapes, ragged groups, rank mixes.

LoRAs are made offline with PEFT (`LoraConfig(init_lora_weights=False)`: random non-zero
A and B) for `build_sd`'s tiny folder and written by `save_lora_weights`.
"""
from __future__ import annotations

import math
import pathlib

import pytest
import torch

from engine.lora import AdapterPool, RowGroups, SlotWeights, lora_delta
from engine.lora.kernel import add_lora_reference
from engine.lora.layers import LORA_LAYER_TYPES
from engine.testing.loras import make_lora
from engine.testing.tiny_pipelines import build_sd

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# What each test adapter targets: attention and feed-forward Linears, 1×1 convs (proj_in),
# 3×3 convs (LoCon: resnet conv1), time-embedding projections; mixed ranks and alphas,
# a per-module rank (rank_pattern); C also has text-encoder LoRA.
ADAPTERS = {
    "A": dict(unet=dict(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_in",
                                                          "ff.net.0.proj", "ff.net.2"])),
    "B": dict(unet=dict(r=8, lora_alpha=4, target_modules=["to_k", "to_v", "conv1", "time_emb_proj", "proj_out"],
                        rank_pattern={"^down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_k": 2})),
    "C": dict(unet=dict(r=2, lora_alpha=2, target_modules=["to_q", "to_out.0"]),
              text_encoder=dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "fc1"])),
}


def _make_lora(pipe, name: str, seed: int, spec: dict, where):
    directory, weight_name = where
    return make_lora(pipe, name, seed, spec, directory, weight_name)


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    from diffusers import StableDiffusionPipeline

    root = tmp_path_factory.mktemp("lora")
    folder = build_sd(root / "sd")
    lora_dir = root / "loras"
    lora_dir.mkdir()
    pipe = StableDiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    # A and C as folders (pytorch_lora_weights.safetensors inside), B as a file
    places = {"A": (lora_dir / "A", None), "B": (lora_dir, "B.safetensors"), "C": (lora_dir / "C", None)}
    injected = {name: _make_lora(pipe, name, seed, ADAPTERS[name], places[name])
                for seed, name in enumerate(ADAPTERS, start=1)}
    return dict(folder=folder, lora_dir=lora_dir, pipe=pipe, injected=injected)


@pytest.fixture(scope="module")
def oracle_pipe(lora_setup):
    """The pipeline with every adapter loaded by diffusers (the UNet parts)."""
    pipe, lora_dir = lora_setup["pipe"], lora_setup["lora_dir"]
    pipe.load_lora_weights(lora_dir / "A", adapter_name="A")
    pipe.load_lora_weights(lora_dir, weight_name="B.safetensors", adapter_name="B")
    # C has text-encoder LoRA, which transformers will not load with peft 0.21: the UNet part
    # through diffusers' own `load_lora_into_unet`, from diffusers' own `lora_state_dict`
    state, alphas, metadata = pipe.lora_state_dict(lora_dir / "C", return_lora_metadata=True)
    pipe.load_lora_into_unet(state, alphas, pipe.unet, adapter_name="C", metadata=metadata)
    return pipe


@pytest.fixture(scope="module")
def served(lora_setup):
    """The engine's model of the folder with a pool attached (generous budget)."""
    from engine.models.loading import load_model

    model = load_model(lora_setup["folder"], load_vae=False)
    pool = AdapterPool(model, lora_setup["lora_dir"], budget_bytes=64 << 20)
    return model, pool


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# ---- the denoiser against diffusers' pipeline --------------------------------------------------

#: the issue's batch: no adapter, A at 1.0, A at 0.5, B, A + C at two scales
ROWS = [{}, {"A": 1.0}, {"A": 0.5}, {"B": 1.0}, {"A": 0.7, "C": -1.3}]


def _pipeline_row(pipe, x, t, hidden, loras: dict) -> torch.Tensor:
    if loras:
        pipe.enable_lora()
        pipe.set_adapters(list(loras), adapter_weights=list(loras.values()))
    else:
        pipe.disable_lora()
    return pipe.unet(x[None], t, encoder_hidden_states=hidden[None]).sample[0]


@torch.no_grad()
def test_mixed_batch_rows_equal_pipeline_with_their_adapters(served, oracle_pipe):
    model, pool = served
    names = sorted({n for row in ROWS for n in row})
    slots = dict(zip(names, pool.acquire_waiting(names)))
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(len(ROWS), 4, 8, 8, generator=g)
        t = torch.tensor([999.0, 500.0, 500.0, 20.0, 301.0])
        cond = model.encode(["a red circle", "a blue square", "a blue square", "a green cross", "a red circle"])
        index = torch.full((len(ROWS), pool.max_per_request), -1, dtype=torch.int32)
        scale = torch.zeros(len(ROWS), pool.max_per_request)
        for r, loras in enumerate(ROWS):
            for k, (name, s) in enumerate(loras.items()):
                index[r, k], scale[r, k] = slots[name], s
        out = model.denoise(x, t, cond, lora_index=index, lora_scale=scale)
        base = model.denoise(x, t, cond)
        for r, loras in enumerate(ROWS):
            expected = _pipeline_row(oracle_pipe, x[r], t[r], cond[r].hidden, loras)
            assert _rel(out[r], expected) <= 1e-5, (r, loras, _rel(out[r], expected))
            if loras:  # the adapters really change the output
                assert _rel(base[r], expected) > 1e-2, (r, loras)
            else:
                assert torch.equal(out[r], base[r])
        # a request alone equals its row in the mixed batch (the row never sees its neighbours)
        alone = model.denoise(x[4:5], t[4:5], cond[4:5], lora_index=index[4:5], lora_scale=scale[4:5])
        assert _rel(alone[0], out[4]) <= 1e-5
        # one adapter in every row (the path without gather and scatter), columns permuted
        rows = slice(1, 4)
        one_each = model.denoise(x[rows], t[rows], cond[rows], lora_index=index[rows].flip(1),
                                 lora_scale=scale[rows].flip(1))
        for r in range(3):
            assert _rel(one_each[r], out[1 + r]) <= 1e-5
    finally:
        pool.release(list(slots.values()))


@torch.no_grad()
def test_no_adapters_is_the_base_model_and_weights_are_untouched(served, lora_setup):
    from engine.models.loading import load_model

    model, pool = served
    fresh = load_model(lora_setup["folder"], load_vae=False)
    unet = model.pipe.unet
    wrapped = [m for m in unet.modules() if isinstance(m, LORA_LAYER_TYPES)]
    assert len(wrapped) > 50 and all(isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) for m in wrapped)
    slots = pool.acquire_waiting(["A", "B"])
    try:
        g = torch.Generator().manual_seed(1)
        x, t = torch.randn(3, 4, 8, 8, generator=g), torch.tensor([900.0, 400.0, 50.0])
        cond = model.encode(["a red circle", "", "a blue cross"])
        index = torch.tensor([[slots[0], -1], [slots[1], slots[0]], [-1, -1]], dtype=torch.int32)
        model.denoise(x, t, cond, lora_index=index, lora_scale=torch.ones(3, 2))
        # state_dict keys and values are the base model's: never fused, never modified
        assert unet.state_dict().keys() == fresh.pipe.unet.state_dict().keys()
        for key, value in fresh.pipe.unet.state_dict().items():
            assert torch.equal(unet.state_dict()[key], value), key
        assert torch.equal(model.denoise(x, t, cond), fresh.denoise(x, t, cond))
        all_none = torch.full((3, 2), -1, dtype=torch.int32)
        assert torch.equal(model.denoise(x, t, cond, lora_index=all_none, lora_scale=torch.ones(3, 2)),
                           fresh.denoise(x, t, cond))
    finally:
        pool.release(slots)


# ---- the text encoder ------------------------------------------------------------------------

@torch.no_grad()
def test_text_encoder_lora_in_the_encode_stage(served, lora_setup):
    from diffusers.loaders.lora_base import disable_lora_for_text_encoder, set_adapters_for_text_encoder

    model, pool = served
    assert pool.has_text_encoder("C") and not pool.has_text_encoder("A")
    assert pool.text_encoder_key({"A": 1.0}) == ()
    assert pool.text_encoder_key({"C": 0.5, "A": 1.0}) == (("C", 0.5),)
    assert pool.text_encoder_key(None) == ()
    slots = pool.acquire_waiting(["A", "C"])
    try:
        prompts = ["a red circle", "a blue square", "a red circle", ""]
        loras = [None, {"C": 0.8}, {"A": 1.0, "C": -0.5}, {"C": 1.0}]
        got = pool.encode(prompts, loras)
        plain = model.encode(prompts)
        oracle_te = lora_setup["injected"]["C"]["text_encoder"]
        pipe = lora_setup["pipe"]
        original = pipe.text_encoder
        pipe.text_encoder = oracle_te
        try:
            for prompt, chosen, embedding, base in zip(prompts, loras, got, plain):
                te_scales = {n: s for n, s in (chosen or {}).items() if n == "C"}
                if te_scales:
                    set_adapters_for_text_encoder(list(te_scales), oracle_te, list(te_scales.values()))
                    from diffusers.loaders.lora_base import enable_lora_for_text_encoder
                    enable_lora_for_text_encoder(oracle_te)
                else:
                    disable_lora_for_text_encoder(oracle_te)
                expected = pipe.encode_prompt([prompt], "cpu", 1, False)[0][0]
                assert _rel(embedding.hidden, expected) <= 1e-5, (prompt, chosen)
                if te_scales:
                    assert _rel(base.hidden, expected) > 1e-3
                else:
                    assert torch.equal(embedding.hidden, base.hidden)
        finally:
            pipe.text_encoder = original
        # nothing stays bound after the call
        assert pool.text_rows.current is None
        assert torch.equal(model.encode(prompts)[1].hidden, plain[1].hidden)
    finally:
        pool.release(slots)
    with pytest.raises(ValueError, match="acquired"):
        pool.encode(["a red circle"], [{"C": 1.0}])


# ---- the pool ----------------------------------------------------------------------------------

def test_names_rescan_and_check_reasons(served, lora_setup, tmp_path):
    model, pool = served
    assert pool.names() == ["A", "B", "C"]
    assert pool.check({"A": 1.0, "C": -0.5}) is None
    assert pool.check({}) is None
    reasons = {
        "unknown": pool.check({"Z": 1.0}),
        "nan": pool.check({"A": float("nan")}),
        "inf": pool.check({"A": float("inf")}),
        "large": pool.check({"A": 17.0}),
        "bool": pool.check({"A": True}),
        "type": pool.check({"A": "1"}),
        "many": pool.check({"A": 1, "B": 1, "C": 1, "D": 1, "E": 1}),
        "not a map": pool.check(["A"]),
    }
    assert "unknown adapter 'Z'" in reasons["unknown"] and "'A'" in reasons["unknown"]
    for key in ("nan", "inf", "large"):
        assert "finite and within ±16" in reasons[key], reasons[key]
    assert "number" in reasons["bool"] and "number" in reasons["type"]
    assert "at most 4" in reasons["many"]
    assert "map adapter names" in reasons["not a map"]
    # names are plain names in the folder: nothing outside it is ever looked up
    (tmp_path / "outside.safetensors").write_bytes(b"")
    for name in ("../A", "A/", "/etc/passwd", ".A", "", " A", f"../{tmp_path.name}/outside", "A\0"):
        assert "unknown adapter" in pool.check({name: 1.0}), name

    # a new adapter is found without a restart; a folder and a file of one name are refused
    import shutil

    shutil.copytree(lora_setup["lora_dir"] / "A", lora_setup["lora_dir"] / "A2")
    try:
        assert pool.check({"A2": 1.0}) is None and "A2" in pool.names()
        shutil.copy(lora_setup["lora_dir"] / "B.safetensors", lora_setup["lora_dir"] / "A2.safetensors")
        assert "ambiguous" in pool.check({"A2": 1.0})
    finally:
        shutil.rmtree(lora_setup["lora_dir"] / "A2")
        (lora_setup["lora_dir"] / "A2.safetensors").unlink(missing_ok=True)
    assert pool.names() == ["A", "B", "C"]
    assert "unknown adapter" in pool.check({"A2": 1.0})


def _write_state(path, state: dict, metadata: dict | None = None):
    import json

    import safetensors.torch

    meta = None if metadata is None else {"lora_adapter_metadata": json.dumps(metadata, default=list)}
    safetensors.torch.save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata=meta)


@pytest.fixture
def fresh_model(lora_setup):
    """A model of its own (one pool per model: its slots index every wrapped layer)."""
    from engine.models.loading import load_model

    return load_model(lora_setup["folder"], load_vae=False)


def test_one_pool_per_model(served, lora_setup):
    with pytest.raises(RuntimeError, match="one pool per model"):
        AdapterPool(served[0], lora_setup["lora_dir"], budget_bytes=1 << 20)


def test_check_refuses_what_does_not_fit_the_model(fresh_model, tmp_path):
    from peft import LoraConfig

    model = fresh_model
    bad = tmp_path / "bad"
    bad.mkdir()
    q = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
    conv = "unet.down_blocks.0.resnets.0.conv1"
    _write_state(bad / "missing_module.safetensors",
                 {"unet.down_blocks.7.attentions.0.proj_in.lora_A.weight": torch.randn(4, 32),
                  "unet.down_blocks.7.attentions.0.proj_in.lora_B.weight": torch.randn(32, 4)})
    _write_state(bad / "wrong_shape.safetensors",  # made for a model with 48-wide attention
                 {f"{q}.lora_A.weight": torch.randn(4, 48), f"{q}.lora_B.weight": torch.randn(48, 4)})
    _write_state(bad / "norm_layer.safetensors",
                 {"unet.conv_norm_out.lora_A.weight": torch.randn(4, 32),
                  "unet.conv_norm_out.lora_B.weight": torch.randn(32, 4)})
    dora = LoraConfig(r=4, lora_alpha=4, target_modules=["to_q"], use_dora=True).to_dict()
    dora = {f"unet.{k}": v for k, v in dora.items()}
    _write_state(bad / "dora.safetensors",
                 {f"{q}.lora_A.weight": torch.randn(4, 32), f"{q}.lora_B.weight": torch.randn(32, 4),
                  f"{q}.lora_magnitude_vector": torch.randn(32)}, dora)
    _write_state(bad / "vae_lora.safetensors",
                 {"vae.decoder.conv_in.lora_A.weight": torch.randn(4, 4, 3, 3),
                  "vae.decoder.conv_in.lora_B.weight": torch.randn(64, 4, 1, 1)})
    _write_state(bad / "not_lora.safetensors", {f"{q}.weight": torch.randn(32, 32)})
    (bad / "corrupt.safetensors").write_bytes(b"this is not a safetensors file")
    # a good LoCon (3×3 conv) adapter, written by hand in peft's key format
    _write_state(bad / "locon.safetensors", {f"{conv}.lora_A.weight": torch.randn(2, 32, 3, 3),
                                             f"{conv}.lora_B.weight": torch.randn(32, 2, 1, 1)})
    pool = AdapterPool(model, bad, budget_bytes=1 << 20)
    expect = {
        "missing_module": "lacks",
        "wrong_shape": "do not fit",
        "norm_layer": "GroupNorm",
        "dora": "DoRA",
        "vae_lora": "vae",
        "not_lora": "not a LoRA",
        "corrupt": "cannot be read",
    }
    for name, words in expect.items():
        reason = pool.check({name: 1.0})
        assert reason is not None and words in reason, (name, reason)
        with pytest.raises(ValueError):
            pool.acquire_waiting([name])
    assert pool.check({"locon": 1.0}) is None
    pool.budget_bytes = pool.nbytes(["locon"]) - 1
    assert "holds" in pool.check({"locon": 1.0})
    with pytest.raises(ValueError, match="can never be resident"):  # not a wait that never ends
        pool.acquire(["locon"])
    # uninstall puts the base layers back
    pool.uninstall()
    assert model.adapter_rows is None
    assert not any(isinstance(m, LORA_LAYER_TYPES) for m in model.pipe.unet.modules())


@torch.no_grad()
def test_lru_eviction_refusal_and_stats(served, fresh_model, lora_setup):
    # the bytes of a set resident in the lowest slots (factors and the stacks built from
    # them): room for A and B together, or C and B, but not all three
    both = {pair: served[1].nbytes(list(pair)) for pair in ("AB", "CB", "ABC")}
    budget = max(both["AB"], both["CB"])
    assert budget < both["ABC"]
    pool = AdapterPool(fresh_model, lora_setup["lora_dir"], budget_bytes=budget)
    a = pool.acquire_waiting(["A"])
    pool.release(a)
    b = pool.acquire_waiting(["B"])  # A resident (unreferenced), B referenced
    assert pool.stats()["resident"] == 2 and pool.stats()["referenced"] == 1
    c = pool.acquire_waiting(["C"])  # must evict: A, the least recently used unreferenced one
    assert c is not None and pool.slot_of("A") is None and pool.slot_of("B") == b[0]
    assert pool.stats()["evictions"] == 1
    # all resident adapters referenced and no room: refused, nothing evicted
    before = pool.stats()
    assert pool.acquire_waiting(["A"]) is None
    assert pool.stats()["resident"] == before["resident"] and pool.slot_of("B") == b[0]
    assert pool.stats()["evictions"] == 1
    # a second reference to a resident adapter is a hit and loads nothing
    b2 = pool.acquire_waiting(["B"])
    assert b2 == b and pool.stats()["loads"] == 3
    pool.release(b2)
    pool.release(c)  # now C is the only unreferenced one: A replaces it, B stays
    assert pool.acquire_waiting(["A"]) is not None
    assert pool.slot_of("C") is None and pool.slot_of("B") == b[0]
    stats = pool.stats()
    assert stats["loads"] == 4 and stats["hits"] == 1 and stats["misses"] == 4
    assert stats["hit_rate"] == pytest.approx(1 / 5)
    assert stats["resident_bytes"] == both["AB"] <= budget
    with pytest.raises(ValueError, match="not referenced"):
        pool.release([pool.slot_of("A"), pool.slot_of("A")])


def test_row_inputs_pad_to_max_per_request(served):
    _, pool = served
    inputs = pool.row_inputs([3, 1], [0.5, -1.0])
    assert inputs["lora_index"].tolist() == [[3, 1, -1, -1]] * 2
    assert inputs["lora_scale"].tolist() == [[0.5, -1.0, 0.0, 0.0]] * 2
    assert inputs["lora_index"].dtype == torch.int32 and inputs["lora_scale"].dtype == torch.float32
    # host tensors whatever the model's device: the slot storage stages them without a sync
    assert inputs["lora_index"].device.type == inputs["lora_scale"].device.type == "cpu"


def test_rank_above_the_limit_is_refused_naming_loras(fresh_model, lora_setup, tmp_path):
    """An adapter above the pool's rank limit is refused at intake (`loras`), never loaded."""
    from engine.core.input_kinds.adapters import AdapterKind
    from engine.core.outputs import RequestRejected
    from engine.protocol import GenerateParams

    pool = AdapterPool(fresh_model, lora_setup["lora_dir"], budget_bytes=64 << 20, max_rank=4)
    assert pool.check({"A": 1.0}) is None  # rank 4
    why = pool.check({"B": 1.0})  # rank 8
    assert why is not None and "rank 8" in why and "up to 4" in why
    with pytest.raises(RequestRejected) as caught:
        AdapterKind(pool).check(GenerateParams(prompt="a red circle", loras={"B": 1.0}))
    assert caught.value.field == "loras"
    assert pool.stats()["loads"] == 0


def test_plain_lora_loads_keep_graphs_locon_loads_do_not(fresh_model, lora_setup):
    """A captured graph reads the Linear / 1×1 layers' adapters through device tables updated
    in place: loading or evicting such an adapter leaves `layout_version` (a graph key) as it
    is; an adapter on a k×k conv (B: LoCon on conv1) changes it."""
    pool = AdapterPool(fresh_model, lora_setup["lora_dir"], budget_bytes=64 << 20)
    version = pool.layout_version
    a = pool.acquire_waiting(["A"])  # Linear and 1×1 proj_in
    pool.release(a)
    c = pool.acquire_waiting(["C"])
    assert pool.layout_version == version
    b = pool.acquire_waiting(["B"])
    assert pool.layout_version > version
    pool.release(b + c)


def test_class_conditional_model_has_no_lora(tmp_path):
    from engine.lora import AdapterError
    from engine.models.loading import load_model
    from engine.testing.tiny_pipelines import build_class_conditional

    model = load_model(build_class_conditional(tmp_path / "cc"), load_vae=False)
    with pytest.raises(AdapterError, match="no LoRA loader"):
        AdapterPool(model, tmp_path, budget_bytes=1 << 20)


# ---- the kernel against the reference (Triton's interpreter) -----------------------------------

def random_layer_case(seed: int, dtype=torch.float32):
    """Random rows / tokens / features / K; slots of mixed ranks (1..40), some slots empty
    for this layer (rank 0), -1 entries, adapters shared between rows, a row using one
    adapter twice, a strided x (a 1×1 conv's channels-as-features view)."""
    g = torch.Generator().manual_seed(seed)
    ri = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    rows, tokens, width = ri(1, 7), ri(1, 70), ri(1, 4)
    in_f, out_f, capacity = ri(1, 80), ri(1, 72), ri(2, 6)
    weights = SlotWeights(capacity, in_f, out_f, "cpu", dtype)
    filled = [s for s in range(capacity) if torch.rand((), generator=g) < 0.75] or [0]
    for slot in filled:
        rank = ri(1, 40) if torch.rand((), generator=g) < 0.5 else ri(1, 8)
        weights.put(slot, torch.randn(rank, in_f, generator=g).to(dtype) / math.sqrt(in_f),
                    torch.randn(out_f, rank, generator=g).to(dtype), float(torch.rand((), generator=g) * 2))
    index = torch.randint(-1, capacity, (rows, width), generator=g, dtype=torch.int32)
    index[torch.rand(rows, width, generator=g) < 0.3] = -1
    if width > 1:
        index[0, 1] = index[0, 0]  # the same adapter twice in one row
    scale = torch.randn(rows, width, generator=g)
    if torch.rand((), generator=g) < 0.5:  # x as a transposed view (conv 1×1: rows × C × hw)
        x = torch.randn(rows, in_f, tokens, generator=g).to(dtype).transpose(1, 2)
    else:
        x = torch.randn(rows, tokens, in_f, generator=g).to(dtype)
    out = torch.randn(rows, tokens, out_f, generator=g).to(dtype)
    return weights, x, out, index, scale


def _worker_triton(seed: int, dtype: str, blocks: tuple) -> tuple:
    """In the Triton-interpreter worker: the LoRA kernel on the seed's random case."""
    from engine.lora import kernel
    from triton_interpreter import assert_interpreted

    assert_interpreted(kernel._lora_shrink_kernel)
    weights, x, out, index, scale = random_layer_case(seed, getattr(torch, dtype))
    groups = RowGroups.build(index, scale, for_kernel=True)
    kernel.add_lora_triton(out, x, weights, groups, *blocks)
    return out.float().numpy()


@pytest.mark.parametrize("seed,dtype,blocks", [
    (0, "float32", (16, 16, 16)), (1, "float32", (16, 32, 16)), (2, "float32", (32, 16, 64)),
    (3, "float32", (16, 16, 16)), (4, "float32", (64, 64, 64)), (5, "float16", (16, 16, 32)),
])
def test_triton_kernel_equals_reference(triton_interpreter, seed, dtype, blocks):
    pytest.importorskip("triton")
    weights, x, out, index, scale = random_layer_case(seed, getattr(torch, dtype))
    expected = out.clone()
    groups = RowGroups.build(index, scale, for_kernel=False)
    if groups is not None:
        add_lora_reference(expected, x, weights, groups)
    got = torch.from_numpy(triton_interpreter.submit(_worker_triton, seed, dtype, blocks).result(timeout=300))
    tol = 1e-5 if dtype == "float32" else 2e-3
    delta = expected.float() - out.float()
    assert float((got - expected.float()).norm()) <= tol * max(float(delta.norm()), 1e-6) + tol, seed
    no_adapter = (index < 0).all(1)
    assert torch.equal(got[no_adapter], out.float()[no_adapter])  # rows without adapters untouched


def test_random_cases_cover_ragged_ranks_and_empty_slots():
    ranks, empty, minus_one, strided = set(), 0, 0, 0
    for seed in range(5):
        weights, x, _, index, _ = random_layer_case(seed)
        ranks |= {r for r in weights.rank if r}
        empty += sum(1 for s in index.flatten().tolist() if s >= 0 and weights.rank[s] == 0)
        minus_one += int((index < 0).sum())
        strided += int(not x.is_contiguous())
    assert len(ranks) >= 5 and max(ranks) > 16 and min(ranks) < 8  # several rank blocks
    assert empty > 0 and minus_one > 0 and strided > 0


def test_reference_equals_per_row_loop():
    """The reference pinned to the definition: Σ_k s · scaling · B (A x), row by row, in float64."""
    for seed in range(6):
        weights, x, out, index, scale = random_layer_case(seed)
        got = out.clone()
        groups = RowGroups.build(index, scale)
        if groups is not None:
            add_lora_reference(got, x, weights, groups)
        expected = out.double().clone()
        for r in range(index.shape[0]):
            for k in range(index.shape[1]):
                slot = int(index[r, k])
                if slot < 0 or weights.A[slot] is None:
                    continue
                A, B = weights.A[slot].double(), weights.B[slot].double()
                expected[r] += float(scale[r, k]) * weights.scaling[slot] * (x[r].double() @ A.t()) @ B.t()
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
        assert torch.equal(lora_delta(x, weights, torch.full_like(index, -1), scale),
                           torch.zeros_like(out))


class _RecordedLaunch:
    """Stands in for a @triton.jit kernel: records each launch's arguments (on CPU nothing
    can be launched; what the launcher asks for is what a GPU would compile)."""

    def __init__(self, fn, launches: list):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.fn, grid, args, kwargs))
        return launch


_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
                 torch.int64: "i64"}


def _signature(fn, args, kwargs) -> tuple[dict, dict, dict]:
    """(signature, constexprs, options) of one recorded launch, as the JIT would compile it."""
    sig, constexprs, options = {}, {}, {}
    names = list(fn.arg_names)
    for name, value in zip(names, args):
        sig[name] = f"*{_TRITON_TYPES[value.dtype]}" if isinstance(value, torch.Tensor) else "i32"
    for name, value in kwargs.items():
        if name in names:
            sig[name], constexprs[name] = "constexpr", value
        else:
            options[name] = value
    return sig, constexprs, options


def _resources(cubin: bytes) -> dict | None:
    """Registers and stack (spill) bytes per thread of a cubin, read by the cuobjdump that
    ships with triton (None where it does not)."""
    import re
    import subprocess
    import tempfile

    import triton

    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return None if found is None else {"registers": int(found[1]), "stack": int(found[2])}


#: sm_90's shared memory per block (227 KB) and registers per thread
SM90_SHARED_BYTES, SM90_REGISTERS = 227 * 1024, 255


def test_kernels_compile_for_sm90_at_every_rank(monkeypatch):
    """What the interpreter cannot show: at ranks 16 … 1024 (fp32, fp16, bf16), the launcher
    asks for kernels that compile for sm_90 within its shared memory, with no register spill,
    and the same kernels whatever the rank (rank tiling: no adapter recompiles anything)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.lora import kernel

    if not isinstance(kernel._lora_shrink_kernel, triton.runtime.jit.JITFunction):
        pytest.skip("TRITON_INTERPRET is set in this process: nothing to compile")
    launches: list = []
    for name in ("_lora_shrink_kernel", "_lora_expand_kernel"):
        monkeypatch.setattr(kernel, name, _RecordedLaunch(getattr(kernel, name), launches))
    variants = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for rank in (16, 64, 128, 256, 512, 1024):
            weights = SlotWeights(2, 320, 640, "cpu", dtype, rank_limit=1024)
            weights.put(0, torch.zeros(rank, 320), torch.zeros(640, rank), 1.0)
            weights.put(1, torch.zeros(8, 320), torch.zeros(640, 8), 1.0)
            groups = RowGroups.build(torch.tensor([[0, 1], [1, -1]]), torch.ones(2, 2), for_kernel=True)
            x, out = torch.zeros(2, 4096, 320, dtype=dtype), torch.zeros(2, 4096, 640, dtype=dtype)
            launches.clear()
            kernel.add_lora_triton(out, x, weights, groups)
            assert len(launches) == 2
            for fn, grid, args, kwargs in launches:
                sig, constexprs, options = _signature(fn, args, kwargs)
                if fn is kernel._lora_shrink_kernel.fn:  # the rank walks the grid, in tiles
                    assert grid[2] * constexprs["R_BLOCK"] >= rank
                variants.setdefault((fn.__name__, str(dtype)), set()).add(
                    (tuple(sorted(sig.items())), tuple(sorted(constexprs.items())), tuple(sorted(options.items()))))
    assert all(len(v) == 1 for v in variants.values()), variants  # one compiled variant per kernel and dtype
    for (name, dtype), (variant,) in variants.items():
        sig, constexprs, options = (dict(part) for part in variant)
        fn = getattr(kernel, name).fn
        try:
            compiled = triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                                      options=options)
        except Exception as exc:  # no LLVM / ptxas for this target in the installed triton
            pytest.skip(f"cannot compile for sm_90 here: {type(exc).__name__}: {exc}")
        assert ".entry" in compiled.asm["ptx"]
        if dtype != str(torch.float32):
            assert "mma" in compiled.asm["ptx"]  # tensor cores for half precision
        assert compiled.metadata.shared <= SM90_SHARED_BYTES, (name, dtype, compiled.metadata.shared)
        used = _resources(compiled.asm["cubin"])
        if used is not None:
            assert used["registers"] <= SM90_REGISTERS and used["stack"] == 0, (name, dtype, used)


# ---- SDXL ----------------------------------------------------------------------------------

@torch.no_grad()
def test_sdxl_rows_equal_pipeline_with_their_adapters(tmp_path):
    tiny = pytest.importorskip("engine.testing.tiny_pipelines")
    if not hasattr(tiny, "build_sdxl"):
        pytest.skip("no build_sdxl")
    from diffusers import StableDiffusionXLPipeline

    from engine.models.loading import load_model

    folder = tiny.build_sdxl(tmp_path / "sdxl")
    lora_dir = tmp_path / "loras"
    lora_dir.mkdir()
    pipe = StableDiffusionXLPipeline.from_pretrained(folder)
    specs = {"X": dict(r=4, lora_alpha=4, target_modules=["to_q", "to_v", "proj_in", "linear_1"]),
             "Y": dict(r=8, lora_alpha=16, target_modules=["to_k", "to_out.0", "ff.net.2", "conv2"])}
    for seed, (name, spec) in enumerate(specs.items(), start=11):
        _make_lora(pipe, name, seed, {"unet": spec}, (lora_dir / name, None))
    for name in specs:
        pipe.load_lora_weights(lora_dir / name, adapter_name=name)
    model = load_model(folder, load_vae=False)
    pool = AdapterPool(model, lora_dir, budget_bytes=16 << 20)
    slots = dict(zip(specs, pool.acquire_waiting(list(specs))))
    rows = [{}, {"X": 1.0}, {"X": 0.3, "Y": 1.5}, {"Y": -0.8}]
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(len(rows), 4, 8, 8, generator=g), torch.tensor([950.0, 600.0, 300.0, 30.0])
    cond = model.encode(["a red circle", "a blue square", "", "a green cross"])
    time_ids = torch.tensor([[16.0, 16.0, 0.0, 0.0, 16.0, 16.0]] * len(rows))
    index = torch.full((len(rows), 2), -1, dtype=torch.int32)
    scale = torch.zeros(len(rows), 2)
    for r, loras in enumerate(rows):
        for k, (name, s) in enumerate(loras.items()):
            index[r, k], scale[r, k] = slots[name], s
    out = model.denoise(x, t, cond, time_ids=time_ids, lora_index=index, lora_scale=scale)
    for r, loras in enumerate(rows):
        if loras:
            pipe.enable_lora()
            pipe.set_adapters(list(loras), adapter_weights=list(loras.values()))
        else:
            pipe.disable_lora()
        added = {"text_embeds": cond[r].pooled[None], "time_ids": time_ids[r:r + 1]}
        expected = pipe.unet(x[r:r + 1], t[r], encoder_hidden_states=cond[r].hidden[None],
                             added_cond_kwargs=added).sample[0]
        assert _rel(out[r], expected) <= 1e-5, (r, loras, _rel(out[r], expected))
    pool.release(list(slots.values()))


# ---- SD3 (a transformer denoiser: the same layer wrapper) --------------------------------------

@torch.no_grad()
def test_sd3_transformer_rows_equal_pipeline_with_their_adapters(tmp_path):
    from diffusers import StableDiffusion3Pipeline

    from engine.models.loading import load_model
    from engine.testing.tiny_pipelines import build_sd3

    folder = build_sd3(tmp_path / "sd3", with_t5=False)
    lora_dir = tmp_path / "loras"
    lora_dir.mkdir()
    pipe = StableDiffusion3Pipeline.from_pretrained(folder, text_encoder_3=None, tokenizer_3=None)
    # joint attention (add_q_proj), feed-forward, AdaLayerNorm's `linear` on the embedding
    spec = dict(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "add_q_proj", "to_out.0", "ff.net.2", "linear"])
    _make_lora(pipe, "S", 21, {"transformer": spec}, (lora_dir / "S", None))
    pipe.load_lora_weights(lora_dir / "S", adapter_name="S")
    model = load_model(folder, load_vae=False)
    pool = AdapterPool(model, lora_dir, budget_bytes=16 << 20)
    slot = pool.acquire_waiting(["S"])[0]
    g = torch.Generator().manual_seed(4)
    x, t = torch.randn(3, 16, 8, 8, generator=g), torch.tensor([900.0, 500.0, 100.0])
    cond = model.encode(["a red circle", "", "a blue square"])
    index = torch.tensor([[slot], [-1], [slot]], dtype=torch.int32)
    scales = [1.0, None, 0.4]
    out = model.denoise(x, t, cond, lora_index=index, lora_scale=torch.tensor([[1.0], [0.0], [0.4]]))
    base = model.denoise(x, t, cond)
    for r, s in enumerate(scales):
        if s is None:
            pipe.disable_lora()
        else:
            pipe.enable_lora()
            pipe.set_adapters(["S"], adapter_weights=[s])
        expected = pipe.transformer(hidden_states=x[r:r + 1], timestep=t[r:r + 1],
                                    encoder_hidden_states=cond[r].hidden[None],
                                    pooled_projections=cond[r].pooled[None]).sample[0]
        assert _rel(out[r], expected) <= 1e-5, (r, s)
        assert (s is None) == (_rel(base[r], expected) < 1e-5)
    pool.release([slot])


# ---- half precision rounds as peft does -----------------------------------------------------

def _peft_half_case():
    """An fp16 layer, two adapters, rows with one, two (in order) or none, and what peft's
    LoRA layer computes: result = result + lora_B(lora_A(x)) * scaling, adapter by adapter,
    every step rounded to fp16 (scaling = adapter weight × alpha / r)."""
    F = torch.nn.functional
    g = torch.Generator().manual_seed(5)
    base_w, base_b = (torch.randn(48, 64, generator=g) / 8).half(), torch.randn(48, generator=g).half()
    weights = SlotWeights(3, 64, 48, "cpu", torch.float16)
    factors = {0: ((torch.randn(8, 64, generator=g) / 8).half(), torch.randn(48, 8, generator=g).half(), 16 / 8),
               2: ((torch.randn(40, 64, generator=g) / 8).half(), torch.randn(48, 40, generator=g).half(), 1.0)}
    for slot, (A, B, scaling) in factors.items():
        weights.put(slot, A, B, scaling)
    index = torch.tensor([[0, -1], [2, 0], [-1, -1], [0, 2]], dtype=torch.int32)
    scale = torch.tensor([[0.7, 0.0], [1.3, -0.4], [0.0, 0.0], [0.9, 0.6]])
    x = torch.randn(4, 10, 64, generator=g).half()
    out = F.linear(x, base_w, base_b)
    expected = out.clone()
    for r in range(4):
        for k in range(2):
            slot = int(index[r, k])
            if slot >= 0:
                A, B, scaling = factors[slot]
                expected[r] = expected[r] + F.linear(F.linear(x[r], A), B) * (float(scale[r, k]) * scaling)
    return weights, x, out, index, scale, expected


def _worker_triton_half() -> tuple:
    from engine.lora import kernel

    weights, x, out, index, scale, _ = _peft_half_case()
    kernel.add_lora_triton(out, x, weights, RowGroups.build(index, scale, for_kernel=True))
    return out.float().numpy()


def test_half_precision_scaling_after_rounding_as_peft(triton_interpreter):
    """peft scales `lora_B(lora_A(x))` after it is rounded to fp16 and adds adapter by
    adapter: the reference matches it bit for bit, the kernel to within one fp16 rounding."""
    weights, x, out, index, scale, expected = _peft_half_case()
    got = out.clone()
    add_lora_reference(got, x, weights, RowGroups.build(index, scale))
    assert torch.equal(got, expected)
    kernel_out = torch.from_numpy(triton_interpreter.submit(_worker_triton_half).result(timeout=300))
    ulp = expected.float().abs() * 2 ** -10 + 2 ** -24
    assert bool(((kernel_out - expected.float()).abs() <= ulp).all())
    assert torch.equal(kernel_out[2], out[2].float())  # the row without adapters untouched


# ---- convolutions: 1×1 with stride and padding, k×k without a host sync ----------------------

def _peft_conv_delta(x, A, B, base: torch.nn.Conv2d, scaling: float) -> torch.Tensor:
    """peft's conv LoRA: lora_A a conv with the base's kernel, stride, padding (zeros) and
    dilation, lora_B a 1×1 conv; times scaling."""
    F = torch.nn.functional
    v = F.conv2d(x, A.reshape(A.shape[0], *base.weight.shape[1:]), None, base.stride, base.padding, base.dilation)
    return F.conv2d(v, B.reshape(*B.shape, 1, 1)) * scaling


@pytest.mark.parametrize("kernel,stride,padding,mode", [
    (1, 2, 1, "zeros"), (1, (1, 2), (2, 0), "reflect"), (1, 1, "same", "zeros"), (3, 2, 1, "zeros")])
def test_conv_lora_with_stride_and_padding_equals_peft(kernel, stride, padding, mode):
    from engine.lora.kernel import add_lora_conv_gathered
    from engine.lora.layers import AdapterRows, LoraConv2d

    g = torch.Generator().manual_seed(9)
    base = torch.nn.Conv2d(6, 10, kernel, stride=stride, padding=padding, padding_mode=mode)
    rows = AdapterRows()
    layer = LoraConv2d(base, 3, rows)
    factors = {slot: (torch.randn(r, 6, kernel, kernel, generator=g), torch.randn(10, r, generator=g), s)
               for slot, r, s in ((0, 4, 2.0), (2, 3, 0.5))}
    for slot, (A, B, s) in factors.items():
        layer.weights.put(slot, A, B, s)
    index = torch.tensor([[0, 2], [-1, -1], [2, -1]], dtype=torch.int32)
    scale = torch.tensor([[0.5, 1.5], [0.0, 0.0], [-1.0, 0.0]])
    x = torch.randn(3, 6, 9, 7, generator=g)
    rows.bind(index, scale)
    got = layer(x)
    expected = base(x)
    for r in range(3):
        for k in range(2):
            slot = int(index[r, k])
            if slot >= 0:
                A, B, s = factors[slot]
                expected[r] += _peft_conv_delta(x[r:r + 1], A, B, base, float(scale[r, k]) * s)[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # the sync-free form CUDA takes (every (row, k) entry, one grouped conv) gives the same
    gathered = base(x)
    add_lora_conv_gathered(gathered, x, layer.weights, RowGroups.build(index, scale, for_kernel=True),
                           layer.stride, layer.padding, layer.dilation)
    torch.testing.assert_close(gathered, expected, rtol=1e-5, atol=1e-5)


def test_long_names_links_out_and_read_errors_are_refused_without_server_paths(fresh_model, lora_setup, tmp_path):
    """A name over 255 bytes is refused naming `loras` (not an internal error); a link in
    the folder that leads out of it is neither listed nor read; a link within it is; a
    file that cannot be read is refused with a reason that names the adapter, never a
    path of the server or the reader's own words (those go to the log)."""
    import os
    import shutil

    from engine.core.input_kinds.adapters import AdapterKind
    from engine.core.outputs import RequestRejected
    from engine.protocol import GenerateParams

    folder = tmp_path / "loras"
    folder.mkdir()
    shutil.copy(lora_setup["lora_dir"] / "B.safetensors", folder / "B.safetensors")
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(lora_setup["lora_dir"] / "B.safetensors", outside / "secret.safetensors")
    os.symlink(outside / "secret.safetensors", folder / "leak.safetensors")
    os.symlink(outside, folder / "leakdir")  # a folder link: outside/pytorch_lora_weights.safetensors
    shutil.copy(lora_setup["lora_dir"] / "B.safetensors", outside / "pytorch_lora_weights.safetensors")
    os.symlink(folder / "B.safetensors", folder / "alias.safetensors")  # a link within the folder
    (folder / "corrupt.safetensors").write_bytes(b"\xff" * 64)
    pool = AdapterPool(fresh_model, folder, budget_bytes=64 << 20)
    assert pool.names() == ["B", "alias", "corrupt"]
    for name in ("leak", "leakdir"):
        assert "unknown adapter" in pool.check({name: 1.0})
    assert pool.check({"alias": 1.0}) is None
    long_name = "é" * 128  # 256 bytes
    for loras in ({long_name: 1.0}, {"x" * 10_000: 1.0}):
        reason = pool.check(loras)
        assert reason is not None and "at most 255 bytes" in reason
        with pytest.raises(RequestRejected) as caught:
            AdapterKind(pool).check(GenerateParams(prompt="a red circle", loras=loras))
        assert caught.value.field == "loras"
    reason = pool.check({"corrupt": 1.0})
    assert "'corrupt'" in reason and "cannot be read" in reason
    for private in (str(tmp_path), "Safetensor", "header"):
        assert private not in reason, reason
        assert private not in pool.check({"nope": 1.0})
    assert str(folder) not in pool.check({"nope": 1.0})
    pool.uninstall()
