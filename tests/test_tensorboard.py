"""The real TensorBoard server on a run captured here (on text, with validation): the profile plugin is active,
lists the run by name, and serves the trace viewer's (with the input wait) and memory viewer's data for it; the
scalars plugin serves its training and validation loss; `python -m jaxscale.tensorboard` prints its URL."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import urllib.parse

import pytest

from jaxscale import tensorboard
from jaxscale.tensorboard import fetch, fetch_json

REPO = pathlib.Path(__file__).resolve().parents[1]
RUN_NAME = "tb_tiny"


@pytest.fixture(scope="module")
def logdir(tmp_path_factory, pydoc_bytes) -> pathlib.Path:
    """traces/ with one run of the bf16 config (layers scanned, no remat) on text with validation every step,
    captured by `python -m jaxscale.run` in a process of its own: the capture lists the programs its process has
    compiled, so in this one an earlier test's train step could be the first `jit_train_step` module (the CI run of
    76e9e35 read unrolled layers' scopes and no minibatch scope from it, where the test alone passes)."""
    from conftest import run_cli

    root = tmp_path_factory.mktemp("tensorboard")
    result = run_cli(
        "jaxscale.run", "--config", str(REPO / "configs/bf16.py:tiny"),
        "--config.train.steps=1", "--config.train.warmup_steps=0", "--output_root", str(root), "--name", RUN_NAME,
        "--config.data.source=text", f"--config.data.path={pydoc_bytes}", "--config.model.vocab_size=256",
        "--config.train.eval_every=1", "--quiet",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return root / "traces"


def plugin_url(server: tensorboard.Server, route: str, **query: str) -> str:
    """A URL of the profile plugin (tensorboard-plugin-profile / xprof: /data/plugin/profile/<route>)."""
    return f"{server.url}data/plugin/profile/{route}?{urllib.parse.urlencode(query)}"


def test_profiler_lists_the_run_and_serves_its_trace_and_memory_viewer(logdir):
    with tensorboard.start(logdir) as server:
        assert server.url.startswith("http://127.0.0.1:")
        listing = fetch_json(server.url + "data/plugins_listing")
        assert listing["profile"]["enabled"], "the profile plugin is not active"

        runs = fetch_json(plugin_url(server, "runs"))
        assert len(runs) == 1 and runs[0].startswith(f"{RUN_NAME}/"), runs  # <run name>/<capture timestamp>
        run = runs[0]
        tools = fetch_json(plugin_url(server, "run_tools", run=run))
        assert {"trace_viewer@", "memory_viewer", "overview_page"} <= set(tools), tools

        hosts = fetch_json(plugin_url(server, "hosts", run=run, tag="trace_viewer@"))
        host = hosts[0]["hostname"]
        trace = fetch_json(plugin_url(server, "data", run=run, tag="trace_viewer@", host=host))
        names = {event.get("name", "") for event in trace["traceEvents"]}
        assert any(name.startswith("train ") for name in names), "no StepTraceAnnotation 'train <step>' in the trace"
        assert any(name.startswith("PjitFunction(jit(train_step))") for name in names)
        assert "input_wait" in names, "no TraceAnnotation of the step's wait for its batch"
        # Scanned layers without remat write each layer's activations into the stacked scan output.
        assert any("dynamic-update-slice" in name for name in names)

        modules = fetch(plugin_url(server, "module_list", run=run)).decode().split(",")
        step_module = next(m for m in modules if m.startswith("jit_train_step"))
        memory = fetch_json(
            plugin_url(server, "data", run=run, tag="memory_viewer", host=host, module_name=step_module)
        )
        assert memory["moduleName"] == "jit_train_step" and memory["peakHeapMib"] > 0
        buffers = memory["maxHeapBySize"]
        assert buffers and all("shapeString" in b for b in buffers if b.get("instructionName"))
        scopes = {part for b in buffers for part in b.get("tfOpName", "").split("/")}
        assert {"accumulate", "minibatch", "blocks"} <= scopes, scopes  # the model's named scopes
    assert server.process.poll() is not None  # stopped with the context


def test_scalars_show_training_and_validation_loss_of_the_run(logdir):
    row = json.loads((logdir / RUN_NAME / "result.json").read_text())
    with tensorboard.start(logdir) as server:
        tags = fetch_json(server.url + "data/plugin/scalars/tags")
        assert {"loss/train", "loss/validation"} <= set(tags[RUN_NAME]), tags
        for tag, steps, values in (
            ("loss/train", [1, 2], row["loss_all"]),
            ("loss/validation", row["validation_steps"], row["validation_loss_all"]),
        ):
            query = urllib.parse.urlencode({"run": RUN_NAME, "tag": tag})
            points = fetch_json(f"{server.url}data/plugin/scalars/scalars?{query}")  # [[wall time, step, value]]
            assert [p[1] for p in points] == steps
            assert [p[2] for p in points] == pytest.approx(values, rel=1e-6)


def test_command_prints_url_and_runs_and_stops_on_sigterm(logdir, tmp_path):
    command = [sys.executable, "-m", "jaxscale.tensorboard", "--logdir", str(logdir)]
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    with open(tmp_path / "stderr.txt", "w") as stderr:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    watchdog = threading.Timer(180, process.kill)  # never hang the suite if the server never answers
    watchdog.start()
    try:
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("Ctrl-C"):
                break
        text = "".join(lines)
        assert "TensorBoard: http://127.0.0.1:" in text and f"  {RUN_NAME}/" in text, (
            text + (tmp_path / "stderr.txt").read_text()[-2000:]
        )
        url = text.split("TensorBoard: ", 1)[1].split("#", 1)[0]
        assert fetch_json(url + "data/plugins_listing")["profile"]["enabled"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        with pytest.raises(OSError):
            fetch(url + "data/plugins_listing", timeout_s=5)  # the server went with it
    finally:
        watchdog.cancel()
        if process.poll() is None:
            process.kill()
            process.wait()


def test_command_rejects_a_missing_logdir(tmp_path, capsys):
    code = tensorboard.main(["jaxscale.tensorboard", "--logdir", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("jaxscale: error: --logdir:")
