"""Tiny random-weight conditioning adapters for the tiny pipeline folders of
`engine.testing.tiny_pipelines`, built as diffusers' own tests build them: ControlNets
(`ControlNetModel` from the UNet, `FluxControlNetModel`, `SD3ControlNetModel`) and
IP-Adapter weights with their image encoder."""
from __future__ import annotations

import json
import pathlib

import torch

def build_controlnet(folder, base, *, seed: int = 0, gain: float = 0.3, global_pool_conditions: bool = False,
                     **options) -> pathlib.Path:
    """Write a tiny ControlNet folder for the pipeline folder `base` and return its path:
    a `ControlNetModel` for SD or SDXL, a `FluxControlNetModel` for FLUX, an
    `SD3ControlNetModel` for SD3 (`options`: `_build_sd3_controlnet`'s).

    Built as diffusers' own tests build theirs: `ControlNetModel.from_unet` on the base's
    UNet (its down and mid blocks' weights), the conditioning embedding downsampling as
    many times as the VAE (`vae_scale_factor`: one stride-2 block per halving), and the
    zero-initialised convolutions (the residual projections, the embedding's last conv)
    given random weights (normal × `gain`, seeded), so that the control changes the output.
    `global_pool_conditions`: the shuffle-style ControlNet, whose forward mean-pools its
    residuals (and whose pipelines then run in guess mode).
    """
    from diffusers import AutoencoderKL, ControlNetModel, UNet2DConditionModel

    folder, base = pathlib.Path(folder), pathlib.Path(base)
    kind = json.loads((base / "model_index.json").read_text())["_class_name"]
    if kind == "FluxPipeline":
        return _build_flux_controlnet(folder, base, seed=seed, gain=gain)
    if kind == "StableDiffusion3Pipeline":
        return _build_sd3_controlnet(folder, base, seed=seed, gain=gain, **options)
    if options:
        raise TypeError(f"a ControlNetModel takes no {', '.join(options)}")
    unet = UNet2DConditionModel.from_pretrained(base / "unet", low_cpu_mem_usage=False)
    vae = AutoencoderKL.from_pretrained(base / "vae", low_cpu_mem_usage=False)
    halvings = len(vae.config.block_out_channels) - 1
    channels = tuple(16 * 2 ** k for k in range(halvings + 1))
    torch.manual_seed(seed)
    controlnet = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=channels).eval()
    if global_pool_conditions:
        controlnet.register_to_config(global_pool_conditions=True)
    generator = torch.Generator().manual_seed(seed)
    zeroed = [*controlnet.controlnet_down_blocks, controlnet.controlnet_mid_block,
              controlnet.controlnet_cond_embedding.conv_out]
    with torch.no_grad():
        for conv in zeroed:
            conv.weight.copy_(torch.randn(conv.weight.shape, generator=generator) * gain / conv.weight[0].numel() ** 0.5)
            conv.bias.copy_(torch.randn(conv.bias.shape, generator=generator) * gain * 0.1)
    controlnet.save_pretrained(folder, safe_serialization=True)
    return folder


def build_ip_adapter(folder, base, *, seed: int = 0, projection_dim: int = 24, image_size: int = 32,
                     gain: float = 1.0) -> pathlib.Path:
    """Write a tiny IP-Adapter folder for the SD or SDXL folder `base` and return its path:
    `image_encoder/` (a random `CLIPVisionModelWithProjection`, `projection_dim`-wide image
    embeddings) and `ip_adapter.safetensors` in the checkpoints' own layout, built as
    diffusers' tests build theirs for `load_ip_adapter`: `image_proj.` (the plain IP-Adapter's
    projection to 4 tokens: `proj`, `norm`) and `ip_adapter.{1, 3, 5, ...}.to_k_ip/to_v_ip`
    for each cross-attention processor of the UNet, in its order. Random weights (normal,
    seeded, × `gain` / √fan-in)."""
    from diffusers import UNet2DConditionModel
    from safetensors.torch import save_file
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    folder, base = pathlib.Path(folder), pathlib.Path(base)
    folder.mkdir(parents=True, exist_ok=True)
    unet = UNet2DConditionModel.from_pretrained(base / "unet", low_cpu_mem_usage=False)
    torch.manual_seed(seed)
    encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=32, intermediate_size=37, projection_dim=projection_dim, num_hidden_layers=2,
        num_attention_heads=4, image_size=image_size, patch_size=8, num_channels=3)).eval()
    encoder.save_pretrained(folder / "image_encoder", safe_serialization=True)
    generator = torch.Generator().manual_seed(seed)

    def random(*shape):
        return (torch.randn(shape, generator=generator) * gain / shape[-1] ** 0.5).contiguous()

    cross = int(unet.config.cross_attention_dim)
    state = {"image_proj.proj.weight": random(4 * cross, projection_dim), "image_proj.proj.bias": random(4 * cross),
             "image_proj.norm.weight": 1 + random(cross), "image_proj.norm.bias": random(cross)}
    blocks = list(unet.config.block_out_channels)
    key_id = 1
    for name in unet.attn_processors:
        if name.endswith("attn1.processor"):
            continue
        if name.startswith("mid_block"):
            hidden = blocks[-1]
        elif name.startswith("up_blocks"):
            hidden = blocks[::-1][int(name[len("up_blocks.")])]
        else:
            hidden = blocks[int(name[len("down_blocks.")])]
        state[f"ip_adapter.{key_id}.to_k_ip.weight"] = random(hidden, cross)
        state[f"ip_adapter.{key_id}.to_v_ip.weight"] = random(hidden, cross)
        key_id += 2
    save_file(state, str(folder / "ip_adapter.safetensors"))
    return folder


def _build_flux_controlnet(folder: pathlib.Path, base: pathlib.Path, *, seed: int, gain: float) -> pathlib.Path:
    from diffusers import FluxControlNetModel, FluxTransformer2DModel

    transformer = FluxTransformer2DModel.from_pretrained(base / "transformer", low_cpu_mem_usage=False)
    config = transformer.config
    torch.manual_seed(seed)
    controlnet = FluxControlNetModel.from_transformer(
        transformer, num_layers=1, num_single_layers=1, attention_head_dim=config.attention_head_dim,
        num_attention_heads=config.num_attention_heads).eval()
    generator = torch.Generator().manual_seed(seed)
    zeroed = [*controlnet.controlnet_blocks, *controlnet.controlnet_single_blocks, controlnet.controlnet_x_embedder]
    with torch.no_grad():
        for linear in zeroed:
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) * gain
                                / linear.weight.shape[1] ** 0.5)
            linear.bias.copy_(torch.randn(linear.bias.shape, generator=generator) * gain * 0.1)
    controlnet.save_pretrained(folder, safe_serialization=True)
    return folder


def _build_sd3_controlnet(folder: pathlib.Path, base: pathlib.Path, *, seed: int, gain: float, num_layers: int = 1,
                          force_zeros_for_pooled_projection: bool = True, takes_prompt: bool = True) -> pathlib.Path:
    """An `SD3ControlNetModel` as diffusers' tests build theirs: the base transformer's
    config with `num_layers` (1) blocks, random weights, its zero-initialised layers (the
    per-block projections, the control latents' patch embedding) given random ones.
    `force_zeros_for_pooled_projection`: InstantX's (zeros for the pooled projection,
    unshifted control latents); without it and without `takes_prompt` it is laid out as
    SD3.5's own ControlNets (no text input, the transformer's positional embedding)."""
    from diffusers import SD3ControlNetModel, SD3Transformer2DModel

    config = SD3Transformer2DModel.load_config(base / "transformer")
    torch.manual_seed(seed)
    controlnet = SD3ControlNetModel(
        sample_size=config["sample_size"], patch_size=config["patch_size"], in_channels=config["in_channels"],
        num_layers=num_layers, attention_head_dim=config["attention_head_dim"],
        num_attention_heads=config["num_attention_heads"],
        joint_attention_dim=config["joint_attention_dim"] if takes_prompt else None,
        caption_projection_dim=config["caption_projection_dim"], pooled_projection_dim=config["pooled_projection_dim"],
        out_channels=config["out_channels"], pos_embed_max_size=config["pos_embed_max_size"],
        use_pos_embed=takes_prompt, force_zeros_for_pooled_projection=force_zeros_for_pooled_projection,
    ).eval()
    generator = torch.Generator().manual_seed(seed)
    zeroed = [*controlnet.controlnet_blocks, controlnet.pos_embed_input.proj]
    with torch.no_grad():
        for layer in zeroed:
            fan_in = layer.weight[0].numel()
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator) * gain / fan_in ** 0.5)
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=generator) * gain * 0.1)
    controlnet.save_pretrained(folder, safe_serialization=True)
    return folder
