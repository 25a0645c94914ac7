"""What a new user meets in the first hour: models as they hold them (a hub id from the
local cache, a folder saved with `variant="fp16"`, a single-file checkpoint, a folder that
cannot load), errors that say what was tried, the CLI's seed and help, an install whose CPU
path needs no triton, and the LoRA adapters shipped with the embedded model.

Hub ids are resolved offline against a cache laid out as the hub lays it out
(`models--ORG--NAME/snapshots/REV/...` and `refs/main`) in a temporary HF_HOME, in a
subprocess so that huggingface_hub reads that HF_HOME at import."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from proc_helpers import REPO, env, socket_dir

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory) -> pathlib.Path:
    from engine.testing.tiny_pipelines import build_sd

    return build_sd(tmp_path_factory.mktemp("tiny") / "sd")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_line(text: str) -> bool:
    return "\n" not in text.strip() and "Traceback" not in text


# ------------------------------------------------------------------ models as users hold them

def test_hub_id_resolves_offline_from_the_cache_and_says_where_it_looked(tiny_sd, tmp_path):
    home = tmp_path / "hf"
    snapshot = home / "hub" / "models--tiny-org--tiny-sd" / "snapshots" / REVISION
    shutil.copytree(tiny_sd, snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(REVISION)
    script = textwrap.dedent("""
        import json, sys
        from engine.models import ModelNotFound, resolve
        from engine.models.loading import load_model
        model = load_model("tiny-org/tiny-sd")
        pinned = resolve("tiny-org/tiny-sd", revision=sys.argv[1])
        try:
            resolve("tiny-org/absent")
            missing = None
        except ModelNotFound as exc:
            missing = str(exc)
        print(json.dumps({"path": str(model.path), "name": model.name, "pinned": str(pinned), "missing": missing}))
    """)
    environment = dict(env(), HF_HOME=str(home), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", script, REVISION], cwd=REPO, env=environment, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert pathlib.Path(found["path"]) == snapshot == pathlib.Path(found["pinned"])
    assert found["name"] == "tiny-org/tiny-sd"
    assert found["missing"] is not None and one_line(found["missing"])
    assert str(home / "hub") in found["missing"] and "HF_HUB_OFFLINE" in found["missing"]

    # the command line says the same in one line, and exits at once
    with socket_dir() as directory:
        refused = subprocess.run([sys.executable, "-m", "engine", "serve", "--model", "tiny-org/absent",
                                  "--address", f"ipc://{directory / 'e.sock'}", "--device", "cpu"],
                                 cwd=REPO, env=environment, capture_output=True, text=True, timeout=240)
    assert refused.returncode == 2
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(home / "hub") in errors[0] and "Traceback" not in refused.stderr


def _save_variant(source: pathlib.Path, out: pathlib.Path, *, keep_default: bool = False) -> None:
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(source)
    if keep_default:
        pipe.save_pretrained(out)
    pipe.to(torch.float16).save_pretrained(out, variant="fp16")


def test_a_folder_saved_with_variant_fp16_loads(tiny_sd, tmp_path):
    from engine.models.model import VaeDecoder
    from engine.models.loading import load_model

    only_fp16 = tmp_path / "fp16"
    _save_variant(tiny_sd, only_fp16)
    assert not list(only_fp16.rglob("diffusion_pytorch_model.safetensors"))
    base = load_model(tiny_sd)
    for model in (load_model(only_fp16), load_model(only_fp16, variant="fp16")):
        assert model.dtype == torch.float32  # --dtype as asked; the fp16 weights are upcast
        for (name, theirs), ours in zip(base.denoiser.state_dict().items(), model.denoiser.state_dict().values()):
            torch.testing.assert_close(ours, theirs.half().float(), rtol=0, atol=0, msg=name)
    # decode workers load the VAE from the folder alone
    VaeDecoder.from_folder(only_fp16)

    both = tmp_path / "both"
    _save_variant(tiny_sd, both, keep_default=True)
    weight = next(iter(base.denoiser.parameters()))
    default, fp16 = load_model(both), load_model(both, variant="fp16")
    assert torch.equal(next(iter(default.denoiser.parameters())), weight)
    assert torch.equal(next(iter(fp16.denoiser.parameters())), weight.half().float())


def test_a_folder_that_cannot_load_names_the_component_in_one_line(tiny_sd, tmp_path):
    from engine.models import ModelLoadError
    from engine.models.loading import load_model

    no_weights = tmp_path / "no_weights"
    shutil.copytree(tiny_sd, no_weights)
    for weights in (no_weights / "unet").glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(ModelLoadError) as caught:
        load_model(no_weights)
    assert "component unet" in str(caught.value) and one_line(str(caught.value))

    broken = tmp_path / "broken"
    shutil.copytree(tiny_sd, broken)
    (broken / "text_encoder" / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError) as caught:
        load_model(broken)
    assert "component text_encoder" in str(caught.value) and one_line(str(caught.value))

    fp16_only = tmp_path / "fp16_only"
    _save_variant(tiny_sd, fp16_only)
    with pytest.raises(ModelLoadError) as caught:
        load_model(fp16_only, variant="bf16")
    assert "bf16" in str(caught.value) and "fp16" in str(caught.value) and one_line(str(caught.value))


def test_single_file_checkpoints_fail_in_one_line_naming_the_file(tiny_sd, tmp_path, monkeypatch):
    """A single file goes through the pipeline's own `from_single_file`, which reads
    checkpoints in the original (LDM) key layout; diffusers ships no writer of that
    layout, so no tiny single file is made here: this checks the refusals only."""
    from huggingface_hub import constants
    from safetensors.torch import save_file

    from engine.models import ModelLoadError
    from engine.models.loading import load_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    stray = tmp_path / "stray.safetensors"
    save_file({"some.weight": torch.zeros(2, 2)}, stray)
    for config in (None, tiny_sd):
        with pytest.raises(ModelLoadError) as caught:
            load_model(stray, config=config)
        message = str(caught.value)
        assert str(stray) in message and one_line(message), message
        if config is None:
            assert "--config" in message
    with pytest.raises(ValueError, match="--config"):
        load_model(tiny_sd, config=tiny_sd)  # a folder takes no --config


# ------------------------------------------------------------------ errors that help

@pytest.mark.timeout(240)
def test_a_busy_metrics_port_names_it_stops_every_child_and_exits_at_once():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with socket_dir() as directory:
            address = f"ipc://{directory / 'engine.sock'}"
            process = subprocess.Popen(
                [sys.executable, "-m", "engine", "serve", "--device", "cpu", "--address", address, "--slots", "2",
                 "--decode-workers", "1", "--metrics-port", str(port)],
                cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                start_new_session=True)
            try:
                _, stderr = process.communicate(timeout=180)
            finally:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # every process of its session (decode workers) is gone
                try:
                    os.killpg(process.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                os.killpg(process.pid, signal.SIGKILL)
                pytest.fail("a child of the engine outlived it")
            assert not (directory / "engine.sock").exists()
    assert process.returncode == 2, stderr[-2000:]
    assert f"metrics on 127.0.0.1:{port}" in stderr and "cannot serve on ipc" not in stderr, stderr[-2000:]


def test_a_wrong_address_fails_within_two_seconds_saying_what_was_tried():
    from frontend import Client

    with socket_dir() as directory:
        cases = {f"ipc://{directory / 'absent.sock'}": "no socket file",
                 f"tcp://127.0.0.1:{free_port()}": "refused",
                 f"127.0.0.1:{free_port()}": "refused"}  # no scheme: tcp
        for address, why in cases.items():
            started = time.monotonic()
            with pytest.raises(ConnectionError) as caught:
                Client(address, connect_timeout=30).connect()
            assert time.monotonic() - started < 2.5
            assert why in str(caught.value).lower() and address.split("//")[-1] in str(caught.value)
    with pytest.raises(ValueError, match="ipc://PATH or tcp://HOST:PORT"):
        Client("localhost")
    from engine.serve.transport import normalize_address

    assert normalize_address("127.0.0.1:5555") == "tcp://127.0.0.1:5555"


def test_command_line_errors_are_one_line_and_quick(tmp_path):
    port = free_port()
    started = time.monotonic()
    wrong = subprocess.run([sys.executable, "-m", "frontend", "generate", "--prompt", "a red circle", "-o",
                            str(tmp_path / "x.png"), "--address", f"127.0.0.1:{port}"],
                           cwd=REPO, env=env(), capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 1 and "Traceback" not in wrong.stderr
    assert f"tcp://127.0.0.1:{port}" in wrong.stderr and "refused" in wrong.stderr.lower()
    assert time.monotonic() - started < 30  # imports included, on a loaded machine
    missing = subprocess.run([sys.executable, "-m", "engine", "serve", "--lora-dir", str(tmp_path / "absent"),
                              "--address", f"ipc://{tmp_path / 'e.sock'}"],
                             cwd=REPO, env=env(), capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "--lora-dir" in missing.stderr and "no such folder" in missing.stderr
    assert "loading model" not in missing.stderr  # refused before the model loads


@pytest.mark.timeout(90)
def test_the_gateway_says_it_waits_for_its_engine(tmp_path):
    address = f"ipc://{tmp_path / 'absent.sock'}"
    process = subprocess.Popen([sys.executable, "-m", "frontend", "http", "--engine", address, "--port",
                                str(free_port())], cwd=REPO, env=env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = process.stderr.readline()
            if not line:
                break
            seen.append(line)
            if f"waiting for the engine at {address}" in line:
                assert "retrying every" in line
                break
        else:
            pytest.fail("no 'waiting for the engine' line:\n" + "".join(seen))
        assert any(f"waiting for the engine at {address}" in line for line in seen), "".join(seen)
    finally:
        process.terminate()
        process.wait(20)


def test_help_shows_defaults_and_the_cli_seed_is_random():
    from engine.__main__ import build_parser
    from frontend.__main__ import build_parser as frontend_parser

    def help_of(parser, command: str) -> str:  # as one line: argparse wraps it
        return " ".join(parser._subparsers._group_actions[0].choices[command].format_help().split())

    serve = help_of(build_parser(), "serve")
    assert "(default 64)" in serve and "(default 16" in serve and "--revision" in serve and "--variant" in serve
    generate = help_of(frontend_parser(), "generate")
    assert "(default 20)" in generate and "fresh random one" in generate
    assert frontend_parser().parse_args(["generate", "--prompt", "a", "-o", "x.png"]).seed is None


# ------------------------------------------------------------------ an install that fits

def test_the_cpu_path_runs_without_triton():
    script = textwrap.dedent("""
        import sys
        class NoTriton:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("triton is not installed")
        sys.meta_path.insert(0, NoTriton())
        import torch
        from engine.core.engine_core import EngineCore
        from engine.core.config import CoreConfig
        from engine.lora import AdapterPool
        from engine.models.loading import load_model
        from engine.protocol import GenerateParams
        import engine.__main__, engine.demo, frontend
        core = EngineCore(load_model("shapes"), CoreConfig(device="cpu", slots=2))
        core.add_request("r", GenerateParams(prompt="a red circle", steps=2, output="latent"))
        for _ in range(20):
            core.step()
        assert "triton" not in sys.modules
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_extras_split_by_use():
    import ast

    tree = ast.parse((REPO / "setup.py").read_text())
    setup = next(node for node in ast.walk(tree) if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup")
    keywords = {k.arg: k.value for k in setup.keywords}
    required = [ast.literal_eval(e) for e in keywords["install_requires"].elts]
    assert not any(r.startswith(("triton", "fastapi", "uvicorn", "ray", "selenium", "matplotlib")) for r in required)
    extras = {ast.literal_eval(k) for k in keywords["extras_require"].keys}
    assert {"cuda", "http", "ray", "test", "browser", "dev"} <= extras


def ldm_checkpoint(pipe) -> dict[str, torch.Tensor]:
    """A StableDiffusionPipeline's weights as one checkpoint in the original (LDM) key
    layout, as A1111 and ComfyUI hold them: the inverse of diffusers' own
    `convert_ldm_unet_checkpoint` / `convert_ldm_vae_checkpoint` / CLIP prefix, for the
    block layout of `pipe`'s configs (the test checks the round trip exactly)."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

    out: dict[str, torch.Tensor] = {}
    unet, per_block = pipe.unet, pipe.unet.config.layers_per_block + 1
    resnet_names = (("norm1", "in_layers.0"), ("conv1", "in_layers.2"), ("norm2", "out_layers.0"),
                    ("conv2", "out_layers.3"), ("time_emb_proj", "emb_layers.1"), ("conv_shortcut", "skip_connection"))
    top = DIFFUSERS_TO_LDM_MAPPING["unet"]["layers"]
    up_attention = {b for b, block in enumerate(unet.up_blocks) if getattr(block, "attentions", None)}
    for key, value in unet.state_dict().items():
        parts = key.split(".")
        if key in top:
            ldm = top[key]
        elif parts[0] == "down_blocks" and parts[2] == "downsamplers":
            ldm = f"input_blocks.{(int(parts[1]) + 1) * per_block}.0.op.{parts[-1]}"
        elif parts[0] == "down_blocks":
            index, slot = 1 + int(parts[1]) * per_block + int(parts[3]), 0 if parts[2] == "resnets" else 1
            ldm = f"input_blocks.{index}.{slot}.{'.'.join(parts[4:])}"
        elif parts[0] == "mid_block":
            index = 2 * int(parts[2]) if parts[1] == "resnets" else 1
            ldm = f"middle_block.{index}.{'.'.join(parts[3:])}"
        elif parts[0] == "up_blocks" and parts[2] == "upsamplers":
            block = int(parts[1])
            ldm = f"output_blocks.{block * per_block + per_block - 1}.{2 if block in up_attention else 1}.conv.{parts[-1]}"
        elif parts[0] == "up_blocks":
            index, slot = int(parts[1]) * per_block + int(parts[3]), 0 if parts[2] == "resnets" else 1
            ldm = f"output_blocks.{index}.{slot}.{'.'.join(parts[4:])}"
        else:
            raise KeyError(key)
        if ldm.split(".")[2] == "0" and ldm.startswith(("input_blocks", "output_blocks", "middle_block")) or \
                ldm.startswith("middle_block") and ldm.split(".")[1] != "1":
            for diffusers_name, ldm_name in resnet_names:
                ldm = ldm.replace(f".{diffusers_name}.", f".{ldm_name}.")
        out["model.diffusion_model." + ldm] = value
    vae, blocks = pipe.vae, len(pipe.vae.config.down_block_types)
    vae_top = {k: v for k, v in DIFFUSERS_TO_LDM_MAPPING["vae"].items()}
    attention_names = (("group_norm", "norm"), ("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "proj_out"))
    for key, value in vae.state_dict().items():
        parts = key.split(".")
        if key in vae_top:
            ldm = vae_top[key]
        elif parts[1] == "down_blocks" and parts[3] == "downsamplers":
            ldm = f"encoder.down.{parts[2]}.downsample.conv.{parts[-1]}"
        elif parts[1] == "down_blocks":
            ldm = f"encoder.down.{parts[2]}.block.{'.'.join(parts[4:])}"
        elif parts[1] == "up_blocks" and parts[3] == "upsamplers":
            ldm = f"decoder.up.{blocks - 1 - int(parts[2])}.upsample.conv.{parts[-1]}"
        elif parts[1] == "up_blocks":
            ldm = f"decoder.up.{blocks - 1 - int(parts[2])}.block.{'.'.join(parts[4:])}"
        elif parts[1] == "mid_block" and parts[2] == "resnets":
            ldm = f"{parts[0]}.mid.block_{int(parts[3]) + 1}.{'.'.join(parts[4:])}"
        elif parts[1] == "mid_block":
            rest = ".".join(parts[4:])
            for diffusers_name, ldm_name in attention_names:
                rest = rest.replace(f"{diffusers_name}.", f"{ldm_name}.") if rest.startswith(diffusers_name) else rest
            ldm = f"{parts[0]}.mid.attn_1.{rest}"
            if value.ndim == 2:  # the original's attention projections are 1×1 convolutions
                value = value[:, :, None, None]
        else:
            raise KeyError(key)
        out["first_stage_model." + ldm.replace("conv_shortcut", "nin_shortcut")] = value
    for key, value in pipe.text_encoder.state_dict().items():
        out["cond_stage_model.transformer." + (key if key.startswith("text_model.") else "text_model." + key)] = value
    return {k: v.contiguous() for k, v in out.items()}


def test_a_single_file_checkpoint_loads_with_its_config_folder(tiny_sd, tmp_path, monkeypatch):
    from diffusers import StableDiffusionPipeline
    from safetensors.torch import save_file

    from engine.models.loading import load_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd)
    file = tmp_path / "tiny-sd.safetensors"
    save_file(ldm_checkpoint(pipe), file)
    model = load_model(file, config=tiny_sd)
    assert model.name == "tiny-sd.safetensors"
    for name in ("unet", "vae", "text_encoder"):
        theirs, ours = getattr(pipe, name).state_dict(), model.pipe.components[name].state_dict()
        assert theirs.keys() == ours.keys(), name
        for key in theirs:
            torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0, msg=f"{name}.{key}")
    # the decode workers' folder: the configs and the VAE, loadable as a pipeline folder's VAE
    from engine.models.geometry import geometry_of
    from engine.models.model import VaeDecoder

    assert geometry_of(model.decode_folder) == model.geometry
    decoder = VaeDecoder.from_folder(model.decode_folder)
    latents = torch.randn(1, 4, 8, 8)
    np.testing.assert_array_equal(decoder.decode(latents), model.decode(latents))


def test_the_ray_app_takes_a_lora_dir(tmp_path, capsys):
    pytest.importorskip("ray")
    from frontend.ray_app import AppConfig, engine_arguments, main

    args = engine_arguments(AppConfig(lora_dir=str(tmp_path)), None)
    assert args[args.index("--lora-dir") + 1] == str(tmp_path)
    assert main(["--lora-dir", str(tmp_path / "absent")]) == 2  # before any cluster starts
    assert "no such folder" in capsys.readouterr().err


def test_clients_are_told_a_hub_id_whole_and_never_a_host_path():
    from engine.serve.proc import model_label

    assert model_label("stabilityai/stable-diffusion-xl-base-1.0") == "stabilityai/stable-diffusion-xl-base-1.0"
    assert model_label("/srv/models/private/tiny-sd") == "tiny-sd"
    assert model_label("shapes") == "shapes"
