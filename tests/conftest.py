"""Shared test helpers: real config files, shrunk to the `tiny` preset; a private cache directory."""

from __future__ import annotations

import atexit
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

# Before jaxscale is imported: the tests (and the processes they start) never read or write the user's
# cache (~/.cache/jaxscale: compiled programs, plans, CPU rooflines), and compile afresh unless a test
# turns the compilation cache on in a directory of its own (tests/test_compile_cache.py).
os.environ["JAXSCALE_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxscale-test-cache-")
atexit.register(shutil.rmtree, os.environ["JAXSCALE_CACHE_DIR"], ignore_errors=True)
os.environ["JAXSCALE_COMPILATION_CACHE"] = "0"
# On a GPU, tests and the runs they start share the device: no process takes 75% of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# The tests (and the processes they start) compile with LLVM's optimizations off: a third less time for the
# default suite on 2 cores (tests/train/test_step.py and tests/model/test_gpt.py serially: 308 s -> 199 s). XLA's
# HLO passes, buffer assignment and so every program, memory plan and FLOP count the tests check are the same;
# only the machine code runs slower, and no test asserts a speed.
# And with XLA's CPU fusion emitters off (its legacy loop emitters): about a third less CPU for the whole default suite
# again (README's command on 2 cores: 22 min 31 s of user CPU -> 15 min 12 s). The GPU-target plans are not the CPU
# backend's and do not change; the CPU plans' temporaries move a little (no test's tolerance is that narrow), and the
# few tests whose claim is the default CPU program itself (bit-for-bit equality of two programs, JAX's one-second
# threshold for caching a compile) run it in a child process without the flag (`with_default_cpu_codegen`).
# A test whose cost is running steps, not compiling them (the :cpu preset's 300 steps of learning), runs in a child
# with XLA's CPU defaults, LLVM's optimizations on (`with_optimized_cpu_codegen`): under the two flags its steps took
# 1,425 s in `pytest -m slow` on a fresh clone; alone in such a child, 483 s.
LLVM_O0 = "--xla_backend_optimization_level=0"
LEGACY_CPU_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
DEFAULT_CODEGEN = "JAXSCALE_TEST_DEFAULT_CPU_CODEGEN"  # set in such a child: it keeps XLA's default emitters
OPTIMIZED_CODEGEN = "JAXSCALE_TEST_OPTIMIZED_CPU_CODEGEN"  # set in such a child: every XLA CPU default, LLVM optimizing
_TEST_FLAGS = {
    OPTIMIZED_CODEGEN: (),
    DEFAULT_CODEGEN: (LLVM_O0,),
    None: (LLVM_O0, LEGACY_CPU_EMITTERS),
}
_CODEGEN = next((name for name in (OPTIMIZED_CODEGEN, DEFAULT_CODEGEN) if os.environ.get(name)), None)
TEST_XLA_FLAGS = " ".join(_TEST_FLAGS[_CODEGEN])
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()


def _codegen_env(codegen: str) -> dict[str, str]:
    """This process's environment for a child that compiles with `codegen`'s flags (_TEST_FLAGS) in place of ours."""
    ours = set(_TEST_FLAGS[None])
    flags = [f for f in os.environ["XLA_FLAGS"].split() if f not in ours] + list(_TEST_FLAGS[codegen])
    return dict(os.environ, XLA_FLAGS=" ".join(flags), **{codegen: "1"})


def default_cpu_codegen_env() -> dict[str, str]:
    """This process's environment for a child that compiles with XLA's default CPU emitters."""
    return _codegen_env(DEFAULT_CODEGEN)


def _in_child(request, codegen: str, timeout_s: int) -> bool:
    """True where this test runs its body here, in a child compiling with `codegen`'s flags; elsewhere it runs the
    test in such a child, asserts that it passed, and returns False (the caller returns)."""
    if os.environ.get(codegen):
        return True
    repo = pathlib.Path(__file__).resolve().parents[1]
    path = os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-m", "slow or not slow",
         request.node.nodeid],
        cwd=repo, env=dict(_codegen_env(codegen), PYTHONPATH=path), capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]
    return False


def with_default_cpu_codegen(request) -> bool:
    """True where this test runs its body here with XLA's default CPU emitters (a child this function started);
    elsewhere it runs the test in such a child, asserts that it passed, and returns False (the caller returns)."""
    return _in_child(request, DEFAULT_CODEGEN, timeout_s=900)


def with_optimized_cpu_codegen(request, timeout_s: int = 3600) -> bool:
    """As with_default_cpu_codegen, with every XLA CPU default (LLVM's optimizations on too): for a test whose time
    is its steps' execution, not their compile."""
    return _in_child(request, OPTIMIZED_CODEGEN, timeout_s)


def xla_flags_with(flag: str) -> str:
    """This process's XLA_FLAGS (the tests' own, above) plus `flag`, for a child process's environment."""
    return f"{os.environ['XLA_FLAGS']} {flag}"


from jaxscale.config import load_config_file  # noqa: E402  (importing jaxscale sets the backend environment)

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


def load_config(name: str, preset: str = "tiny"):
    """get_config(preset) of configs/<name>.py, the same function the command line calls."""
    return load_config_file(CONFIGS / f"{name}.py", preset)


# The named remat policies beyond JAX's own and save_qkv_proj (jaxscale.config.remat_policies.POLICIES), which each
# family's model tests run against the plain model with the reference and the chunked kernel.
NAMED_POLICIES = ("save_out_proj", "save_dot_with_context_except_mlp", "minimal_flash", "selective_op",
                  "qkv_proj_offloaded")  # fmt: skip


def doc_table(doc: str, header_start: str) -> list[list[str]]:
    """The cells (bold marks stripped) of the table in docs/<doc> whose header row starts with `header_start`."""
    lines = [line.strip() for line in (REPO / "docs" / doc).read_text().splitlines()]  # a table in a list is indented
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().strip("*") for cell in line.strip("|").split("|")])
    return rows


def named_policy_cases(fast: set[tuple[str, str]]) -> list:
    """(policy, attention) for every NAMED_POLICIES x (reference, chunked); the pairs not in `fast` under -m slow."""
    return [
        (policy, kernel) if (policy, kernel) in fast else pytest.param(policy, kernel, marks=pytest.mark.slow)
        for policy in NAMED_POLICIES
        for kernel in ("reference", "chunked")
    ]


def slow_except(cases: list, fast, ids: list[str] | None = None) -> list:
    """pytest params of `cases`, those for which `fast(case)` is false marked slow: the default suite keeps the
    fast ones (at least one per claim), -m slow runs all. A case that is a tuple is spread over the arguments."""
    params = []
    for i, case in enumerate(cases):
        values = case if isinstance(case, tuple) else (case,)
        marks = () if fast(case) else (pytest.mark.slow,)
        params.append(pytest.param(*values, marks=marks, id=None if ids is None else ids[i]))
    return params


def run_cli(*args: str, cwd: pathlib.Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Runs `python -m <args>` in a fresh process, as a user would."""
    # The checkout first, then the caller's own PYTHONPATH: a GPU machine that runs the lab from its source tree
    # brings its missing packages on PYTHONPATH (docs/gpu.md), and the runs a test starts need them too.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=cwd or REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def tiny_config():
    return load_config


@pytest.fixture(scope="session")
def pydoc_text(tmp_path_factory) -> pathlib.Path:
    """Python's pydoc topics (real English, ~0.5 MB) as a text file."""
    from jaxscale.data import corpus

    return corpus.write_pydoc_text(tmp_path_factory.mktemp("pydoc") / "pydoc.txt")


@pytest.fixture(scope="session")
def pydoc_bytes(pydoc_text, tmp_path_factory) -> pathlib.Path:
    """The pydoc text prepared with the bytes tokenizer (vocab 256): a directory for data.path."""
    from jaxscale.data import prepare_tokens

    return prepare_tokens([pydoc_text], tmp_path_factory.mktemp("prepared") / "bytes", progress=False).directory


def write_counting_tokens(directory: pathlib.Path, train: int, validation: int = 64) -> pathlib.Path:
    """A prepared directory whose token i is i (uint16): a window shows where it starts."""
    import json

    import numpy as np

    from jaxscale.data.manifest import FORMAT, MANIFEST

    directory.mkdir(parents=True)
    np.arange(train, dtype=np.uint16).tofile(directory / "train.bin")
    np.arange(validation, dtype=np.uint16).tofile(directory / "validation.bin")
    raw = {
        "format": FORMAT, "tokenizer": "bytes", "vocab_size": 2**16, "dtype": "uint16",
        "splits": {"train": {"file": "train.bin", "tokens": train},
                   "validation": {"file": "validation.bin", "tokens": validation}},
    }  # fmt: skip
    (directory / MANIFEST).write_text(json.dumps(raw))
    return directory


def text_config(name: str, preset: str, data_path: pathlib.Path, **train_fields):
    """configs/<name>.py at `preset` on prepared text: data.source=text, model.vocab_size from the manifest."""
    from jaxscale.data import read

    config = load_config(name, preset)
    config.data.source, config.data.path = "text", str(data_path)
    config.model.vocab_size = read(data_path).vocab_size
    config.train.update(train_fields)
    return config


# The suite's longest tests, run first: xdist hands each worker a run of consecutive tests, and a long test left to the
# end of the collection keeps one worker busy while the others have run out of tests (the 8-device mesh test, ~60 s
# under the suite's load, once ended the suite a minute after the other worker had finished).
LONGEST_FIRST = ("tests/train/test_sharding.py::test_meshes_equal_one_device_on_8_simulated_cpu_devices",)


def pytest_collection_modifyitems(config, items):
    """LONGEST_FIRST's tests go to the front (the order is otherwise kept); GPU tests are skipped (not deleted)
    where JAX has no GPU backend."""
    import jax

    items.sort(key=lambda item: not item.nodeid.split("[")[0].endswith(LONGEST_FIRST))
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU backend")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# GPU-target plans (jaxscale.plan.target_compile.compile_for_target with a GEMM mode, in a test process or in the plan
# child it waits for) keep their kernels' machine code in XLA's kernel cache, a file per target in this process's
# private cache directory: a deviceless compile of the tiny model assembles its ~130 kernels with a ptxas process each
# (a third of its time, measured by strace), and the tiny configs' plans share most kernels, so a later plan of the
# same target is 2-3x faster. One file per target: XLA's cache does not tell targets apart, and a kernel compiled for
# an H100 reused for an RTX 4090 skips the 4090's own shared-memory check (tests/model/test_attention.py caught it).
# Checked on six plans (two targets, both GEMM modes, FSDP on 2 GPUs, flash attention, FP8), with the cache cold and
# warm: every memory figure, collective, kernel and the whole compiled HLO text equal those without it; only the
# assembling of machine code already assembled is skipped. Other processes (a sweep's runs) compile without it.
_KERNEL_CACHE_DIR = pathlib.Path(os.environ["JAXSCALE_CACHE_DIR"]) / "xla_gpu_kernels"


def _kernel_cache(target_config_text: str) -> dict[str, str | bool]:
    """XLA's options for the kernel cache file of this target (see above)."""
    import hashlib

    _KERNEL_CACHE_DIR.mkdir(parents=True, exist_ok=True)
    path = _KERNEL_CACHE_DIR / f"{hashlib.sha256(target_config_text.encode()).hexdigest()[:16]}.bin"
    return {"xla_gpu_kernel_cache_file": str(path), "xla_gpu_enable_llvm_module_compilation_parallelism": True}


@pytest.fixture(autouse=True, scope="session")
def _target_plans_reuse_their_kernels():
    """compile_for_target, and the plan child's, with the kernel cache of the target's own file, for the session."""
    from jaxscale.plan import gpu_plan, target_compile

    compile_for_target, gemm_options = target_compile.compile_for_target, target_compile.GEMM_OPTIONS
    compile_in_subprocess = gpu_plan.compile_in_subprocess

    def in_process(config, target_config_text, devices=1, gemm=None, hlo_path=None):
        cache = _kernel_cache(target_config_text)
        target_compile.GEMM_OPTIONS = {mode: {**options, **cache} for mode, options in gemm_options.items()}
        try:
            return compile_for_target(config, target_config_text, devices, gemm, hlo_path)
        finally:
            target_compile.GEMM_OPTIONS = gemm_options

    def in_child(config, config_text, gemm, *args, **kwargs):
        flags = os.environ["XLA_FLAGS"]  # the child's options (its environment; this process read its own at start)
        cache = " ".join(f"--{name}={'true' if value is True else value}" for name, value in
                         _kernel_cache(config_text).items())  # fmt: skip
        os.environ["XLA_FLAGS"] = f"{flags} {cache}"
        try:
            return compile_in_subprocess(config, config_text, gemm, *args, **kwargs)
        finally:
            os.environ["XLA_FLAGS"] = flags

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(target_compile, "compile_for_target", in_process)
        patch.setattr(gpu_plan, "compile_in_subprocess", in_child)
        yield


_LOCAL_PLANS: dict[str, dict] = {}  # config JSON -> fit_search.local_planner's row, for local_plans_once


@pytest.fixture
def local_plans_once(monkeypatch):
    """fit_search.local_planner (the fit's CPU compile of a config's step) compiling each config once a test process:
    the tests of tests/test_fit.py, tests/plan/test_fit_levers.py and test_fit_search.py ask for the same plans again
    (the tiny model's Block remat at minibatch 1 is compiled by four of them), ~2 s a compile on 2 cores. Each caller
    gets its own copy of the row; the rows are the compiler's, as they were."""
    from jaxscale.plan import fit_search

    compile_plan = fit_search.local_planner

    def once(config):
        key = config.to_json_best_effort(sort_keys=True)
        if key not in _LOCAL_PLANS:
            _LOCAL_PLANS[key] = compile_plan(config)
        return dict(_LOCAL_PLANS[key])

    monkeypatch.setattr(fit_search, "local_planner", once)


def loss_and_grads(config, params, batch):
    """Deterministic (dropout off) loss and gradients of `config`'s model at `params`, jitted."""
    import jax

    from jaxscale import train

    config.model.dropout_rate = 0.0
    apply_fn = train.make_model(config).apply

    def loss_fn(p):
        return train.next_token_loss(p, apply_fn, batch, jax.random.PRNGKey(0))[0]

    return jax.jit(jax.value_and_grad(loss_fn))(params)


def stack_layers(params: dict, num_layers: int) -> dict:
    """Unrolled params (block_0 ... block_{L-1}) in the layout of a scan_layers=True model (stacked on axis 0)."""
    import jax
    import jax.numpy as jnp

    stacked = [params["transformer"][f"block_{i}"] for i in range(num_layers)]
    return {**params, "transformer": {"blocks": jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *stacked)}}


def assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6):
    """Same tree structure, and every leaf allclose."""
    import jax
    import numpy as np

    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
    for a, e in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


def train_losses(config, steps: int):
    """(per-step losses, final state) of `config` trained `steps` steps on four random-token batches in turn: the
    training loop the precision tests (FP8, 8-bit state) hold to a band of their baseline's."""
    import jax
    import numpy as np

    from jaxscale import train

    state, step, losses = jax.jit(train.make_init_fn(config))(), train.make_train_step(config), []
    for i in range(steps):
        batch = train.make_batch(jax.random.PRNGKey(i % 4), config.data.batch_size, config.data.seq_len,
                                 config.model.vocab_size)  # fmt: skip
        state, metrics = step(state, train.init_metrics(), batch)
        losses.append(float(metrics["loss_sum"] / metrics["tokens"]))
    return np.asarray(losses), state


def np_blockwise_quantize(x: np.ndarray, code: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Block-wise quantization (Dettmers et al., arXiv 2110.02861, section 2.1; QLoRA's NF4 the same way) in NumPy,
    the independent reference of jaxscale.train.quantized_state and jaxscale.model.nf4: per block N_b = max |x_b|,
    per element argmin_j |code_j - x / N_b| (float64 distances; an all-zero block: N_b = 0, the code of 0)."""
    flat = np.asarray(x, np.float32).reshape(-1)
    codes, absmax = np.empty(flat.size, np.int64), []
    for start in range(0, flat.size, block):
        part = flat[start : start + block]
        n_b = np.float32(np.abs(part).max())
        absmax.append(n_b)
        normalized = part / n_b if n_b > 0 else np.zeros_like(part)
        distance = np.abs(normalized.astype(np.float64)[:, None] - code.astype(np.float64)[None, :])
        codes[start : start + block] = np.argmin(distance, axis=1)
    return codes, np.asarray(absmax, np.float32)


def bf16_shapes_in_gradient_step(config) -> set[tuple[int, ...]]:
    """The shapes of every bfloat16 value the traced gradient step of `config` holds (its jaxpr walked into every
    sub-jaxpr: scan bodies and their transposes), with 2 minibatches; what the NF4 tests look for a dequantized
    stacked kernel among (a residual kept for the backward pass would be one)."""
    import jax
    import jax.numpy as jnp

    from jaxscale import train

    state = jax.eval_shape(train.make_init_fn(config))
    jaxpr = jax.make_jaxpr(lambda s, b: train.batch_gradients(s, b, jax.random.PRNGKey(0), 2, "scan"))(
        state, train.batch_shape(config)
    )
    shapes: set[tuple[int, ...]] = set()

    def walk(jx):
        for eqn in jx.eqns:
            for var in (*eqn.invars, *eqn.outvars):
                aval = getattr(var, "aval", None)
                if aval is not None and getattr(aval, "dtype", None) == jnp.bfloat16:
                    shapes.add(tuple(aval.shape))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    return shapes


def nf4_dequantized_states(state):
    """From a QLoRA state: (its twin whose frozen NF4 weights are dequantized to bfloat16, the state itself), both
    with every lora_b set to the same random values (adapters after some training), for the NF4 tests that compare
    a 4-bit base with the bf16 base it dequantizes to."""
    import jax
    import jax.numpy as jnp
    from flax import traverse_util

    from jaxscale.model import nf4

    def is_nf4(x) -> bool:
        return isinstance(x, nf4.Nf4Weight)

    frozen = jax.tree_util.tree_map(lambda w: nf4.dequantize(w, jnp.bfloat16) if is_nf4(w) else w, state.frozen,
                                    is_leaf=is_nf4)  # fmt: skip
    flat = traverse_util.flatten_dict(state.params, sep="/")
    keys = iter(jax.random.split(jax.random.PRNGKey(3), len(flat)))
    flat = {k: 0.05 * jax.random.normal(next(keys), v.shape) if k.endswith("lora_b") else v for k, v in flat.items()}
    params = traverse_util.unflatten_dict(flat, sep="/")
    return state.replace(params=params, frozen=frozen), state.replace(params=params)
