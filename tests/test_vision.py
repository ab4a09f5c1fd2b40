"""The DeepSeek-VL image side (dsjax.model.vision) against transformers' `SiglipVisionModel` and
`DeepseekVLForConditionalGeneration`, DeepSeek-VL2's unfold, and the unsharded model."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from transformers import (DeepseekVLConfig, DeepseekVLForConditionalGeneration,
                          SiglipImageProcessorPil, SiglipVisionConfig, SiglipVisionModel)

from dsjax import sharding
from dsjax.convert import model_config_from_hf
from dsjax.convert.vision_rules import vision_plan, vl_tensor_plan
from dsjax.model import Transformer
from dsjax.model.vision import (DownsampleMlp, SiglipTower, VisionSpec, insert_image_features,
                                pixel_unshuffle)

IMAGE, PATCH = 16, 4  # a 4 x 4 patch grid: 16 placeholder tokens per image
VISION_HF = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 image_size=IMAGE, patch_size=PATCH, num_channels=3, layer_norm_eps=1e-6)
TEXT_HF = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=128, rms_norm_eps=1e-6)
IMAGE_TOKEN = 127
SPEC = VisionSpec(image_size=IMAGE, patch_size=PATCH, hidden_size=32, num_layers=2, num_heads=4,
                  mlp_dim=48, image_token_id=IMAGE_TOKEN)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random; norm scales around 1 (HF initialises them to 1, biases to 0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("norm" in name or "layernorm" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


def _transfer(state_dict: dict, plan: dict, abstract: dict) -> dict:
    """dsjax params (the layout `abstract` declares) from an HF state dict via a conversion
    plan; every leaf must be filled."""
    leaves = {tuple(k.key for k in path): np.full(x.shape, np.nan, np.float32)
              for path, x in jax.tree_util.tree_flatten_with_path(nn.unbox(abstract))[0]}
    for name, (rule, index, _) in plan.items():
        dest = leaves[rule.leaf] if index is None else leaves[rule.leaf][index]
        dest[...] = rule.to_dsjax(state_dict[name].float().numpy(), dest.shape)
    assert all(np.isfinite(v).all() for v in leaves.values()), "a leaf was left unfilled"
    tree: dict = {}
    for path, value in leaves.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = jnp.asarray(value)
    return tree


def _eager(model):
    model.config._attn_implementation = "eager"
    return model.eval()


def test_tower_matches_siglip_vision_model():
    hf = _eager(SiglipVisionModel(SiglipVisionConfig(**VISION_HF)))
    _randomise(hf, 0)
    tower = SiglipTower(**SPEC.tower_fields())
    x = np.random.default_rng(0).normal(size=(3, IMAGE, IMAGE, 3)).astype(np.float32)
    abstract = jax.eval_shape(tower.init, jax.random.key(0), x)["params"]
    plan = vision_plan(SPEC, "")
    assert not any(n.startswith("head.") for n in plan)  # the pooling head is not ours
    params = _transfer(hf.state_dict(), plan, {"vision_tower": abstract})["vision_tower"]
    with torch.no_grad():
        want = hf(torch.from_numpy(x.transpose(0, 3, 1, 2))).last_hidden_state.numpy()
    got = np.asarray(tower.apply({"params": params}, x))
    assert got.shape == (3, (IMAGE // PATCH) ** 2, 32)
    # float32, outputs of a LayerNorm (std ~1): summation order only; measured 1.7e-6.
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _vl_pair(seed: int = 1):
    cfg_hf = DeepseekVLConfig(vision_config=dict(model_type="siglip_vision_model", **VISION_HF),
                              text_config=TEXT_HF, image_token_id=IMAGE_TOKEN,
                              tie_word_embeddings=False)
    hf = _eager(DeepseekVLForConditionalGeneration(cfg_hf))
    _randomise(hf, seed)
    cfg = model_config_from_hf(cfg_hf.text_config.to_dict())
    return hf, cfg


def _rows(rng, pattern):
    """Tokens [B, S]: random text with a run of 16 placeholders per image at the given starts."""
    tokens = rng.integers(0, IMAGE_TOKEN, (len(pattern), 48))
    for r, starts in enumerate(pattern):
        for s in starts:
            tokens[r, s:s + 16] = IMAGE_TOKEN
    return tokens


def test_vl_model_matches_deepseek_vl_logits():
    hf, cfg = _vl_pair()
    model = Transformer(cfg, vision=SPEC)
    rng = np.random.default_rng(2)
    pixels = rng.integers(0, 256, (2, 2, IMAGE, IMAGE, 3)).astype(np.uint8)
    # Row 0 holds two images (slots 0, 1); row 1 one image in slot 1, slot 0 is empty (junk
    # pixels that must not show). HF takes the images in order: row 0's two, then row 1's.
    mask = np.array([[True, True], [False, True]])
    tokens = _rows(rng, [(3, 25), (10,)])
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.asarray(tokens))["params"]
    params = _transfer(hf.state_dict(), vl_tensor_plan(cfg, SPEC), abstract)
    got = np.asarray(model.apply({"params": params}, jnp.asarray(tokens), pixels_BMHWC=pixels,
                                 image_mask_BM=mask))
    images = [pixels[0, 0], pixels[0, 1], pixels[1, 1]]
    # SigLIP's own preprocessing (rescale 1/255, mean = std = 0.5), sizes already right.
    pixel_values = SiglipImageProcessorPil()(images=images, do_resize=False,
                                             return_tensors="np").pixel_values
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(tokens),
                  pixel_values=torch.from_numpy(pixel_values)).logits.numpy()
    # float32 logits of std ~1.1: summation order only; measured max |diff| 7e-6.
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # The images matter: without pixels the placeholders stay token embeddings.
    text_only = np.asarray(model.apply({"params": params}, jnp.asarray(tokens)))
    assert np.abs(text_only - want).max() > 1e-2


def test_text_only_calls_are_the_text_model():
    """A vision model without pixels is the text model: same LM param names, same logits."""
    _, cfg = _vl_pair()
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 128, (2, 20)))
    params = Transformer(cfg, vision=SPEC).init(jax.random.key(4), tokens)["params"]
    text = Transformer(cfg).init(jax.random.key(4), tokens)["params"]
    lm = {k: v for k, v in params.items() if k not in ("vision_tower", "projector")}
    assert set(params) - set(lm) == {"vision_tower", "projector"}
    assert jax.tree.structure(lm) == jax.tree.structure(text)
    np.testing.assert_array_equal(
        Transformer(cfg, vision=SPEC).apply({"params": params}, tokens),
        Transformer(cfg).apply({"params": nn.unbox(lm)}, tokens))


def test_insert_image_features_by_hand():
    x = jnp.zeros((2, 6, 1))
    tokens = jnp.array([[5, 9, 9, 1, 9, 2], [9, 3, 3, 3, 3, 9]])
    feats = jnp.array([[[10.], [11.], [12.]], [[20.], [21.], [22.]]])
    out = np.asarray(insert_image_features(x, tokens, feats, 9))[..., 0]
    np.testing.assert_array_equal(out, [[0, 10, 11, 0, 12, 0], [20, 0, 0, 0, 0, 21]])


def _vl2_unfold(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek-VL2's downsample_mlp_gelu preprocessing (ratio 2), transcribed."""
    bs, hw, dim = x.shape
    h = w = int(hw ** 0.5)
    pad = 2 - h % 2 if h % 2 else 0
    x = x.reshape(bs, h, w, dim)
    if pad > 0:
        x = F.pad(x, (0, 0, 0, pad, 0, pad), "constant", 0)
    x = x.permute(0, 3, 1, 2)
    x = F.unfold(x, kernel_size=2, stride=2, padding=0)
    return x.permute(0, 2, 1)


@pytest.mark.parametrize("side", [4, 3])  # an odd grid is padded, as VL2 does
def test_pixel_unshuffle_is_vl2_unfold(side):
    x = np.random.default_rng(side).normal(size=(2, side * side, 5)).astype(np.float32)
    want = _vl2_unfold(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(np.asarray(pixel_unshuffle(jnp.asarray(x))), want)


def test_downsample_mlp_is_unfold_then_linear_gelu_linear():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(2, 16, 6)).astype(np.float32)
    module = DownsampleMlp(out_dim=8)
    params = nn.unbox(module.init(jax.random.key(0), x)["params"])
    torch_mlp = torch.nn.Sequential(torch.nn.Linear(24, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    with torch.no_grad():
        torch_mlp[0].weight.copy_(torch.from_numpy(np.array(params["linear1"]).T))
        torch_mlp[0].bias.copy_(torch.from_numpy(rng.normal(size=8).astype(np.float32)))
        torch_mlp[2].weight.copy_(torch.from_numpy(np.array(params["linear2"]).T))
        torch_mlp[2].bias.copy_(torch.from_numpy(rng.normal(size=8).astype(np.float32)))
        want = torch_mlp(_vl2_unfold(torch.from_numpy(x))).numpy()
    params = {**params, "bias1": jnp.asarray(torch_mlp[0].bias.detach().numpy()),
              "bias2": jnp.asarray(torch_mlp[2].bias.detach().numpy())}
    got = np.asarray(module.apply({"params": params}, x))
    assert got.shape == (2, 4, 8)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # float32, 24-term dots


def test_sharded_vl_logits_match_single_device():
    _, cfg = _vl_pair()
    # A large init, so logits have std ~1 and a wrong shard would show far above 1e-5.
    model = Transformer(dataclasses.replace(cfg, init_std=0.2),
                        vision=dataclasses.replace(SPEC, init_std=0.2))
    rng = np.random.default_rng(6)
    tokens = jnp.asarray(_rows(rng, [(2, 20), (30,), (), (5,)]))
    pixels = jnp.asarray(rng.integers(0, 256, (4, 2, IMAGE, IMAGE, 3)).astype(np.uint8))
    mask = jnp.asarray([[True, True], [True, False], [False, False], [False, True]])
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2, 1, 1), sharding.MESH_AXES)
    rules = sharding.logical_rules()
    abstract = jax.eval_shape(model.init, jax.random.key(7), tokens)["params"]
    shardings = sharding.param_shardings(abstract, mesh, rules)
    params = jax.jit(lambda k: nn.unbox(model.init(k, tokens)["params"]),
                     out_shardings=shardings)(jax.random.key(7))
    q = params["vision_tower"]["layers"]["q"]
    assert tuple(q.sharding.spec) == (None, None, "tensor", None)  # [layers, D, H, K]
    assert tuple(params["projector"]["linear1"].sharding.spec) == (None, "tensor")
    apply = lambda p, t, x, m: model.apply({"params": p}, t, pixels_BMHWC=x, image_mask_BM=m)
    data = NamedSharding(mesh, P("data"))
    with sharding.activate(mesh, rules):
        sharded = jax.jit(apply, in_shardings=(shardings, data, data, data))(
            params, tokens, pixels, mask)
    single = jax.jit(apply)(jax.device_get(params), tokens, pixels, mask)
    # float32: only the summation order differs between meshes (invariant 1); measured 8.6e-6.
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(single), rtol=1e-5, atol=1e-5)


def test_gradients_reach_filled_slots_only():
    """Training signal: the loss moves the tower, projector and filled slots' pixels, never an
    empty slot's pixels."""
    _, cfg = _vl_pair()
    model = Transformer(cfg, vision=SPEC)
    rng = np.random.default_rng(8)
    tokens = jnp.asarray(_rows(rng, [(4,), (20,)]))
    pixels = jnp.asarray(rng.uniform(0, 255, (2, 2, IMAGE, IMAGE, 3)), jnp.float32)
    mask = jnp.asarray([[False, True], [True, False]])
    params = model.init(jax.random.key(9), tokens)["params"]
    loss = lambda p, x: jnp.sum(model.apply({"params": p}, tokens, pixels_BMHWC=x,
                                            image_mask_BM=mask) ** 2)
    g_params, g_pixels = jax.grad(loss, argnums=(0, 1))(params, pixels)
    for group in ("vision_tower", "projector"):
        leaves = jax.tree.leaves(g_params[group])
        assert all(np.isfinite(g).all() for g in leaves)
        assert all(np.abs(g).max() > 0 for g in leaves), group
    per_slot = np.abs(np.asarray(g_pixels)).sum(axis=(2, 3, 4))
    assert (per_slot[~np.asarray(mask)] == 0).all() and (per_slot[np.asarray(mask)] > 0).all()
