"""The chunked (plain JAX) and flash (Pallas; interpret mode on this CPU) kernels: outputs and gradients equal
the reference attention (causal, GQA; float32 tightly, bf16 within bf16's rounding), so does a whole train
step of both families, the remat names reach the policies, chunked's memory grows linearly with the sequence,
and bad block sizes are one-line errors. On 8 simulated devices (heads split over `tensor`):
tests/model/test_attention_devices.py, run in a process of its own below."""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, assert_trees_close, loss_and_grads, run_cli, slow_except, xla_flags_with

from jaxscale import train
from jaxscale.config import ConfigError, base_config, kernel_blocks, validate
from jaxscale.model import flash_attention as flash
from jaxscale.model.attention import reference_attention
from jaxscale.model.chunked_attention import chunked_attention, default_key_block
from jaxscale.plan import gpu_plan

HERE = pathlib.Path(__file__).resolve().parent


def _qkv(kv_heads: int, seq: int = 32, batch: int = 1, heads: int = 4, head_dim: int = 16, dtype=jnp.float32):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (batch, seq, heads, head_dim))
    k, v = (jax.random.normal(key, (batch, seq, kv_heads, head_dim)) for key in keys[1:3])
    weights = jax.random.normal(keys[3], q.shape)  # a loss that weighs every output differently
    return tuple(x.astype(dtype) for x in (q, k, v)), weights


def _output_and_grads(kernel, qkv, weights):
    def loss(q, k, v):
        return jnp.sum(kernel(q, k, v).astype(jnp.float32) * weights)

    return jax.jit(kernel)(*qkv), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*qkv)


def _naive(causal: bool):
    """Attention one query head at a time in float64 numpy: query head h reads K/V head h // group."""

    def attend(q, k, v):
        q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
        group = q.shape[2] // k.shape[2]
        seq = q.shape[1]
        out = np.zeros_like(q)
        for b in range(q.shape[0]):
            for h in range(q.shape[2]):
                scores = q[b, :, h] @ k[b, :, h // group].T / np.sqrt(q.shape[-1])
                if causal:
                    scores = np.where(np.tril(np.ones((seq, seq), bool)), scores, -np.inf)
                p = np.exp(scores - scores.max(-1, keepdims=True))
                out[b, :, h] = p / p.sum(-1, keepdims=True) @ v[b, :, h // group]
        return out

    return attend


KERNELS = {
    "chunked": lambda causal, block: functools.partial(chunked_attention, causal=causal, block_k=block),
    "flash": lambda causal, block: functools.partial(flash.flash_attention, causal=causal, block_q=16, block_k=block),
}


@pytest.mark.parametrize("name,kv_heads,causal", [
    ("chunked", 4, True), ("chunked", 2, True), ("chunked", 1, True), ("chunked", 2, False),
    ("flash", 2, True), ("flash", 4, False),
])  # fmt: skip
def test_kernel_equals_reference_in_float32(name, kv_heads, causal):
    """Output against float64 numpy and the reference einsum; gradients (jax.grad) against the reference's."""
    qkv, weights = _qkv(kv_heads)
    kernel = KERNELS[name](causal, 8 if name == "chunked" else 16)  # 4 or 2 key blocks: the loop really runs
    out, grads = _output_and_grads(kernel, qkv, weights)
    ref_out, ref_grads = _output_and_grads(lambda *x: reference_attention(*x, causal, jnp.float32), qkv, weights)
    np.testing.assert_allclose(np.asarray(out), _naive(causal)(*qkv), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-5, atol=1e-5)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert grad.shape == ref_grad.shape  # dk, dv have the K/V heads (flash sums its repeated heads back)
        np.testing.assert_allclose(np.asarray(grad), np.asarray(ref_grad), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("name", ["chunked", "flash"])
def test_kernel_in_bfloat16_is_as_close_to_float32_as_the_reference(name):
    """bf16 inputs (GQA, causal): the kernel's output and gradients are within bf16's rounding of the float32
    answer on the same inputs, no further from it than twice the bf16 reference's own distance (+1e-2)."""
    qkv, weights = _qkv(2, dtype=jnp.bfloat16)
    exact_out, exact_grads = _output_and_grads(
        lambda *x: reference_attention(*x, True, jnp.float32), tuple(x.astype(jnp.float32) for x in qkv), weights
    )
    ref_out, ref_grads = _output_and_grads(lambda *x: reference_attention(*x, True, jnp.float32), qkv, weights)
    out, grads = _output_and_grads(KERNELS[name](True, 8 if name == "chunked" else 16), qkv, weights)
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    for got, ref, exact in zip((out, *grads), (ref_out, *ref_grads), (exact_out, *exact_grads), strict=True):
        got, ref, exact = (np.asarray(x, np.float32) for x in (got, ref, exact))
        scale = np.abs(exact).max()
        assert np.abs(got - exact).max() <= 2 * np.abs(ref - exact).max() + 1e-2 * scale
        np.testing.assert_allclose(got, exact, atol=2e-2 * scale)


def _config(preset: str, attention: str, **model):
    config = base_config(preset, attention)
    config.model.update(dtype="float32", attention=attention, **model)
    validate(config)
    return config


@functools.cache
def _reference_step(preset: str):
    config = _config(preset, "reference")
    params = train.make_init_fn(config)().params
    batch = train.make_batch(jax.random.PRNGKey(1), 4, config.data.seq_len, config.model.vocab_size)
    return params, batch, *loss_and_grads(config, params, batch)


# Each kernel once in the default suite (chunked in llama: GQA and RoPE; flash in gpt), both families and the
# default key block under -m slow.
_MODEL_KERNEL_CASES = [
    (preset, attention, blocks)
    for preset in ("tiny", "tiny-llama")
    for attention, blocks in (
        ("chunked", {"attention_block_k": 8}),
        ("chunked", {}),  # the default key block: tested on the kernel
        ("flash", {"attention_block_q": 16, "attention_block_k": 16}),
    )
]


@pytest.mark.parametrize(
    "preset, attention, blocks",
    slow_except(
        _MODEL_KERNEL_CASES,
        fast=lambda case: (
            case[1:]
            in (("chunked", {"attention_block_k": 8}), ("flash", {"attention_block_q": 16, "attention_block_k": 16}))
            and (case[0] == "tiny-llama") == (case[1] == "chunked")
        ),
        ids=[f"{a}-blocks{len(b)}-{p}" for p, a, b in _MODEL_KERNEL_CASES],
    ),
)
def test_model_loss_and_gradients_equal_the_reference(preset, attention, blocks):
    """The whole model (gpt: 4 heads; llama: 4 query heads on 2 K/V heads, RoPE), float32, dropout off."""
    params, batch, loss, grads = _reference_step(preset)
    config = _config(preset, attention, **blocks)
    kernel_loss, kernel_grads = loss_and_grads(config, params, batch)
    np.testing.assert_allclose(kernel_loss, loss, rtol=1e-6)
    assert_trees_close(kernel_grads, grads, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["chunked", "flash"])
def test_train_step_with_scan_and_remat_equals_the_reference_step(attention):
    """A whole optimizer step (tiny-llama, scanned layers, remat of Attn, 2 minibatches, dropout 0.1):
    the parameters after it and the loss equal the reference step's."""
    states = {}
    for kernel in ("reference", attention):
        config = _config("tiny-llama", kernel, scan_layers=True, remat=("Attn",), dropout_rate=0.1)
        config.data.batch_size = 4
        state = train.make_init_fn(config)()
        batch = train.make_batch(jax.random.PRNGKey(1), 4, config.data.seq_len, config.model.vocab_size)
        states[kernel] = jax.device_get(train.make_train_step(config)(state, train.init_metrics(), batch))
    (state, metrics), (ref_state, ref_metrics) = states[attention], states["reference"]
    np.testing.assert_allclose(metrics["loss_sum"], ref_metrics["loss_sum"], rtol=1e-6)
    assert_trees_close(state.params, ref_state.params, rtol=1e-5, atol=1e-6)


def _saved_names_and_scans(kernel, policy) -> tuple[set, int]:
    """(checkpoint names among the saved residuals, kernel loops in the grad's jaxpr) under jax.checkpoint."""
    qkv, weights = _qkv(2)
    fn = jax.checkpoint(lambda q, k, v: jnp.sum(kernel(q, k, v) * weights), policy=policy)
    text = str(jax.make_jaxpr(jax.grad(fn, argnums=(0, 1, 2)))(*qkv))
    names = {name for name in ("attention_out", "attention_lse") if f"name[name={name}]" in text}
    return names, text


@pytest.mark.parametrize("name,marker,runs", [("chunked", "scan[", (3, 2)), ("flash", "name=mha_forward", (4, 2))])
def test_remat_policy_naming_out_and_lse_skips_the_forward_rerun(name, marker, runs):
    """nothing_saveable reruns the kernel's forward in the backward pass; a policy saving attention_out and
    attention_lse keeps them, and the backward pass runs the backward kernel only. (Flash's jaxpr holds each
    kernel twice, the interpret and the Triton branch of lax.platform_dependent.)"""
    kernel = KERNELS[name](True, 16)
    names, nothing = _saved_names_and_scans(kernel, jax.checkpoint_policies.nothing_saveable)
    assert names == {"attention_out", "attention_lse"}
    saving = jax.checkpoint_policies.save_only_these_names("attention_out", "attention_lse")
    _, saved = _saved_names_and_scans(kernel, saving)
    assert (nothing.count(marker), saved.count(marker)) == runs


def _temp_bytes(kernel, seq: int) -> int:
    shape = jax.ShapeDtypeStruct((1, seq, 4, 32), jnp.float32)
    grad = jax.grad(lambda q, k, v: jnp.sum(kernel(q, k, v)), argnums=(0, 1, 2))
    return jax.jit(grad).lower(shape, shape, shape).compile().memory_analysis().temp_size_in_bytes


def test_chunked_memory_grows_linearly_with_the_sequence_and_the_reference_quadratically():
    """XLA's CPU plan of attention forward + backward (1 x T x 4 heads of 32, float32): from T = 256 to 1024
    chunked's scratch grows 4x (measured 1.75 MB -> 6.88 MB, key blocks of 64) and the reference's, which
    holds [T, T] logits and probabilities, more than 8x (5.5 MB -> 51.4 MB)."""
    chunked = [_temp_bytes(functools.partial(chunked_attention, causal=True, block_k=64), t) for t in (256, 1024)]
    reference = [_temp_bytes(lambda q, k, v: reference_attention(q, k, v, True, jnp.float32), t) for t in (256, 1024)]
    assert 3.5 < chunked[1] / chunked[0] < 4.5, chunked
    assert reference[1] / reference[0] > 8, reference
    assert chunked[1] < reference[1] / 5


@pytest.mark.parametrize("head_dim,seq,itemsize,block", [
    (16, 32, 4, 32), (64, 2048, 2, 128), (128, 2048, 2, 128), (128, 2048, 4, 64), (256, 8192, 2, 64),
    (80, 512, 2, 128), (512, 512, 2, 32), (64, 96, 2, 32), (64, 7, 2, 1),
])  # fmt: skip
def test_default_flash_block_by_head_dim_dtype_and_sequence(head_dim, seq, itemsize, block):
    """Hand-worked defaults: min(128, 32768 / (head_dim padded to a power of two x bytes)), halved until it
    divides the sequence; config validation takes the same default (its smem message names it)."""
    assert flash.default_block(head_dim, seq, itemsize) == block
    config = base_config("tiny", "x")
    block_q = seq & -seq  # the largest power of two dividing seq: valid, and large enough to overflow often
    dtype = "float32" if itemsize == 4 else "bfloat16"
    config.model.update(attention="flash", head_dim=head_dim, hidden_size=4 * head_dim, max_seq_len=seq,
                        dtype=dtype, attention_block_q=block_q)  # fmt: skip
    config.data.seq_len = seq
    need = flash.forward_shared_memory(block_q, block, head_dim, itemsize)
    if need <= flash.SHARED_MEMORY_BYTES:
        validate(config)
        return
    with pytest.raises(ConfigError, match=rf"{need:,} bytes .* or 0 for the default \({block}\)"):
        validate(config)


def test_flash_shared_memory_matches_the_number_xla_reported():
    """XLA's deviceless H100 compile refused head_dim 256, blocks of 128, bf16, with "requested 327680", and
    head_dim 128, block_q 64, block_k 256 with "requested 278528" (both within `available: 232448`)."""
    assert flash.forward_shared_memory(128, 128, 256, 2) == 327680
    assert flash.forward_shared_memory(64, 256, 128, 2) == 278528
    assert flash.forward_shared_memory(128, 128, 128, 2) <= flash.SHARED_MEMORY_BYTES  # compiled


def _compiled_forward_shared_memory(target_name: str, head_dim: int, block_q: int, block_k: int, dump) -> int:
    """XLA's shared memory for the flash forward kernel in a deviceless compile for the target (bf16, 1 x 256 x 2
    heads): the thunk sequence's `shared_memory` if it compiles, the `requested` bytes of its refusal if not."""
    import re

    from jaxscale.plan import target_compile, targets

    target = targets.get_target(target_name)
    sharding = target_compile.target_sharding(targets.target_config_text(target))
    x = jax.ShapeDtypeStruct((1, 256, 2, head_dim), jnp.bfloat16, sharding=sharding)
    kernel = jax.jit(lambda q, k, v: flash.flash_attention(q, k, v, True, block_q, block_k))
    try:
        kernel.lower(x, x, x).compile(compiler_options={"xla_dump_to": str(dump)})
    except Exception as error:  # noqa: BLE001 - XLA's refusal names the bytes it was asked for
        return -int(re.search(r"Shared memory size limit exceeded: requested (\d+)", str(error)).group(1))
    text = "".join(path.read_text() for path in pathlib.Path(dump).glob("*thunk_sequence.txt"))
    return int(re.search(r"mha_forward grid[^\n]*shared_memory: (\d+)", text).group(1))


@pytest.mark.skipif(gpu_plan.missing_extra() is not None, reason="needs the gpu-plan extra")
@pytest.mark.parametrize("target,compute_capability", [("rtx4090", (8, 9)), ("h100", (9, 0))])
@pytest.mark.parametrize("head_dim,block_q,block_k", [(128, 128, 128), (128, 64, 32), (256, 64, 64)])
def test_flash_shared_memory_is_what_the_deviceless_compile_asks_for_on_each_target(
    tmp_path, target, compute_capability, head_dim, block_q, block_k
):
    """The rule against XLA's own number, per architecture: blocks of 128 at head_dim 128 take 98,304 bytes on
    Ada (so the committed RTX 4090 plans compiled within its 101,376) and 163,840 on Hopper; head_dim 256 with
    blocks of 64 is refused on Ada (106,496 requested) and compiles on Hopper; the rule says which."""
    got = _compiled_forward_shared_memory(target, head_dim, block_q, block_k, tmp_path)
    need = kernel_blocks.forward_shared_memory(block_q, block_k, head_dim, 2, compute_capability)
    fits = need <= kernel_blocks.shared_memory_limit(compute_capability)
    assert (abs(got), got > 0) == (need, fits)


FLASH, CHUNKED, DIVISORS = (
    {"attention": "flash"},
    {"attention": "chunked"},
    "allowed: 0 (default) or 1, 2, 4, 8, 16, 32",
)


@pytest.mark.parametrize("model,seq,field,hint", [
    ({**FLASH, "attention_block_q": 48}, 96, "model.attention_block_q", DIVISORS),
    ({**FLASH, "attention_block_k": 64}, 96, "model.attention_block_k", "power of two dividing data.seq_len=96"),
    ({**FLASH, "head_dim": 256, "hidden_size": 512, "attention_block_q": 128, "attention_block_k": 128}, 512,
     "model.attention_block_q", "327,680 bytes of shared memory"),
    ({**CHUNKED, "attention_block_k": 5}, 32, "model.attention_block_k", DIVISORS),
    ({**CHUNKED, "attention_block_k": -1}, 32, "model.attention_block_k", "integer >= 0"),
    ({"attention": "flashy"}, 32, "model.attention", "reference, xla, cudnn, chunked, flash"),
])  # fmt: skip
def test_bad_attention_fields_name_the_field_and_what_would_work(model, seq, field, hint):
    config = base_config("tiny", "x")
    config.model.update(max_seq_len=512, **model)
    config.data.seq_len = seq
    with pytest.raises(ConfigError) as error:
        validate(config)
    message = str(error.value)
    assert message.startswith(f"{field}:") and hint in message and "\n" not in message


def test_bad_block_size_on_the_command_line_is_one_line_and_exit_2():
    done = run_cli("jaxscale.run", "--config", "configs/bf16.py:tiny", "--config.model.attention=flash",
                   "--config.model.attention_block_q=12", "--plan")  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if "attention_block_q" in line]
    assert len(lines) == 1 and "power of two dividing data.seq_len=32" in lines[0] and "Traceback" not in done.stderr


def test_chunked_default_key_block_divides_the_sequence():
    assert [default_key_block(t) for t in (32, 512, 8192, 96, 100, 127)] == [32, 128, 128, 96, 100, 127]


@pytest.mark.slow
def test_kernels_split_over_tensor_on_8_simulated_cpu_devices():
    """Runs tests/model/test_attention_devices.py with 8 simulated CPU devices (a flag XLA reads at start).
    Slow: 3.5 min on the shared 2-core machine (flash's interpret mode in shard_map, two 4x1x2 steps)."""
    env = dict(os.environ, XLA_FLAGS=xla_flags_with("--xla_force_host_platform_device_count=8"), JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO))  # fmt: skip
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "test_attention_devices.py")]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]
